//! The gateway's per-job tracker (26.12–26.19): publish, first valid claim,
//! lease and renewal, fenced stream, requeue before the first token, failure
//! after it, cancellation, usage. Inputs in, effects out, time as an input;
//! the node runtime performs the effects.

use gcs_protocol::{
    ids, sign, ApiRequestJob, Cancellation, CancellationReason, ClaimRejection, ErrorInfo,
    FinalResult, JobClaim, JobState, LeaseGrant, LeaseRenewal, Limits, MessageType, NodeId,
    NodeKey, NodeRegistration, PartialUsage, ProtocolError, Requeue, RequeueReason, ResultStatus,
    RoutingMode, StreamChunk, UsageRecord, PROTOCOL_VERSION,
};

use super::claims::{validate_claim, ClaimContext};
use super::fence::{FenceConfig, StreamFence, Verdict};

mod continuation;
mod metering;
pub use continuation::Seam;
pub use metering::{bounded_metering, within_bounds, TEMPLATE_TOKENS};

/// Lease timing.
#[derive(Clone, Copy, Debug)]
pub struct TrackerConfig {
    /// Lease term before renewal is due.
    pub lease_term_ms: u64,
    /// How often the holder renews.
    pub renew_interval_ms: u64,
    /// Reorder buffer.
    pub fence: FenceConfig,
    /// How long an unclaimed job stays announced while capable workers may
    /// just be busy (they keep a backlog and claim when a slot frees);
    /// after it, an unclaimed job requeues toward `gnus_no_capable_nodes`.
    pub queue_timeout_ms: u64,
    /// Hybrid routing: how long after a job's first announcement only the
    /// tenant's private nodes may win it (26.11.3: private first, then public).
    pub private_window_ms: u64,
    /// A worker that lost a job sits out of this gateway's new jobs this
    /// long at first, doubling with each repeat (`lifecycle::penalty`;
    /// 0: never).
    pub sit_out_ms: u64,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        Self::with_lease_term(DEFAULT_LEASE_TERM_MS)
    }
}

/// The lease term a gateway grants unless told otherwise (`--lease-ms`).
pub const DEFAULT_LEASE_TERM_MS: u64 = 10_000;
/// The lease terms `--lease-ms` accepts: below 1 s a loaded worker misses
/// renewals (spurious losses, each one a continuation); above 2 min a
/// paused or cut-off holder stalls its stream that long before it is
/// replaced.
pub const LEASE_TERM_RANGE_MS: std::ops::RangeInclusive<u64> = 1_000..=120_000;

impl TrackerConfig {
    /// Defaults with a lease term of `lease_term_ms`: the holder renews
    /// five times a term (2 s of the default 10 s), so four renewals in a
    /// row may be lost or late before the lease ends.
    pub fn with_lease_term(lease_term_ms: u64) -> Self {
        Self {
            lease_term_ms,
            renew_interval_ms: (lease_term_ms / 5).max(100),
            fence: FenceConfig::default(),
            queue_timeout_ms: 30_000,
            private_window_ms: 250,
            sit_out_ms: super::penalty::BASE_MS,
        }
    }
}

/// Something that happened to the job.
#[derive(Clone, Debug)]
pub enum Input {
    /// A claim, with the claimant's latest registration.
    Claim(Box<JobClaim>, Option<Box<NodeRegistration>>),
    /// A lease renewal.
    Renewal(LeaseRenewal),
    /// A stream chunk.
    Chunk(Box<StreamChunk>),
    /// A final result.
    Result(Box<FinalResult>),
    /// The connection to a worker closed.
    WorkerDisconnected(NodeId),
    /// The client went away, timed out, ran out of quota, or an admin cancelled.
    Cancel(CancellationReason),
    /// Time passed.
    Tick,
}

