//! Deterministic example messages of every type, for tests, test vectors,
//! benchmarks and fuzz seeds. `text` and `n` vary free-form fields so
//! property tests can sweep content without hand-writing a generator per type.

use crate::crypto::{Hash32, NodeKey};
use crate::envelope::{Message, MessageType, PROTOCOL_VERSION};
use crate::ids::{self, id_from_parts};
use crate::messages::*;

/// Inputs that vary a sample.
#[derive(Clone, Debug)]
pub struct Params {
    /// Free text placed in text fields.
    pub text: String,
    /// A number placed in counters and sizes.
    pub n: u64,
    /// Creation time.
    pub now_ms: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self { text: "distributed".into(), n: 12, now_ms: 1_783_468_800_000 }
    }
}

/// The fixed seeds test vectors use: worker, gateway.
pub fn keys() -> (NodeKey, NodeKey) {
    (NodeKey::from_seed([7u8; 32]), NodeKey::from_seed([42u8; 32]))
}

fn job_id(p: &Params) -> String {
    id_from_parts(ids::JOB, p.now_ms, 0x0123_4567_89ab_cdef_0123)
}
fn lease_id(p: &Params) -> String {
    id_from_parts(ids::LEASE, p.now_ms + 150, 77)
}
fn claim_id(p: &Params) -> String {
    id_from_parts(ids::CLAIM, p.now_ms + 100, 5)
}
fn reg_id(p: &Params) -> String {
    id_from_parts(ids::REGISTRATION, p.now_ms, 9)
}

/// A worker registration.
pub fn registration(worker: &NodeKey, p: &Params) -> NodeRegistration {
    NodeRegistration {
        message_type: MessageType::NodeRegistration,
        version: PROTOCOL_VERSION,
        registration_id: reg_id(p),
        node_id: worker.node_id(),
        public_key: worker.public_key(),
        swarm_id: "public".into(),
        tenant_id: None,
        status: NodeStatus::Online,
        capabilities: Capabilities {
            api_request_job: true,
            chat: true,
            completion: true,
            embedding: true,
            streaming: true,
            ..Default::default()
        },
        models: vec![ModelInfo {
            model_id: "smollm2-135m-instruct".into(),
            aliases: vec!["gnus-auto".into(), "gnus-small".into()],
            context_tokens: 8192,
            quantization: "q4_1".into(),
            backend: "burn-flex".into(),
            tasks: vec![ApiType::ChatCompletion, ApiType::Completion],
            vocab_size: 0,
            ..Default::default()
        }],
        queue: QueueInfo {
            max_concurrent_api_jobs: 8,
            max_concurrent_processing_jobs: 0,
            current_api_jobs: (p.n % 8) as u32,
            current_processing_jobs: 0,
            accepts_public_jobs: true,
            accepts_private_jobs: false,
            accepts_local_only_jobs: false,
            free_kv_tokens: p.n * 1024,
            decode_tokens_per_s: 95.5,
            accelerator: None,
        },
        trust: Trust::default(),
        heartbeat: Heartbeat {
            created_at_ms: p.now_ms,
            expires_at_ms: p.now_ms + 30_000,
            ttl_ms: 30_000,
        },
        addresses: vec!["/ip4/127.0.0.1/tcp/4001".into()],
        memberships: vec![],
        signature: None,
    }
}

/// The sample tenant's key (it signs membership certificates).
pub fn tenant_key() -> NodeKey {
    NodeKey::from_seed([11u8; 32])
}

/// A certificate of `tenant` admitting `node` to tenant `tenant_123`'s
/// private pool for a day from `p.now_ms`.
pub fn membership(tenant: &NodeKey, node: &NodeKey, p: &Params) -> MembershipCertificate {
    MembershipCertificate {
        message_type: MessageType::MembershipCertificate,
        version: PROTOCOL_VERSION,
        certificate_id: id_from_parts(ids::MEMBERSHIP, p.now_ms - 1_000, 21),
        scope: MembershipScope::TenantMember,
        group_id: "tenant_123".into(),
        node_id: node.node_id(),
        issuer: tenant.node_id(),
        issued_at_ms: p.now_ms - 1_000,
        expires_at_ms: p.now_ms - 1_000 + DEFAULT_MEMBERSHIP_TTL_MS,
        signature: None,
    }
}

