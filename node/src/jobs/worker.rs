//! Worker side of jobs: claim what it can serve, fetch the payload from the
//! gateway, run the engine, stream signed sequenced chunks, renew the lease,
//! send the signed final result, and stop within one decode step on
//! cancellation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gcs_protocol::{
    ids, open, sign, ApiRequestJob, Attestation, Cancellation, CapabilityMatch, ClaimPolicy, Delta,
    ErrorInfo, Estimates, FinalResult, FinishReason, Hash32, JobClaim, LeaseGrant, LeaseRenewal,
    Limits, Message, MessageType, Metering, ModelInfo, NodeKey, ResponseBody, ResultStatus,
    StreamChunk, TokenLogprob, UsageDelta, PROTOCOL_VERSION,
};
use libp2p::PeerId;
use tokio::sync::mpsc;

use super::executor::{ExecOutcome, ExecRequest, Executor};
use super::peer_of;
use super::wire::{JobRequest, JobResponse};
use crate::error::NodeError;
use crate::network::Network;
use crate::node::now_ms;

fn metering(o: &ExecOutcome, compute_ms: u64, first_token_ms: u64) -> Metering {
    Metering {
        input_tokens: o.input_tokens,
        output_tokens: o.output_tokens,
        tokens_sent_to_client: 0,
        cached_tokens: o.cached_tokens.min(o.input_tokens),
        compute_ms,
        first_token_ms,
        child_jobs: 0,
        cost_gnus: "0".into(),
    }
}

/// A signed first-valid claim of `job_id` for `model`, valid for 10 s.
pub fn signed_claim(
    job_id: &str,
    model: &ModelInfo,
    key: &NodeKey,
    registration_id: String,
    now: u64,
) -> Result<JobClaim, NodeError> {
    let mut claim = JobClaim {
        message_type: MessageType::JobClaim,
        version: PROTOCOL_VERSION,
        job_id: job_id.to_string(),
        claim_id: ids::new_id(ids::CLAIM, now)?,
        node_id: key.node_id(),
        registration_id,
        claim_policy: ClaimPolicy::FirstValidClaim,
        capability_match: CapabilityMatch {
            model_id: model.model_id.clone(),
            supports_streaming: true,
            context_tokens: model.context_tokens,
            api_request_job: true,
        },
        estimated: Estimates::default(),
        created_at_ms: now,
        expires_at_ms: now + 10_000,
        signature: None,
    };
    sign(&mut claim, key)?;
    Ok(claim)
}

fn stream_key(job_id: &str, seq: u64) -> String {
    format!("/gcs/api/streams/{job_id}/{seq:08}")
}

/// Announced jobs a busy worker remembers.
const BACKLOG: usize = 256;

/// Unacknowledged chunks allowed in flight (≤ the gateway's reorder gap of 8).
const IN_FLIGHT: usize = 8;

/// Jobs this worker is running: job id → cancel flag.
pub(crate) type ActiveJobs = Arc<Mutex<HashMap<String, Arc<AtomicBool>>>>;

/// Worker settings and state shared with job tasks.
#[derive(Clone)]
pub(crate) struct WorkerState {
    pub executor: Arc<dyn Executor>,
    pub key: Arc<NodeKey>,
    pub network: Network,
    pub models: Vec<ModelInfo>,
    pub max_jobs: usize,
    pub active: ActiveJobs,
    /// Jobs announced while every slot was taken, oldest first: claimed
    /// when a slot frees, so a busy worker queues instead of dropping them.
    pub backlog: Arc<Mutex<std::collections::VecDeque<ApiRequestJob>>>,
    pub registration_id: Arc<Mutex<String>>,
    pub limits: Limits,
    pub policy: Policy,
    /// Where the worker keeps its side of each job (job-participant scope).
    pub keyspace: Arc<gcs_keyspace::Keyspace>,
}

/// Which routing modes this worker can win (mirrors its registration, so
/// it does not claim what the gateway must refuse).
#[derive(Clone, Debug)]
pub(crate) struct Policy {
    pub private_tenant: Option<String>,
    pub public: bool,
    pub swarm_id: String,
}