/// Something the runtime must do.
#[derive(Clone, Debug)]
pub enum Effect {
    /// Announce the job (first publish or after a requeue).
    Publish(Box<ApiRequestJob>),
    /// Send a lease (grant or renewal) to its holder.
    Lease(LeaseGrant),
    /// Tell a claimant it lost, and why.
    RejectClaim(ClaimRejection),
    /// Forward chunks to the client, in order.
    Forward(Vec<StreamChunk>),
    /// Record a requeue.
    Requeue(Requeue),
    /// The holder was lost after the first token and the job is
    /// re-announced as exact continuation number `continuation`: record
    /// the requeue (the lost holder is its last excluded node).
    Continue {
        /// The signed requeue record.
        requeue: Requeue,
        /// 1 for the job's first continuation.
        continuation: u32,
    },
    /// Tell the worker to stop.
    Cancel(Cancellation),
    /// Tell a lost holder whose lease a continuation revoked to stop (it
    /// is no longer the lease holder, so it is named).
    Revoke {
        /// The revoked lease's holder.
        holder: NodeId,
        /// The signed cancellation naming its lease.
        cancellation: Cancellation,
    },
    /// A continuation's first chunk was forwarded: how long the seam took.
    Seam(Seam),
    /// The job finished: answer the client.
    Complete(Box<FinalResult>),
    /// The job failed; `after_partial_output` decides JSON error vs SSE error event.
    Fail {
        /// OpenAI-shaped error.
        error: ErrorInfo,
        /// Whether tokens already reached the client.
        after_partial_output: bool,
    },
    /// The job's usage record (exactly one per job, at its end).
    Usage(Box<UsageRecord>),
    /// The worker broke a rule the gateway can check (its metering fell
    /// outside [`bounded_metering`]): a penalty strike (`lifecycle::penalty`).
    Strike(NodeId),
}

/// Per-job state at the gateway.
#[derive(Debug)]
pub struct JobTracker {
    job: ApiRequestJob,
    config: TrackerConfig,
    state: JobState,
    fence: StreamFence,
    lease: Option<LeaseGrant>,
    attempt: u32,
    excluded: Vec<NodeId>,
    attempt_started_ms: u64,
    lease_granted_ms: u64,
    first_token_ms: Option<u64>,
    last_chunk_ms: u64,
    generated_tokens: u64,
    input_tokens: u64,
    cached_tokens: u64,
    compute_ms: u64,
    cancellation: Option<CancellationReason>,
    ever_leased: bool,
    /// Delivered before a gateway restart (see `restore_delivered`).
    restored_delivered: u64,
    /// Re-announcements so far (each is new bytes on gossip).
    announcements: u32,
    /// A public claim was turned away in the hybrid private window.
    turned_away_public: bool,
    /// Who the usage record bills: the gateway's own record, since the
    /// announcement carries no project or key (see `bill_to`).
    billing: gcs_protocol::TenantRef,
    /// Exact continuations (continuation.rs).
    cont: continuation::State,
    /// The OpenAI batch the job runs for; its usage record names it.
    batch_id: Option<String>,
    /// The price applied to its tokens (batch work); its record says so.
    price_percent: Option<u8>,
}

fn err(kind: &str, code: &str, message: &str) -> ErrorInfo {
    ErrorInfo { kind: kind.into(), code: code.into(), message: message.into() }
}

impl JobTracker {
    /// Starts tracking a signed job; the first effect publishes it.
    pub fn new(job: ApiRequestJob, config: TrackerConfig, now_ms: u64) -> (Self, Vec<Effect>) {
        let t = Self {
            fence: StreamFence::new(&job.job_id, config.fence),
            config,
            state: JobState::Published,
            lease: None,
            attempt: 0,
            excluded: job.routing.excluded_nodes.clone(),
            attempt_started_ms: now_ms,
            lease_granted_ms: 0,
            first_token_ms: None,
            last_chunk_ms: now_ms,
            generated_tokens: 0,
            input_tokens: 0,
            cached_tokens: 0,
            compute_ms: 0,
            cancellation: None,
            ever_leased: false,
            restored_delivered: 0,
            announcements: 0,
            turned_away_public: false,
            billing: job.tenant.clone(),
            cont: continuation::State::default(),
            batch_id: None,
            price_percent: None,
            job,
        };
        let publish = Effect::Publish(Box::new(t.job.clone()));
        (t, vec![publish])
    }

