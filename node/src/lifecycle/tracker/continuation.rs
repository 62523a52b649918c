//! Exact continuation, the tracker's side (extension of 26.16.9,
//! specs/lifecycle.md "Exact continuation"): a lease holder lost after the
//! first token is replaced by a worker of the same engine build and model
//! file, which continues the stream from the fence's continuation point,
//! instead of the stream ending with `gnus_worker_lost`.

use gcs_protocol::{
    sign, Cancellation, CancellationReason, Continuation, ContinuationOffer, HolderTokens,
    MessageType, NodeId, NodeKey, NodeRegistration, PartialUsage, Requeue, RequeueReason,
    CONTINUATION_VERSION, MAX_CONTINUATIONS, PROTOCOL_VERSION,
};

use super::{Effect, JobTracker};
use crate::lifecycle::fence::ContinuationPoint;

/// What the tracker keeps for exact continuations.
#[derive(Debug, Default)]
pub(super) struct State {
    /// The current holder's `(engine_build, model_hash)` for the job's
    /// model, from the registration its claim was validated against.
    holder_model: Option<(String, String)>,
    /// Continuations started so far.
    pub(super) count: u32,
    /// The offer of the latest continuation (announced, then leased).
    pub(super) offer: Option<ContinuationOffer>,
    /// What the latest continuation's holder resumes from.
    handoff: Option<Continuation>,
    /// Whether a continuation is announced and no claim has won it yet.
    pub(super) pending: bool,
    /// The seed the job samples with (0 for greedy: it draws none).
    seed: u64,
    /// Tokens each earlier holder delivered, in order.
    shares: Vec<HolderTokens>,
    /// The seam being timed: when the last chunk before the loss was
    /// forwarded, when the loss was detected, when the continuation was
    /// leased (gateway clock, ms).
    seam: Option<(u64, u64, Option<u64>)>,
    /// Leases a continuation revoked (at most `MAX_CONTINUATIONS`): lease
    /// id, holder, and whether its cancel was sent again on a late message.
    revoked: Vec<(String, NodeId, bool)>,
}

/// Where the client's wait at one continuation seam went (ms, gateway
/// clock); the gap the client sees is their sum plus transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seam {
    /// The last chunk forwarded before the loss → the loss detected
    /// (disconnect, failed result, or lease expiry: for a paused or cut-off
    /// holder this is most of a lease term).
    pub detect_ms: u64,
    /// The loss detected (the continuation is announced at once) → the
    /// continuation lease granted: the claim round.
    pub claim_ms: u64,
    /// The lease granted → the first continued chunk forwarded: payload
    /// fetch, the new holder's prefill of prompt + delivered tokens, its
    /// first token.
    pub resume_ms: u64,
}

impl Seam {
    /// The whole gap, last chunk before to first chunk after.
    pub fn total_ms(&self) -> u64 {
        self.detect_ms + self.claim_ms + self.resume_ms
    }
}

impl JobTracker {
    /// The seed the job's payload samples with (the client's or the one
    /// assigned at admission): a continuation's holder replays with it.
    pub fn set_seed(&mut self, seed: Option<u64>) {
        self.cont.seed = seed.unwrap_or(0);
    }

    /// What the current lease holder resumes from, when its lease is a
    /// continuation's (goes into its payload answer, to it only).
    pub fn continuation(&self) -> Option<&Continuation> {
        if self.cont.pending || self.lease.is_none() {
            return None;
        }
        self.cont.handoff.as_ref()
    }

    /// Continuations started for this job.
    pub fn continuations(&self) -> u32 {
        self.cont.count
    }

    /// Who delivered which output tokens: empty for a job that never
    /// continued; otherwise every holder in order, the last being the
    /// current (or last) one.
    pub fn holder_shares(&self) -> Vec<HolderTokens> {
        if self.cont.count == 0 {
            return vec![];
        }
        let mut out = self.cont.shares.clone();
        if let Some(l) = &self.lease {
            let before: u64 = out.iter().map(|s| s.output_tokens).sum();
            let tokens = self.delivered_tokens().saturating_sub(before);
            out.push(HolderTokens { node_id: l.node_id.clone(), output_tokens: tokens });
        }
        out
    }