impl Policy {
    fn allows(&self, job: &ApiRequestJob, me: &gcs_protocol::NodeId) -> bool {
        use gcs_protocol::RoutingMode as R;
        let r = &job.routing;
        let private = self.private_tenant.as_deref() == Some(job.tenant.tenant_id.as_str())
            && (r.allowed_nodes.is_empty() || r.allowed_nodes.contains(me));
        match r.network {
            R::Public => self.public,
            R::Private => private,
            // Public nodes wait for the re-announcement after the
            // private-first window; a claim before it is refused.
            R::Hybrid => private || (self.public && job.announcement > 0),
            R::LocalOnly => {
                self.swarm_id != crate::node::PUBLIC_SWARM && self.swarm_id == r.swarm_id
            }
            R::GatewayLocal => true,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl std::fmt::Debug for WorkerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerState").field("max_jobs", &self.max_jobs).finish_non_exhaustive()
    }
}

impl WorkerState {
    /// Jobs running now.
    pub fn load(&self) -> usize {
        lock(&self.active).len()
    }

    /// Jobs waiting in the backlog.
    pub fn backlog_len(&self) -> usize {
        lock(&self.backlog).len()
    }

    /// A job appeared on gossip: claim it if this worker can serve it.
    pub fn consider(&self, job: ApiRequestJob) {
        let me = self.key.node_id();
        if job.routing.excluded_nodes.contains(&me) || !self.policy.allows(&job, &me) {
            return;
        }
        let Some(model) = self
            .models
            .iter()
            .find(|m| m.answers_to(&job.request.model) && m.tasks.contains(&job.request.api_type))
            .cloned()
        else {
            return;
        };
        // Reserve the slot before spawning, under one lock, so a burst of
        // announcements cannot start more than `max_jobs`.
        let cancel = Arc::new(AtomicBool::new(false));
        {
            let mut active = lock(&self.active);
            if active.contains_key(&job.job_id) {
                return;
            }
            if active.len() >= self.max_jobs {
                drop(active);
                let mut backlog = lock(&self.backlog);
                if !backlog.iter().any(|j| j.job_id == job.job_id) {
                    backlog.push_back(job);
                    if backlog.len() > BACKLOG {
                        backlog.pop_front();
                    }
                }
                return;
            }
            active.insert(job.job_id.clone(), cancel.clone());
        }
        let w = self.clone();
        tokio::spawn(async move {
            let job_id = job.job_id.clone();
            if let Err(e) = w.work(job, model, cancel).await {
                tracing::info!(job_id, error = %e, "job not completed here");
            }
            lock(&w.active).remove(&job_id);
            tracing::debug!(job_id, "job slot freed");
            w.next_from_backlog();
        });
    }

    /// A slot freed: claim the oldest backlog job that has not expired.
    fn next_from_backlog(&self) {
        let now = now_ms();
        let next = {
            let mut backlog = lock(&self.backlog);
            loop {
                match backlog.pop_front() {
                    Some(j) if j.expires_at_ms <= now => continue,
                    other => break other,
                }
            }
        };
        if let Some(job) = next {
            self.consider(job);
        }
    }

    /// A cancellation from the job's gateway.
    pub fn on_cancel(&self, c: &Cancellation) -> bool {
        match lock(&self.active).get(&c.job_id) {
            Some(flag) => {
                flag.store(true, Ordering::SeqCst);
                tracing::info!(job_id = %c.job_id, reason = %c.reason, "job cancelled by the gateway");
                true
            }
            None => false,
        }
    }

    /// Job-participant scope (specs/network.md): the worker keeps the signed
    /// chunks and result it sent, so the job's stream lives on exactly its
    /// two participants. Not on a `--role all` node's own jobs: its gateway
    /// records the fenced stream under the same keys.
    fn record(&self, job: &ApiRequestJob, key: &str, bytes: &[u8]) {
        if job.gateway_node_id == self.key.node_id() {
            return;
        }
        if let Err(e) = self.keyspace.put(key, bytes.to_vec(), now_ms()) {
            tracing::warn!(job_id = %job.job_id, error = %e, "worker record not stored");
        }
    }

    async fn send(&self, gateway: PeerId, bytes: Vec<u8>) -> Result<JobResponse, NodeError> {
        self.network.request(gateway, JobRequest::Envelope(bytes)).await
    }