    /// Re-attaches the lease recorded before a gateway restart, so a
    /// cancellation reaches its holder.
    pub fn restore_lease(&mut self, lease: Option<LeaseGrant>) {
        if let Some(l) = lease {
            self.fence.grant(&l.lease_id, l.node_id.clone());
            self.lease = Some(l);
            self.ever_leased = true;
        }
    }

    /// Re-attaches what the client had received before a gateway restart
    /// (the fenced stream is recorded), so the usage record of a recovered
    /// job bills what was delivered and generated, not zero.
    pub fn restore_delivered(&mut self, tokens: u64) {
        self.restored_delivered = tokens;
        self.generated_tokens = self.generated_tokens.max(tokens);
    }

    /// Bills the job's usage to `billing` (what the gateway kept of the
    /// request) rather than to the announcement's tenant reference.
    pub fn bill_to(&mut self, billing: gcs_protocol::TenantRef) {
        self.billing = billing;
    }

    /// Names the batch the job runs for in its usage record.
    pub fn for_batch(&mut self, batch_id: Option<String>) {
        self.batch_id = batch_id;
    }

    /// The price its usage record applies to its tokens (`None`: full).
    pub fn priced(&mut self, percent: Option<u8>) {
        self.price_percent = percent;
    }

    /// The signed job it tracks.
    pub fn job(&self) -> &ApiRequestJob {
        &self.job
    }

    /// Current state (26.13.1).
    pub fn state(&self) -> JobState {
        self.state
    }

    /// The current lease.
    pub fn lease(&self) -> Option<&LeaseGrant> {
        self.lease.as_ref()
    }

    /// Tokens forwarded to the client.
    pub fn delivered_tokens(&self) -> u64 {
        self.fence.delivered_tokens().saturating_add(self.restored_delivered)
    }

    fn set(&mut self, s: JobState) {
        if self.state != s && self.state.can_transition_to(s) {
            self.state = s;
        }
    }

    /// Feeds one input; `key` is the gateway's signing key.
    pub fn handle(
        &mut self,
        input: Input,
        now_ms: u64,
        key: &NodeKey,
        limits: &Limits,
    ) -> Vec<Effect> {
        if self.state.is_terminal() {
            return match input {
                Input::Claim(c, _) => {
                    self.reject(&c, gcs_protocol::ClaimRejectReason::AlreadyClaimed, key, now_ms)
                }
                _ => vec![],
            };
        }
        let r = match input {
            Input::Claim(c, reg) => self.on_claim(&c, reg.as_deref(), now_ms, key, limits),
            Input::Renewal(r) => self.on_renewal(&r, now_ms, key),
            Input::Chunk(c) => Ok(self.on_chunk(*c, now_ms, key)),
            Input::Result(r) => Ok(self.on_result(*r, now_ms, key)),
            Input::WorkerDisconnected(n) => {
                Ok(self.on_worker_lost(&n, RequeueReason::WorkerDisconnected, now_ms, key))
            }
            Input::Cancel(reason) => Ok(self.cancel(reason, now_ms, key)),
            Input::Tick => Ok(self.on_tick(now_ms, key)),
        };
        r.unwrap_or_else(|e| {
            tracing::error!(job = %self.job.job_id, error = %e, "cannot sign a lifecycle message");
            self.fail(err("server_error", "gnus_internal", "internal signing error"), now_ms, key)
        })
    }