    /// A claim won: remembers what the winner serves the job's model with.
    pub(super) fn note_holder(&mut self, reg: Option<&NodeRegistration>) {
        self.cont.holder_model = reg.and_then(|r| r.model(&self.job.request.model)).and_then(|m| {
            (!m.engine_build.is_empty() && !m.model_hash.is_empty())
                .then(|| (m.engine_build.clone(), m.model_hash.clone()))
        });
    }

    /// The offer a claim is validated against: only while a continuation
    /// waits for its claim.
    pub(super) fn pending_offer(&self) -> Option<ContinuationOffer> {
        self.cont.offer.clone().filter(|_| self.cont.pending)
    }

    /// Whether a continuation no worker claimed in its last round stays
    /// announced for another: until the gateway's queue timeout after the
    /// loss, as an unclaimed new job does (a matching worker may be busy
    /// and claim from its backlog when a slot frees, or be starting), the
    /// wall timeout still ending it. The client's stream pauses (keepalive
    /// comments) rather than failing after partial output; never past the
    /// stream's idle timeout, so the client hears `gnus_worker_lost`, the
    /// true cause, before the edge would end it as idle.
    pub(super) fn continuation_waits(&self, now: u64) -> bool {
        // The seam being timed holds the loss (set with `pending`).
        let Some((_, lost_ms, _)) = self.cont.seam else { return false };
        let idle_ends = self.last_chunk_ms.saturating_add(self.job.limits.idle_stream_timeout_ms);
        let until = lost_ms.saturating_add(self.config.queue_timeout_ms).min(idle_ends);
        self.cont.pending && now < until
    }

    /// Whether the job's stream may continue on another worker now, and
    /// from where.
    fn continuable(&self, now: u64) -> Option<(ContinuationPoint, (String, String))> {
        let allowed = self.job.limits.max_continuations.min(MAX_CONTINUATIONS);
        if self.cont.count >= allowed {
            return None;
        }
        let l = &self.job.limits;
        let wall_left = (self.job.created_at_ms + l.wall_timeout_ms).saturating_sub(now);
        // At least one claim round must fit before the wall timeout.
        if wall_left <= l.claim_timeout_ms {
            return None;
        }
        let point = self.fence.continuation_point()?;
        // Every allowed token delivered, only the finish missing: no engine
        // can continue that (the new holder refuses it), so offering it
        // would only wait out claim rounds before the same error.
        let max = u64::from(self.job.requirements.max_output_tokens);
        if max > 0 && point.delivered_tokens.len() as u64 >= max {
            return None;
        }
        Some((point, self.cont.holder_model.clone()?))
    }

    /// The holder was lost after the first token: if the job can continue,
    /// re-announces it as a continuation (the lost holder excluded) and
    /// returns the effects; `None` leaves the caller to fail the job as
    /// before.
    pub(super) fn try_continue(
        &mut self,
        reason: RequeueReason,
        now: u64,
        key: &NodeKey,
    ) -> Option<Vec<Effect>> {
        let (point, (engine_build, model_hash)) = self.continuable(now)?;
        let number = self.cont.count + 1;
        let handoff = Continuation {
            version: CONTINUATION_VERSION,
            job_id: self.job.job_id.clone(),
            continuation: number,
            from_sequence: point.from_sequence,
            delivered_tokens: point.delivered_tokens,
            delivered_text_hash: point.delivered_text_hash,
            seed: self.cont.seed,
            engine_build,
            model_hash,
        };
        if handoff.check().is_err() {
            return None;
        }
        let wall_left =
            (self.job.created_at_ms + self.job.limits.wall_timeout_ms).saturating_sub(now);
        let lost = self.lease.take()?;
        // Its chunks are refused from now on, not only once the next lease
        // is granted: a late one must not move the continuation point.
        self.fence.revoke();
        self.cont.seam = Some((self.last_chunk_ms, now, None));
        let revoke = self.revoke_cancel(&lost.lease_id, &lost.node_id, now, key);
        self.cont.revoked.push((lost.lease_id.clone(), lost.node_id.clone(), false));
        let before: u64 = self.cont.shares.iter().map(|s| s.output_tokens).sum();
        self.cont.shares.push(HolderTokens {
            node_id: lost.node_id.clone(),
            output_tokens: self.delivered_tokens().saturating_sub(before),
        });
        self.excluded.push(lost.node_id);
        self.cont.count = number;
        self.cont.offer = Some(ContinuationOffer::of(&handoff));
        self.cont.handoff = Some(handoff);
        self.cont.pending = true;
        self.cont.holder_model = None;
        self.attempt_started_ms = now;
        self.set(gcs_protocol::JobState::Requeued);
        // Stored like a requeue (its own index after the job's requeues:
        // no plain requeue follows a started stream).
        let mut rq = Requeue {
            message_type: MessageType::Requeue,
            version: PROTOCOL_VERSION,
            job_id: self.job.job_id.clone(),
            issued_by: key.node_id(),
            requeue_count: self.attempt + number,
            reason,
            excluded_nodes: self.excluded.clone(),
            remaining_wall_timeout_ms: wall_left,
            created_at_ms: now,
            signature: None,
        };
        sign(&mut rq, key).ok()?;
        let publish = self.announcement(key)?;
        tracing::info!(job = %self.job.job_id, continuation = number, %reason, "stream continues on another worker");
        let mut out = vec![Effect::Continue { requeue: rq, continuation: number }, publish];
        out.extend(revoke);
        Some(out)
    }