/// The revocation of [`membership`].
pub fn revocation(tenant: &NodeKey, node: &NodeKey, p: &Params) -> MembershipRevocation {
    let c = membership(tenant, node, p);
    MembershipRevocation {
        message_type: MessageType::MembershipRevocation,
        version: PROTOCOL_VERSION,
        certificate_id: c.certificate_id,
        scope: c.scope,
        group_id: c.group_id,
        node_id: c.node_id,
        issuer: c.issuer,
        created_at_ms: p.now_ms + 5_000,
        signature: None,
    }
}

/// A streamed chat job with an inline payload.
pub fn api_job(gateway: &NodeKey, p: &Params) -> ApiRequestJob {
    let id = job_id(p);
    let payload =
        format!(r#"{{"messages":[{{"role":"user","content":{:?}}}]}}"#, p.text).into_bytes();
    ApiRequestJob {
        message_type: MessageType::ApiRequestJob,
        version: crate::API_JOB_VERSION,
        idempotency_key: format!("idem_{}", p.text.len()),
        gateway_node_id: gateway.node_id(),
        source: Source {
            kind: "openai_compatible_api".into(),
            endpoint: "/v1/chat/completions".into(),
            method: "POST".into(),
            client_request_id: "req_abc".into(),
        },
        // As a gateway announces it: no project, no API key (26.20.4).
        tenant: TenantRef {
            tenant_id: "tenant_123".into(),
            project_id: String::new(),
            api_key_id: String::new(),
        },
        request: RequestInfo {
            api_type: ApiType::ChatCompletion,
            model: "gnus-auto".into(),
            stream: true,
            payload_ref: PayloadRef {
                mode: PayloadMode::Inline,
                encrypted: false,
                content_hash: Hash32::of(&payload),
                size_bytes: payload.len() as u64,
                inline: Some(payload),
                location: None,
            },
        },
        routing: Routing::public(),
        requirements: Requirements {
            min_context_tokens: 2048,
            supports_streaming: true,
            supports_chat: true,
            supports_embeddings: false,
            allowed_model_aliases: vec!["gnus-auto".into(), "gnus-small".into()],
            max_input_tokens: 4096,
            max_output_tokens: 1024,
            continuation: None,
        },
        limits: JobLimits::default(),
        reply_to: ReplyTo::for_job(&id),
        job_id: id,
        created_at_ms: p.now_ms,
        expires_at_ms: p.now_ms + 120_000,
        announcement: 0,
        parent: None,
        signature: None,
    }
}

/// A claim.
pub fn claim(worker: &NodeKey, p: &Params) -> JobClaim {
    JobClaim {
        message_type: MessageType::JobClaim,
        version: PROTOCOL_VERSION,
        job_id: job_id(p),
        claim_id: claim_id(p),
        node_id: worker.node_id(),
        registration_id: reg_id(p),
        claim_policy: ClaimPolicy::FirstValidClaim,
        capability_match: CapabilityMatch {
            model_id: "smollm2-135m-instruct".into(),
            supports_streaming: true,
            context_tokens: 8192,
            api_request_job: true,
        },
        estimated: Estimates { start_ms: 50, first_token_ms: 800, wall_ms: 7000 + p.n },
        created_at_ms: p.now_ms + 100,
        expires_at_ms: p.now_ms + 1100,
        signature: None,
    }
}

/// A claim rejection.
pub fn claim_rejection(worker: &NodeKey, gateway: &NodeKey, p: &Params) -> ClaimRejection {
    ClaimRejection {
        message_type: MessageType::ClaimRejection,
        version: PROTOCOL_VERSION,
        job_id: job_id(p),
        claim_id: claim_id(p),
        node_id: worker.node_id(),
        gateway_node_id: gateway.node_id(),
        reason: ClaimRejectReason::AlreadyClaimed,
        detail: p.text.clone(),
        created_at_ms: p.now_ms + 120,
        signature: None,
    }
}

/// A lease grant.
pub fn lease(worker: &NodeKey, gateway: &NodeKey, p: &Params) -> LeaseGrant {
    LeaseGrant {
        message_type: MessageType::LeaseGrant,
        version: PROTOCOL_VERSION,
        job_id: job_id(p),
        lease_id: lease_id(p),
        claim_id: claim_id(p),
        node_id: worker.node_id(),
        gateway_node_id: gateway.node_id(),
        attempt: (p.n % 3) as u32,
        renew_interval_ms: 2_000,
        created_at_ms: p.now_ms + 150,
        expires_at_ms: p.now_ms + 10_150,
        signature: None,
    }
}

/// A lease renewal.
pub fn renewal(worker: &NodeKey, p: &Params) -> LeaseRenewal {
    LeaseRenewal {
        message_type: MessageType::LeaseRenewal,
        version: PROTOCOL_VERSION,
        job_id: job_id(p),
        lease_id: lease_id(p),
        node_id: worker.node_id(),
        chunks_sent: p.n,
        created_at_ms: p.now_ms + 2_000,
        expires_at_ms: p.now_ms + 12_000,
        signature: None,
    }
}

/// A stream chunk carrying `text`.
pub fn chunk(worker: &NodeKey, p: &Params) -> StreamChunk {
    StreamChunk {
        message_type: MessageType::StreamChunk,
        version: PROTOCOL_VERSION,
        job_id: job_id(p),
        node_id: worker.node_id(),
        lease_id: lease_id(p),
        sequence: p.n,
        delta: Delta { role: None, content: Some(p.text.clone()), ..Default::default() },
        usage_delta: UsageDelta { output_tokens: 1 },
        finish_reason: None,
        created_at_ms: p.now_ms + 1_200,
        signature: None,
    }
}

/// A completed final result.
pub fn final_result(worker: &NodeKey, p: &Params) -> FinalResult {
    FinalResult {
        message_type: MessageType::FinalResult,
        version: PROTOCOL_VERSION,
        job_id: job_id(p),
        node_id: worker.node_id(),
        lease_id: Some(lease_id(p)),
        status: ResultStatus::Completed,
        response: Some(ResponseBody {
            format: "openai.chat.completion".into(),
            body: serde_json::json!({
                "id": "chatcmpl_gnus_123",
                "object": "chat.completion",
                "created": p.now_ms / 1000,
                "model": "gnus-auto",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": p.text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 100, "completion_tokens": p.n, "total_tokens": 100 + p.n}
            }),
        }),
        error: None,
        metering: Some(Metering {
            input_tokens: 100,
            output_tokens: p.n,
            tokens_sent_to_client: p.n,
            cached_tokens: 64,
            compute_ms: 1840,
            first_token_ms: 120,
            child_jobs: 0,
            cost_gnus: "0.0031".into(),
        }),
        attestation: Some(Attestation {
            claim_id: claim_id(p),
            registration_id: reg_id(p),
            result_hash: Hash32::of(p.text.as_bytes()),
        }),
        chunks_sent: p.n,
        created_at_ms: p.now_ms + 7_000,
        signature: None,
    }
}

/// The gateway's `gnus_no_capable_nodes` error result.
pub fn error_result(gateway: &NodeKey, p: &Params) -> FinalResult {
    FinalResult {
        message_type: MessageType::FinalResult,
        version: PROTOCOL_VERSION,
        job_id: job_id(p),
        node_id: gateway.node_id(),
        lease_id: None,
        status: ResultStatus::Failed,
        response: None,
        error: Some(ErrorInfo {
            kind: "service_unavailable".into(),
            code: "gnus_no_capable_nodes".into(),
            message:
                "No GNUS nodes are currently available for the requested model and routing policy."
                    .into(),
        }),
        metering: None,
        attestation: None,
        chunks_sent: 0,
        created_at_ms: p.now_ms + 1_000,
        signature: None,
    }
}

/// A usage record.
pub fn usage(worker: &NodeKey, gateway: &NodeKey, p: &Params) -> UsageRecord {
    UsageRecord {
        message_type: MessageType::UsageRecord,
        version: PROTOCOL_VERSION,
        job_id: job_id(p),
        tenant_id: "tenant_123".into(),
        project_id: "proj_456".into(),
        api_key_id: "key_789".into(),
        node_id: Some(worker.node_id()),
        recorded_by: gateway.node_id(),
        model: "gnus-auto".into(),
        api_type: ApiType::ChatCompletion,
        network: RoutingMode::Public,
        input_tokens: 812,
        cached_tokens: 64,
        output_tokens_generated: 266 + p.n,
        output_tokens_sent_to_client: 266,
        embedding_tokens: 0,
        retrieval_chunks: 0,
        child_jobs: 0,
        compute_ms: 1840,
        first_token_ms: Some(800),
        wall_ms: 7000,
        requeue_count: 0,
        cost_gnus: "0.0031".into(),
        cancellation_reason: if p.n > 0 {
            Some(CancellationReason::ClientDisconnected)
        } else {
            None
        },
        failed_after_partial_output: false,
        batch_id: None,
        holders: vec![],
        parent_job_id: None,
        price_percent: None,
        created_at_ms: p.now_ms + 7_100,
        signature: None,
    }
}

/// A cancellation.
pub fn cancellation(gateway: &NodeKey, p: &Params) -> Cancellation {
    Cancellation {
        message_type: MessageType::Cancellation,
        version: PROTOCOL_VERSION,
        job_id: job_id(p),
        issued_by: gateway.node_id(),
        lease_id: Some(lease_id(p)),
        reason: CancellationReason::ClientDisconnected,
        last_sequence_sent: Some(p.n),
        partial_usage: PartialUsage { output_tokens_sent: p.n },
        created_at_ms: p.now_ms + 10_000,
        signature: None,
    }
}

/// A requeue.
pub fn requeue(worker: &NodeKey, gateway: &NodeKey, p: &Params) -> Requeue {
    Requeue {
        message_type: MessageType::Requeue,
        version: PROTOCOL_VERSION,
        job_id: job_id(p),
        issued_by: gateway.node_id(),
        requeue_count: 1,
        reason: RequeueReason::WorkerTimeout,
        excluded_nodes: vec![worker.node_id()],
        remaining_wall_timeout_ms: 18_000,
        created_at_ms: p.now_ms + 10_000,
        signature: None,
    }
}

/// A processing task lock.
pub fn task_lock(worker: &NodeKey, p: &Params) -> TaskLock {
    TaskLock {
        message_type: MessageType::TaskLock,
        version: PROTOCOL_VERSION,
        task_key: format!("/gcs/processing/tasks/{}", id_from_parts(ids::TASK, p.now_ms, 3)),
        lock_id: id_from_parts(ids::LOCK, p.now_ms, 4),
        node_id: worker.node_id(),
        created_at_ms: p.now_ms,
        expires_at_ms: p.now_ms + 60_000,
        signature: None,
    }
}

/// A processing task result.
pub fn task_result(worker: &NodeKey, p: &Params) -> TaskResult {
    TaskResult {
        message_type: MessageType::TaskResult,
        version: PROTOCOL_VERSION,
        task_id: id_from_parts(ids::TASK, p.now_ms, 3),
        node_id: worker.node_id(),
        subtask_results: vec![SubTaskResult {
            subtask_id: id_from_parts(ids::SUBTASK, p.now_ms, 1),
            result_hash: Hash32::of(p.text.as_bytes()),
            chunk_hashes: vec![Hash32::of(b"a"), Hash32::of(b"b")],
        }],
        created_at_ms: p.now_ms + 5_000,
        signature: None,
    }
}

/// One unsigned sample of every signed message type, in `MessageType` order
/// (the final result appears twice: completed and error).
pub fn all(worker: &NodeKey, gateway: &NodeKey, p: &Params) -> Vec<Message> {
    vec![
        registration(worker, p).into(),
        api_job(gateway, p).into(),
        claim(worker, p).into(),
        claim_rejection(worker, gateway, p).into(),
        lease(worker, gateway, p).into(),
        renewal(worker, p).into(),
        chunk(worker, p).into(),
        final_result(worker, p).into(),
        error_result(gateway, p).into(),
        usage(worker, gateway, p).into(),
        cancellation(gateway, p).into(),
        requeue(worker, gateway, p).into(),
        task_lock(worker, p).into(),
        task_result(worker, p).into(),
        membership(&tenant_key(), worker, p).into(),
        revocation(&tenant_key(), worker, p).into(),
    ]
}

/// `all`, signed by the right keys.
pub fn all_signed(worker: &NodeKey, gateway: &NodeKey, p: &Params) -> Vec<Message> {
    all(worker, gateway, p)
        .into_iter()
        .map(|mut m| {
            let tenant = tenant_key();
            let key = if m.signer() == &worker.node_id() {
                worker
            } else if m.signer() == &tenant.node_id() {
                &tenant
            } else {
                gateway
            };
            // Samples are well-formed by construction; signing cannot fail.
            let _ = m.sign(key);
            m
        })
        .collect()
}