    fn reject(
        &self,
        c: &JobClaim,
        reason: gcs_protocol::ClaimRejectReason,
        key: &NodeKey,
        now: u64,
    ) -> Vec<Effect> {
        let mut r = ClaimRejection {
            message_type: MessageType::ClaimRejection,
            version: PROTOCOL_VERSION,
            job_id: c.job_id.clone(),
            claim_id: c.claim_id.clone(),
            node_id: c.node_id.clone(),
            gateway_node_id: key.node_id(),
            reason,
            detail: String::new(),
            created_at_ms: now,
            signature: None,
        };
        match sign(&mut r, key) {
            Ok(()) => vec![Effect::RejectClaim(r)],
            Err(_) => vec![],
        }
    }

    fn on_claim(
        &mut self,
        c: &JobClaim,
        reg: Option<&NodeRegistration>,
        now: u64,
        key: &NodeKey,
        limits: &Limits,
    ) -> Result<Vec<Effect>, ProtocolError> {
        let mut job = self.job.clone();
        job.routing.excluded_nodes = self.excluded.clone();
        job.requirements.continuation = self.pending_offer();
        let ctx = ClaimContext {
            job: Some(&job),
            registration: reg,
            already_claimed: self.lease.is_some(),
            now_ms: now,
            limits,
        };
        if let Err(reason) = validate_claim(c, &ctx) {
            return Ok(self.reject(c, reason, key, now));
        }
        if job.routing.network == RoutingMode::Hybrid
            && now < self.job.created_at_ms + self.config.private_window_ms
            && !reg.is_some_and(|r| super::claims::private_ok(&job, r, now))
        {
            // Re-announced when the window closes (see `on_tick`).
            self.turned_away_public = true;
            return Ok(self.reject(c, gcs_protocol::ClaimRejectReason::PrivateFirst, key, now));
        }
        let mut lease = LeaseGrant {
            message_type: MessageType::LeaseGrant,
            version: PROTOCOL_VERSION,
            job_id: self.job.job_id.clone(),
            lease_id: ids::new_id(ids::LEASE, now)?,
            claim_id: c.claim_id.clone(),
            node_id: c.node_id.clone(),
            gateway_node_id: key.node_id(),
            attempt: self.attempt,
            renew_interval_ms: self.config.renew_interval_ms,
            created_at_ms: now,
            expires_at_ms: now + self.config.lease_term_ms,
            signature: None,
        };
        sign(&mut lease, key)?;
        if self.cont.pending {
            self.grant_continuation(&lease.lease_id, lease.node_id.clone(), now);
        } else {
            self.fence.grant(&lease.lease_id, lease.node_id.clone());
        }
        self.note_holder(reg);
        self.lease = Some(lease.clone());
        self.lease_granted_ms = now;
        self.ever_leased = true;
        self.set(JobState::Claimed);
        self.set(JobState::Accepted);
        Ok(vec![Effect::Lease(lease)])
    }

    fn holder_matches(&self, node: &NodeId, lease_id: &str) -> bool {
        self.lease.as_ref().is_some_and(|l| &l.node_id == node && l.lease_id == lease_id)
    }

    fn on_renewal(
        &mut self,
        r: &LeaseRenewal,
        now: u64,
        key: &NodeKey,
    ) -> Result<Vec<Effect>, ProtocolError> {
        if !self.holder_matches(&r.node_id, &r.lease_id) || gcs_protocol::verify(r).is_err() {
            if self.revoked_unanswered(&r.lease_id, &r.node_id) && gcs_protocol::verify(r).is_ok() {
                return Ok(self.late_from_revoked(&r.lease_id, &r.node_id, now, key));
            }
            return Ok(vec![]);
        }
        let Some(mut lease) = self.lease.clone() else { return Ok(vec![]) };
        lease.created_at_ms = now;
        lease.expires_at_ms = now + self.config.lease_term_ms;
        lease.signature = None;
        sign(&mut lease, key)?;
        self.lease = Some(lease.clone());
        Ok(vec![Effect::Lease(lease)])
    }