    async fn work(
        &self,
        job: ApiRequestJob,
        model: ModelInfo,
        cancel: Arc<AtomicBool>,
    ) -> Result<(), NodeError> {
        let gateway = peer_of(&job.gateway_node_id)
            .ok_or_else(|| NodeError::Network("bad gateway id".into()))?;
        let now = now_ms();
        // 1. Claim.
        let registration_id = lock(&self.registration_id).clone();
        let claim = signed_claim(&job.job_id, &model, &self.key, registration_id, now)?;
        let lease: LeaseGrant = match self.send(gateway, gcs_protocol::encode(&claim)?).await? {
            JobResponse::Envelope(b) => match open(&b, now_ms(), &self.limits)? {
                Message::LeaseGrant(l)
                    if l.node_id == claim.node_id && l.claim_id == claim.claim_id =>
                {
                    l
                }
                Message::ClaimRejection(r) => {
                    tracing::debug!(job_id = %job.job_id, reason = %r.reason, "claim lost");
                    return Ok(());
                }
                other => {
                    return Err(NodeError::Network(format!("unexpected {}", other.message_type())))
                }
            },
            other => return Err(NodeError::Network(format!("claim answered with {other:?}"))),
        };
        tracing::info!(job_id = %job.job_id, lease = %lease.lease_id, "lease granted");
        // 2. Payload, verified against the hash the job announced.
        let body = match self
            .network
            .request(
                gateway,
                JobRequest::FetchPayload {
                    job_id: job.job_id.clone(),
                    lease_id: lease.lease_id.clone(),
                },
            )
            .await?
        {
            JobResponse::Payload(p) if Hash32::of(&p) == job.request.payload_ref.content_hash => p,
            other => return Err(NodeError::Network(format!("payload fetch failed: {other:?}"))),
        };
        // 3. Renew the lease while running.
        let done = Arc::new(AtomicBool::new(false));
        self.spawn_renewals(gateway, lease.clone(), done.clone());
        // 4. Run the engine on a blocking thread; stream its deltas.
        let (tx, mut rx) = mpsc::channel::<(String, u32, Vec<TokenLogprob>)>(64);
        let exec = self.executor.clone();
        let req = ExecRequest {
            api_type: job.request.api_type,
            model: model.model_id.clone(),
            body,
            tenant_id: job.tenant.tenant_id.clone(),
        };
        let flag = cancel.clone();
        let started = std::time::Instant::now();
        let run = tokio::task::spawn_blocking(move || {
            exec.run(&req, &flag, &mut |text, tokens, logprobs| {
                tx.blocking_send((text.to_string(), tokens, logprobs)).is_ok()
            })
        });
        let mut seq = 0u64;
        let mut first_token_ms = 0;
        // Up to IN_FLIGHT unacknowledged chunks: the window is the stream's
        // backpressure, and stays within the gateway's reorder buffer, so a
        // round trip per token does not cap throughput on slow links.
        let window = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
        while let Some((text, tokens, logprobs)) = rx.recv().await {
            if seq == 0 {
                first_token_ms = started.elapsed().as_millis() as u64;
            }
            let c = self.chunk(&job, &lease, seq, Some(text), tokens, logprobs, None)?;
            let bytes = gcs_protocol::encode(&c)?;
            self.record(&job, &stream_key(&job.job_id, seq), &bytes);
            let permit =
                window.clone().acquire_owned().await.map_err(|_| NodeError::NetworkStopped)?;
            let (w, flag) = (self.clone(), cancel.clone());
            tokio::spawn(async move {
                if !matches!(w.send(gateway, bytes).await, Ok(JobResponse::Ack)) {
                    flag.store(true, Ordering::SeqCst);
                }
                drop(permit);
            });
            seq += 1;
        }
        // Every chunk acknowledged before the finish chunk and the result.
        let _all =
            window.acquire_many(IN_FLIGHT as u32).await.map_err(|_| NodeError::NetworkStopped)?;
        let outcome = run.await.map_err(|e| NodeError::Network(format!("engine task: {e}")))?;
        done.store(true, Ordering::SeqCst);
        let compute_ms = started.elapsed().as_millis() as u64;
        let result = match outcome {
            Ok(o) if !cancel.load(Ordering::SeqCst) => {
                let last = self.chunk(&job, &lease, seq, None, 0, vec![], Some(o.finish_reason))?;
                let bytes = gcs_protocol::encode(&last)?;
                self.record(&job, &stream_key(&job.job_id, seq), &bytes);
                let _ = self.send(gateway, bytes).await;
                self.result(&job, &lease, &claim, Ok(&o), seq + 1, compute_ms, first_token_ms)?
            }
            Ok(o) => {
                // Cancelled: the result still meters what the engine generated
                // (more than the client got), so the gateway can bill it.
                let mut r = self.result(
                    &job,
                    &lease,
                    &claim,
                    Err(("cancelled", "gnus_cancelled", "cancelled")),
                    seq,
                    compute_ms,
                    first_token_ms,
                )?;
                r.metering = Some(metering(&o, compute_ms, first_token_ms));
                r.signature = None;
                sign(&mut r, &self.key)?;
                r
            }
            Err(e) => self.result(
                &job,
                &lease,
                &claim,
                Err(("server_error", "gnus_engine_error", &e)),
                seq,
                compute_ms,
                first_token_ms,
            )?,
        };
        let bytes = gcs_protocol::encode(&result)?;
        self.record(&job, &format!("/gcs/api/results/{}", job.job_id), &bytes);
        let _ = self.send(gateway, bytes).await;
        Ok(())
    }

