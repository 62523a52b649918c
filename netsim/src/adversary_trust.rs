//! `netsim adversary --attacks trust`: attacks on what peers take on trust
//! (issue 14 §3), over the wire like the rest of the adversary.
//!
//! - **Catalogue poisoning**: every 3 s, [`SYBILS`] registrations signed by
//!   fresh keys advertise the honest worker's model with `context_tokens: 1`,
//!   and as many map its aliases (`gnus-auto`) to [`POISON_MODEL`]. The
//!   gateway's `/v1/models` must still report the real model and context,
//!   and requests must still be admitted.
//! - **A fake gateway's flood**: every 3 s, [`FLOOD`] jobs signed by the
//!   adversary as their gateway, for the honest worker's model. It grants
//!   every claim a lease and serves the payload, so the honest worker runs
//!   them: the worker must give it at most its `--gateway-share` of the
//!   slots (`gcs_worker_gateway_slots_peak`), and the honest gateway's
//!   streams must still complete as the reference.
//! - **A fake tenant gateway writing usage** (issue 14 §2): for every honest
//!   job it hears announced, it gossips on `gcs.usage.<tenant>` usage
//!   records it signs itself for that tenant — one under the real job's id
//!   (overwriting the honest record would erase the victim's spend), one
//!   under a new id with `u64::MAX` tokens (an overflow) — after storing a
//!   `tenant_gateway` certificate it issued to itself. The gateway must
//!   refuse them all: every request's usage record stays what its client
//!   saw (the per-request `usage` check), and the gateway logs the refusal.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use gcs_gateway::payload::{Generation, JobRequest as Payload, Message as Turn, Prompt, Role};
use gcs_node::jobs::wire::{JobRequest, JobResponse, LeasedPayload};
use gcs_node::jobs::JobSpec;
use gcs_node::{now_ms, Network};
use gcs_protocol::{
    encode, ids, open, sign, ApiRequestJob, ApiType, JobLimits, LeaseGrant, Limits,
    Message, MessageType, NodeKey, NodeRegistration, Routing, PROTOCOL_VERSION,
};

/// The model id the hijacking registrations map the honest aliases to.
pub const POISON_MODEL: &str = "netsim-poison-model";
/// Sybil registrations of each kind, per round.
pub const SYBILS: usize = 3;
/// Fake-gateway jobs announced per round.
pub const FLOOD: usize = 8;

/// Attack kinds a `--attacks trust` run must have carried out.
pub const REQUIRED: [&str; 8] = [
    "catalog_poisoned_context",
    "catalog_hijacked_alias",
    "fake_gateway_job",
    "fake_gateway_lease",
    "fake_gateway_payload",
    "usage_self_certificate",
    "usage_forged_overwrite",
    "usage_forged_overflow",
];

type Bump = Arc<dyn Fn(&str) + Send + Sync>;

/// The trust attacker's state.
pub struct Rogue {
    key: NodeKey,
    net: Network,
    limits: Limits,
    bump: Bump,
    sybils: Vec<NodeKey>,
    /// Fake jobs announced, with their payloads.
    jobs: Mutex<HashMap<String, Vec<u8>>>,
    /// Its own keyspace: the deltas it gossips are its writes.
    ks: Arc<gcs_keyspace::Keyspace>,
    /// Honest jobs heard (id, tenant), not yet answered with forged usage.
    heard: Mutex<Vec<(String, String)>>,
    /// Whether its self-issued `tenant_gateway` certificate went out.
    self_certified: Mutex<bool>,
}