    fn on_chunk(&mut self, c: StreamChunk, now: u64, key: &NodeKey) -> Vec<Effect> {
        // A revoked holder's chunk (signed by it) gets its cancel again.
        let late = self.revoked_unanswered(&c.lease_id, &c.node_id)
            && gcs_protocol::verify(&c).is_ok();
        let from = (c.lease_id.clone(), c.node_id.clone());
        match self.fence.on_chunk(c, now) {
            Verdict::Deliver(cs) => {
                self.first_token_ms.get_or_insert(now);
                self.last_chunk_ms = now;
                self.generated_tokens = self.generated_tokens.max(self.fence.delivered_tokens());
                self.set(JobState::Executing);
                self.set(JobState::Streaming);
                let mut out = vec![Effect::Forward(cs)];
                out.extend(self.seam_closed(now));
                out
            }
            Verdict::Rejected(_) if late => self.late_from_revoked(&from.0, &from.1, now, key),
            Verdict::Failed(f) => {
                let msg = format!("the worker's stream broke ({f:?})");
                self.fail(err("server_error", "gnus_stream_broken", &msg), now, key)
            }
            Verdict::Buffered | Verdict::Duplicate | Verdict::Rejected(_) => vec![],
        }
    }

    fn on_result(&mut self, r: FinalResult, now: u64, key: &NodeKey) -> Vec<Effect> {
        let from_holder = r.lease_id.as_deref().is_some_and(|l| self.holder_matches(&r.node_id, l));
        if !from_holder || gcs_protocol::verify(&r).is_err() {
            return vec![];
        }
        let mut out = vec![];
        if let Some(m) = &r.metering {
            let b = bounded_metering(&self.job, m, self.delivered_tokens());
            if !within_bounds(m, &b) {
                tracing::info!(job = %self.job.job_id, node = %r.node_id, "metering outside its bounds");
                out.push(Effect::Strike(r.node_id.clone()));
            }
            self.generated_tokens = self.generated_tokens.max(b.output_tokens);
            self.input_tokens = b.input_tokens;
            self.cached_tokens = b.cached_tokens;
            self.compute_ms = b.compute_ms;
        }
        out.extend(self.on_result_status(r, now, key));
        out
    }

    fn on_result_status(&mut self, r: FinalResult, now: u64, key: &NodeKey) -> Vec<Effect> {
        match r.status {
            ResultStatus::Completed => {
                self.fence.close();
                self.set(JobState::Executing);
                self.set(JobState::Completed);
                let mut out = vec![Effect::Complete(Box::new(r))];
                out.extend(self.usage(now, key));
                out
            }
            _ => {
                let e = r
                    .error
                    .clone()
                    .unwrap_or_else(|| err("server_error", "gnus_worker_failed", "worker failed"));
                let node = r.node_id.clone();
                if e.is_client_error() {
                    // The worker refused the request itself (the gateway's
                    // validation is the engine's, so this is rare: e.g. a
                    // prompt that tokenises past the context). Another worker
                    // would refuse it too: answer the client now, no requeue,
                    // and no strike (only requeues and gnus_worker_lost
                    // strike). The code is ours, not the worker's; its
                    // message is bounded by the result's field limits. A
                    // lying holder gains nothing it could not do already by
                    // streaming a wrong answer.
                    let e = ErrorInfo::invalid_request(e.message);
                    self.fail(e, now, key)
                } else if self.fence.started() {
                    // Failed after partial output: continued elsewhere if
                    // it can be (the holder is left out), else as before.
                    match self.try_continue(RequeueReason::InvalidResult, now, key) {
                        Some(effects) => effects,
                        None => self.fail(e, now, key),
                    }
                } else if e.code == crate::jobs::sealed::PayloadError::CODE {
                    // A sealed payload that did not open on its holder: the
                    // fault may be this gateway's, so no strike
                    // (`PayloadUnreadable`); the holder is still left out.
                    self.on_worker_lost(&node, RequeueReason::PayloadUnreadable, now, key)
                } else {
                    self.on_worker_lost(&node, RequeueReason::InvalidResult, now, key)
                }
            }
        }
    }