    fn spawn_renewals(&self, gateway: PeerId, lease: LeaseGrant, done: Arc<AtomicBool>) {
        let w = self.clone();
        tokio::spawn(async move {
            let every = Duration::from_millis(lease.renew_interval_ms.max(100));
            let term = lease.expires_at_ms - lease.created_at_ms;
            loop {
                tokio::time::sleep(every).await;
                if done.load(Ordering::SeqCst) {
                    break;
                }
                let now = now_ms();
                let mut r = LeaseRenewal {
                    message_type: MessageType::LeaseRenewal,
                    version: PROTOCOL_VERSION,
                    job_id: lease.job_id.clone(),
                    lease_id: lease.lease_id.clone(),
                    node_id: w.key.node_id(),
                    chunks_sent: 0,
                    created_at_ms: now,
                    expires_at_ms: now + term,
                    signature: None,
                };
                if sign(&mut r, &w.key).is_err() {
                    break;
                }
                match gcs_protocol::encode(&r) {
                    Ok(b) => {
                        let _ = w.send(gateway, b).await;
                    }
                    Err(_) => break,
                }
            }
        });
    }

    #[allow(clippy::too_many_arguments)]
    fn chunk(
        &self,
        job: &ApiRequestJob,
        lease: &LeaseGrant,
        seq: u64,
        text: Option<String>,
        tokens: u32,
        logprobs: Vec<TokenLogprob>,
        finish: Option<FinishReason>,
    ) -> Result<StreamChunk, NodeError> {
        let mut c = StreamChunk {
            message_type: MessageType::StreamChunk,
            version: PROTOCOL_VERSION,
            job_id: job.job_id.clone(),
            node_id: self.key.node_id(),
            lease_id: lease.lease_id.clone(),
            sequence: seq,
            delta: Delta {
                role: (seq == 0).then(|| "assistant".to_string()),
                content: text,
                logprobs,
            },
            usage_delta: UsageDelta { output_tokens: tokens },
            finish_reason: finish,
            created_at_ms: now_ms(),
            signature: None,
        };
        sign(&mut c, &self.key)?;
        Ok(c)
    }

    #[allow(clippy::too_many_arguments)]
    fn result(
        &self,
        job: &ApiRequestJob,
        lease: &LeaseGrant,
        claim: &JobClaim,
        outcome: Result<&ExecOutcome, (&str, &str, &str)>,
        chunks_sent: u64,
        compute_ms: u64,
        first_token_ms: u64,
    ) -> Result<FinalResult, NodeError> {
        let (status, response, error, metering) = match outcome {
            Ok(o) => (
                ResultStatus::Completed,
                Some(ResponseBody {
                    format: format!("openai.{}", job.request.api_type),
                    body: o.body.clone(),
                }),
                None,
                Some(metering(o, compute_ms, first_token_ms)),
            ),
            Err((kind, code, message)) => (
                if code == "gnus_cancelled" {
                    ResultStatus::Cancelled
                } else {
                    ResultStatus::Failed
                },
                None,
                Some(ErrorInfo {
                    kind: kind.into(),
                    code: code.into(),
                    message: message.chars().take(4000).collect(),
                }),
                None,
            ),
        };
        let result_hash = Hash32::of(&serde_json::to_vec(&response).unwrap_or_default());
        let mut r = FinalResult {
            message_type: MessageType::FinalResult,
            version: PROTOCOL_VERSION,
            job_id: job.job_id.clone(),
            node_id: self.key.node_id(),
            lease_id: Some(lease.lease_id.clone()),
            status,
            response,
            error,
            metering,
            attestation: Some(Attestation {
                claim_id: claim.claim_id.clone(),
                registration_id: claim.registration_id.clone(),
                result_hash,
            }),
            chunks_sent,
            created_at_ms: now_ms(),
            signature: None,
        };
        sign(&mut r, &self.key)?;
        Ok(r)
    }
}