impl std::fmt::Debug for Rogue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rogue").field("gateway", &self.key.node_id()).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Rogue {
    /// An attacker signing as `key` (its fake gateway's id).
    pub fn new(
        key: NodeKey,
        net: Network,
        ks: Arc<gcs_keyspace::Keyspace>,
        bump: Bump,
    ) -> anyhow::Result<Self> {
        let sybils = (0..2 * SYBILS).map(|_| NodeKey::generate()).collect::<Result<_, _>>()?;
        Ok(Self {
            key,
            net,
            limits: Limits::default(),
            bump,
            sybils,
            jobs: Mutex::default(),
            ks,
            heard: Mutex::default(),
            self_certified: Mutex::new(false),
        })
    }

    /// One round: the poisoned registrations, a flood of jobs, and forged
    /// usage for the honest jobs heard since the last round.
    pub async fn round(&self, template: &NodeRegistration) {
        self.poison(template).await;
        self.flood(template).await;
        self.forge_usage().await;
    }

    /// An honest job was announced: its tenant's usage is forged next round.
    pub fn heard(&self, job: &ApiRequestJob) {
        let mut h = lock(&self.heard);
        if !self.is_own(job) && h.len() < 64 {
            h.push((job.job_id.clone(), job.tenant.tenant_id.clone()));
        }
    }

    /// Stores `value` under `key` in its own keyspace and gossips the delta.
    async fn gossip(&self, topic: &str, key: &str, value: Vec<u8>) -> bool {
        let Ok(delta) = self.ks.put(key, value, now_ms()) else { return false };
        self.net.publish(topic, delta.encode()).await.is_ok()
    }

    /// A `tenant_gateway` certificate of `tenant` for itself, signed by its
    /// own key: a valid statement of *its* key, which no gateway trusts for
    /// the tenant.
    async fn self_certify(&self, tenant: &str) {
        let now = now_ms();
        let Ok(id) = ids::new_id(ids::MEMBERSHIP, now) else { return };
        let mut c = gcs_protocol::MembershipCertificate {
            message_type: MessageType::MembershipCertificate,
            version: PROTOCOL_VERSION,
            certificate_id: id,
            scope: gcs_protocol::MembershipScope::TenantGateway,
            group_id: tenant.into(),
            node_id: self.key.node_id(),
            issuer: self.key.node_id(),
            issued_at_ms: now - 1_000,
            expires_at_ms: now + 3_600_000,
            signature: None,
        };
        if sign(&mut c, &self.key).is_err() {
            return;
        }
        let m: Message = c.into();
        let (Some(key), Ok(b)) = (gcs_node::tenants::statement_key(&m), m.encode()) else { return };
        if self.gossip(gcs_node::topics::KEYSPACE_DELTAS, &key, b).await {
            *lock(&self.self_certified) = true;
            (self.bump)("usage_self_certificate");
        }
    }

    async fn forge_usage(&self) {
        let heard: Vec<(String, String)> = std::mem::take(&mut *lock(&self.heard));
        for (job_id, tenant) in heard {
            if !gcs_node::topics::valid_tenant(&tenant) {
                continue;
            }
            if !*lock(&self.self_certified) {
                self.self_certify(&tenant).await;
            }
            let topic = gcs_node::topics::tenant_usage(&tenant);
            let Ok(fresh) = ids::new_id(ids::JOB, now_ms()) else { continue };
            for (id, tokens, kind) in [
                (job_id.clone(), 1_000_000, "usage_forged_overwrite"),
                (fresh, u64::MAX, "usage_forged_overflow"),
            ] {
                let Some(u) = self.usage_record(&id, &tenant, tokens) else { continue };
                let Ok(b) = encode(&u) else { continue };
                if self.gossip(&topic, &gcs_keyspace::keys::usage(&id), b).await {
                    (self.bump)(kind);
                }
            }
        }
    }

    /// A usage record of `tenant` for `job_id`, signed by itself as the
    /// recording gateway.
    fn usage_record(
        &self,
        job_id: &str,
        tenant: &str,
        tokens: u64,
    ) -> Option<gcs_protocol::UsageRecord> {
        let now = now_ms();
        let mut u = gcs_protocol::UsageRecord {
            message_type: MessageType::UsageRecord,
            version: PROTOCOL_VERSION,
            job_id: job_id.into(),
            tenant_id: tenant.into(),
            project_id: "netsim".into(),
            api_key_id: ids::new_id("key_", now).ok()?,
            node_id: Some(self.key.node_id()),
            recorded_by: self.key.node_id(),
            model: "gnus-auto".into(),
            api_type: ApiType::ChatCompletion,
            network: gcs_protocol::RoutingMode::Public,
            input_tokens: tokens,
            cached_tokens: 0,
            output_tokens_generated: tokens,
            output_tokens_sent_to_client: tokens,
            embedding_tokens: 0,
            retrieval_chunks: 0,
            child_jobs: 0,
            compute_ms: 1,
            first_token_ms: Some(1),
            wall_ms: 1,
            requeue_count: 0,
            cost_gnus: "0".into(),
            cancellation_reason: None,
            failed_after_partial_output: false,
            batch_id: None,
            holders: vec![],
            parent_job_id: None,
            price_percent: None,
            created_at_ms: now,
            signature: None,
        };
        sign(&mut u, &self.key).ok()?;
        Some(u)
    }

    async fn poison(&self, template: &NodeRegistration) {
        let Some(real) = template.models.first() else { return };
        let now = now_ms();
        for (i, k) in self.sybils.iter().enumerate() {
            let mut m = real.clone();
            let kind = if i < SYBILS {
                m.context_tokens = 1;
                "catalog_poisoned_context"
            } else {
                m.model_id = POISON_MODEL.into();
                m.context_tokens = 1;
                "catalog_hijacked_alias"
            };
            let Some(r) = crate::adversary_sybil::resign(template, k, now, |r| r.models = vec![m])
            else {
                continue;
            };
            if let Ok(b) = encode(&r) {
                let _ = self.net.publish(gcs_node::topics::CAPABILITIES_ALL, b).await;
                (self.bump)(kind);
            }
        }
    }

    fn payload() -> Vec<u8> {
        let g = Generation {
            prompt: Prompt::Chat(vec![Turn::text(Role::User, "flood")]),
            max_tokens: 24,
            sampling: Default::default(),
            stop: vec![],
            logprobs: None,
            constraint: None,
            tools: None,
        };
        Payload::Generation(g).encode().unwrap_or_default()
    }

    async fn flood(&self, template: &NodeRegistration) {
        let Some(real) = template.models.first() else { return };
        let now = now_ms();
        let body = Self::payload();
        for _ in 0..FLOOD {
            let spec = JobSpec {
                api_type: ApiType::ChatCompletion,
                model: real.model_id.clone(),
                stream: true,
                body: body.clone(),
                tenant_id: "netsim-fake".into(),
                project_id: "p".into(),
                api_key_id: "k".into(),
                idempotency_key: "i".into(),
                limits: JobLimits::default(),
                max_output_tokens: 24,
                routing: Routing::public(),
                batch_id: None,
                parent: None,
                price_percent: None,
            };
            let Ok(job) = gcs_node::jobs::announce::build_job(&spec, &self.key, &body, now) else {
                continue;
            };
            lock(&self.jobs).insert(job.job_id.clone(), body.clone());
            if let Ok(b) = encode(&job) {
                let _ = self.net.publish(gcs_node::topics::API_JOBS_ALL, b).await;
                (self.bump)("fake_gateway_job");
            }
        }
        let mut jobs = lock(&self.jobs);
        if jobs.len() > 4 * FLOOD * 20 {
            jobs.clear(); // old ones expired long ago for the worker too
        }
    }

    /// The fake gateway's answer to a direct request about one of its
    /// jobs; `None` for anything else.
    pub fn answer(&self, req: &JobRequest) -> Option<JobResponse> {
        match req {
            JobRequest::FetchPayload { job_id, .. } => {
                let body = lock(&self.jobs).get(job_id).cloned()?;
                (self.bump)("fake_gateway_payload");
                let salt = gcs_protocol::Hash32::of(job_id.as_bytes()).0;
                Some(JobResponse::Payload(Box::new(LeasedPayload::new(
                    body,
                    "netsim-fake".into(),
                    salt,
                ))))
            }
            // It enqueues no processing tasks and mirrors none.
            JobRequest::FetchChunk(_) | JobRequest::DeliverOutput(_) | JobRequest::MirrorPull(_) => {
                None
            }
            JobRequest::Envelope(b) => match open(b, now_ms(), &self.limits).ok()? {
                Message::JobClaim(c) if lock(&self.jobs).contains_key(&c.job_id) => {
                    let now = now_ms();
                    let mut l = LeaseGrant {
                        message_type: MessageType::LeaseGrant,
                        version: PROTOCOL_VERSION,
                        job_id: c.job_id.clone(),
                        lease_id: ids::new_id(ids::LEASE, now).ok()?,
                        claim_id: c.claim_id.clone(),
                        node_id: c.node_id.clone(),
                        gateway_node_id: self.key.node_id(),
                        attempt: 0,
                        renew_interval_ms: 2_000,
                        created_at_ms: now,
                        expires_at_ms: now + 10_000,
                        signature: None,
                    };
                    sign(&mut l, &self.key).ok()?;
                    (self.bump)("fake_gateway_lease");
                    Some(JobResponse::Envelope(encode(&l).ok()?))
                }
                _ => None,
            },
        }
    }

    /// Whether `job` is one of its own (it hears no gossip of its own, but
    /// a relay may echo one).
    pub fn is_own(&self, job: &ApiRequestJob) -> bool {
        job.gateway_node_id == self.key.node_id()
    }
}