    /// The holder is gone or failed: requeue before the first token (26.16.9);
    /// after it, an exact continuation on a worker of the same engine build
    /// and model file when the job allows one (continuation.rs), else fail —
    /// never switch workers silently to one that would answer differently.
    fn on_worker_lost(
        &mut self,
        node: &NodeId,
        reason: RequeueReason,
        now: u64,
        key: &NodeKey,
    ) -> Vec<Effect> {
        if self.lease.as_ref().is_none_or(|l| &l.node_id != node) {
            return vec![];
        }
        if self.fence.started() {
            if let Some(effects) = self.try_continue(reason, now, key) {
                return effects;
            }
            return self.fail(worker_lost(), now, key);
        }
        self.requeue(reason, now, key)
    }

    fn requeue(&mut self, reason: RequeueReason, now: u64, key: &NodeKey) -> Vec<Effect> {
        let wall_left =
            (self.job.created_at_ms + self.job.limits.wall_timeout_ms).saturating_sub(now);
        if self.attempt >= self.job.limits.max_requeues || wall_left == 0 {
            let e = if !self.ever_leased {
                no_capable_nodes()
            } else {
                err(
                    "server_error",
                    "gnus_requeue_exhausted",
                    "the job failed on every worker that took it",
                )
            };
            return self.fail(e, now, key);
        }
        if let Some(l) = self.lease.take() {
            self.excluded.push(l.node_id);
        }
        self.attempt += 1;
        self.attempt_started_ms = now;
        self.fence = StreamFence::new(&self.job.job_id, self.config.fence);
        self.set(JobState::Requeued);
        let mut rq = Requeue {
            message_type: MessageType::Requeue,
            version: PROTOCOL_VERSION,
            job_id: self.job.job_id.clone(),
            issued_by: key.node_id(),
            requeue_count: self.attempt,
            reason,
            excluded_nodes: self.excluded.clone(),
            remaining_wall_timeout_ms: wall_left,
            created_at_ms: now,
            signature: None,
        };
        if sign(&mut rq, key).is_err() {
            return vec![];
        }
        match self.announcement(key) {
            Some(publish) => vec![Effect::Requeue(rq), publish],
            None => vec![],
        }
    }

    /// The job as announced now: excluded nodes change on requeue, so it is
    /// signed anew.
    fn announcement(&mut self, key: &NodeKey) -> Option<Effect> {
        self.announcements += 1;
        let mut job = self.job.clone();
        job.announcement = self.announcements;
        job.routing.excluded_nodes = self.excluded.clone();
        job.requirements.continuation = self.cont.offer.clone();
        job.signature = None;
        sign(&mut job, key).ok()?;
        Some(Effect::Publish(Box::new(job)))
    }