    /// A cancellation of a revoked lease, to its (lost) holder: a paused or
    /// cut-off holder stops generating for nobody as soon as it hears it,
    /// not at its own lease's end. `timeout`: its lease is over. Not the
    /// job's cancellation (the usage record names none for it).
    fn revoke_cancel(
        &self,
        lease_id: &str,
        holder: &NodeId,
        now: u64,
        key: &NodeKey,
    ) -> Option<Effect> {
        let mut c = Cancellation {
            message_type: MessageType::Cancellation,
            version: PROTOCOL_VERSION,
            job_id: self.job.job_id.clone(),
            issued_by: key.node_id(),
            lease_id: Some(lease_id.into()),
            reason: CancellationReason::Timeout,
            last_sequence_sent: self.fence.next_seq().checked_sub(1),
            partial_usage: PartialUsage { output_tokens_sent: self.delivered_tokens() },
            created_at_ms: now,
            signature: None,
        };
        sign(&mut c, key).ok()?;
        Some(Effect::Revoke { holder: holder.clone(), cancellation: c })
    }

    /// Whether `lease_id` of `node` was revoked by a continuation and its
    /// cancel not yet sent again.
    pub(super) fn revoked_unanswered(&self, lease_id: &str, node: &NodeId) -> bool {
        self.cont.revoked.iter().any(|(l, n, again)| l == lease_id && n == node && !again)
    }

    /// A chunk or renewal arrived under `lease_id` from `node` and was
    /// refused: if it is a lease a continuation revoked, its holder did not
    /// hear the cancel (it was cut off, the request failed): sent once more
    /// now that it is reachable again.
    pub(super) fn late_from_revoked(
        &mut self,
        lease_id: &str,
        node: &NodeId,
        now: u64,
        key: &NodeKey,
    ) -> Vec<Effect> {
        let Some(i) =
            self.cont.revoked.iter().position(|(l, n, again)| l == lease_id && n == node && !again)
        else {
            return vec![];
        };
        self.cont.revoked[i].2 = true;
        self.revoke_cancel(lease_id, node, now, key).into_iter().collect()
    }

    /// A chunk was forwarded: the first one after a continuation's grant
    /// closes its seam.
    pub(super) fn seam_closed(&mut self, now: u64) -> Option<Effect> {
        let (last, lost, Some(leased)) = self.cont.seam? else { return None };
        self.cont.seam = None;
        Some(Effect::Seam(Seam {
            detect_ms: lost.saturating_sub(last),
            claim_ms: leased.saturating_sub(lost),
            resume_ms: now.saturating_sub(leased),
        }))
    }

    /// A continuation lease was granted (see `on_claim`): numbering goes on
    /// from the continuation point, and the idle timer restarts so the new
    /// holder's replay of the delivered prefix is not taken for a stall.
    pub(super) fn grant_continuation(&mut self, lease_id: &str, holder: NodeId, now: u64) {
        self.fence.continue_with(lease_id, holder);
        self.cont.pending = false;
        if let Some((_, _, leased)) = &mut self.cont.seam {
            *leased = Some(now);
        }
        self.last_chunk_ms = now;
    }
}