    fn on_tick(&mut self, now: u64, key: &NodeKey) -> Vec<Effect> {
        let l = &self.job.limits;
        if now >= self.job.created_at_ms + l.wall_timeout_ms {
            let mut out = self.cancel_worker(CancellationReason::Timeout, now, key);
            out.extend(self.fail(
                err("timeout", "gnus_wall_timeout", "the request exceeded its wall-clock timeout"),
                now,
                key,
            ));
            return out;
        }
        if let Some(f) = self.fence.on_tick(now) {
            let msg = format!("the worker's stream broke ({f:?})");
            return self.fail(err("server_error", "gnus_stream_broken", &msg), now, key);
        }
        if self.lease.is_none()
            && self.turned_away_public
            && now >= self.job.created_at_ms + self.config.private_window_ms
        {
            // No private node took it in its window: public nodes that were
            // turned away hear it again now and may win it.
            self.turned_away_public = false;
            self.attempt_started_ms = now;
            return self.announcement(key).into_iter().collect();
        }
        match &self.lease {
            None if self.cont.pending && now >= self.attempt_started_ms + l.claim_timeout_ms => {
                if self.continuation_waits(now) {
                    // Announce again (a worker that joined or freed a slot
                    // since hears of it) and keep waiting.
                    self.attempt_started_ms = now;
                    return self.announcement(key).into_iter().collect();
                }
                // No worker of the lost holder's build and file claimed the
                // continuation in time: the error of before.
                self.fail(worker_lost(), now, key)
            }
            None if now >= self.attempt_started_ms + l.claim_timeout_ms => {
                let queued_until = (self.job.created_at_ms + self.config.queue_timeout_ms)
                    .min(self.job.created_at_ms + l.wall_timeout_ms);
                if now < queued_until {
                    // Capable workers may all be busy: announce again (a
                    // worker that joined since hears of it) and keep waiting.
                    self.attempt_started_ms = now;
                    return self.announcement(key).into_iter().collect();
                }
                self.requeue(RequeueReason::NoValidClaim, now, key)
            }
            None => vec![],
            Some(lease) => {
                let holder = lease.node_id.clone();
                if now > lease.expires_at_ms {
                    self.on_worker_lost(&holder, RequeueReason::WorkerTimeout, now, key)
                } else if !self.fence.started()
                    && now >= self.lease_granted_ms + l.first_token_timeout_ms
                {
                    self.on_worker_lost(
                        &holder,
                        RequeueReason::WorkerFailedBeforeFirstToken,
                        now,
                        key,
                    )
                } else if self.fence.started()
                    && now >= self.last_chunk_ms + l.idle_stream_timeout_ms
                {
                    let mut out = self.cancel_worker(CancellationReason::Timeout, now, key);
                    out.extend(self.fail(
                        err("timeout", "gnus_idle_timeout", "the stream went idle"),
                        now,
                        key,
                    ));
                    out
                } else {
                    vec![]
                }
            }
        }
    }

    fn cancel_worker(
        &mut self,
        reason: CancellationReason,
        now: u64,
        key: &NodeKey,
    ) -> Vec<Effect> {
        self.cancellation = Some(reason);
        let mut c = Cancellation {
            message_type: MessageType::Cancellation,
            version: PROTOCOL_VERSION,
            job_id: self.job.job_id.clone(),
            issued_by: key.node_id(),
            lease_id: self.lease.as_ref().map(|l| l.lease_id.clone()),
            reason,
            last_sequence_sent: self.fence.next_seq().checked_sub(1),
            partial_usage: PartialUsage { output_tokens_sent: self.delivered_tokens() },
            created_at_ms: now,
            signature: None,
        };
        match sign(&mut c, key) {
            Ok(()) => vec![Effect::Cancel(c)],
            Err(_) => vec![],
        }
    }

    fn cancel(&mut self, reason: CancellationReason, now: u64, key: &NodeKey) -> Vec<Effect> {
        let mut out = self.cancel_worker(reason, now, key);
        self.fence.close();
        self.set(JobState::Cancelled);
        out.extend(self.usage(now, key));
        out
    }

    fn fail(&mut self, error: ErrorInfo, now: u64, key: &NodeKey) -> Vec<Effect> {
        let after = self.fence.started();
        self.fence.close();
        self.set(JobState::Failed);
        let mut out = vec![Effect::Fail { error, after_partial_output: after }];
        out.extend(self.usage(now, key));
        out
    }
}

/// The holder was lost after the first token and the stream could not
/// continue (26.16.9).
fn worker_lost() -> ErrorInfo {
    err("server_error", "gnus_worker_lost", "the worker failed mid-stream")
}

/// 26.17.2.
pub fn no_capable_nodes() -> ErrorInfo {
    err(
        "service_unavailable",
        "gnus_no_capable_nodes",
        "No GNUS nodes are currently available for the requested model and routing policy.",
    )
}

#[cfg(test)]
mod continuation_tests;
#[cfg(test)]
mod metering_tests;
#[cfg(test)]
mod tests;
