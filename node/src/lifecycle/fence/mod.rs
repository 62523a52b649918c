//! Stream fencing (26.16.11): the gateway forwards a chunk only if it is for
//! this job, from the current lease holder under the current lease, carries a
//! valid signature, and is the next in sequence. Duplicates are dropped, small
//! gaps are buffered briefly, large or persistent gaps fail the stream, and
//! nothing after the terminal chunk is forwarded. A chunk from a previous
//! lease holder is rejected even though its signature is valid — the same
//! guarantee the peer system gives by fencing tokens with assignment id and
//! index.

use std::collections::BTreeMap;

use gcs_protocol::{verify, Hash32, NodeId, StreamChunk, MAX_CONTINUATION_TOKENS};

/// Reorder-buffer bounds (26.16.11 recommends 8 chunks / 250 ms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FenceConfig {
    /// Largest gap buffered.
    pub max_reorder_gap: u64,
    /// Longest a gap may stay open.
    pub max_reorder_wait_ms: u64,
}

impl Default for FenceConfig {
    fn default() -> Self {
        Self { max_reorder_gap: 8, max_reorder_wait_ms: 250 }
    }
}

/// Why a chunk was not forwarded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rejected {
    /// For another job.
    WrongJob,
    /// No lease is held, or the sender is not the holder.
    NotLeaseHolder,
    /// The holder, but under an earlier lease.
    StaleLease,
    /// The signature does not verify.
    BadSignature,
    /// The stream already ended (terminal chunk or failure).
    AfterEnd,
}

/// Why the stream failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FenceFailure {
    /// A chunk arrived more than `max_reorder_gap` ahead.
    GapTooLarge {
        /// Expected sequence.
        expected: u64,
        /// Arrived sequence.
        got: u64,
    },
    /// A gap stayed open longer than `max_reorder_wait_ms`.
    PersistentGap {
        /// The missing sequence.
        missing: u64,
    },
}

/// What happened to one chunk.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Forward these chunks to the client, in this order (the arrived one,
    /// plus any buffered ones it unblocked).
    Deliver(Vec<StreamChunk>),
    /// Held until the gap before it fills.
    Buffered,
    /// Already forwarded or already buffered.
    Duplicate,
    /// Not forwarded, ever.
    Rejected(Rejected),
    /// The stream failed on this chunk.
    Failed(FenceFailure),
}

/// Where a started stream stands, for an exact continuation
/// (specs/lifecycle.md): what the client has received, as the fence
/// forwarded it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContinuationPoint {
    /// The next sequence number: the new holder's first chunk.
    pub from_sequence: u64,
    /// The ids of every output token forwarded, in order.
    pub delivered_tokens: Vec<u32>,
    /// blake3 of the text forwarded.
    pub delivered_text_hash: Hash32,
}

/// Fence state of one job's stream.
#[derive(Debug)]
pub struct StreamFence {
    job_id: String,
    config: FenceConfig,
    lease: Option<(String, NodeId)>,
    old_leases: Vec<String>,
    next_seq: u64,
    buffer: BTreeMap<u64, (StreamChunk, u64)>,
    ended: bool,
    failure: Option<FenceFailure>,
    delivered_tokens: u64,
    chunks_delivered: u64,
    /// Ids of the forwarded tokens; `None` once a forwarded chunk lacked
    /// them (that stream cannot be continued exactly).
    delivered_ids: Option<Vec<u32>>,
    /// Text forwarded so far.
    delivered_text: blake3::Hasher,
}

impl StreamFence {
    /// A fence for `job_id` with no lease yet.
    pub fn new(job_id: &str, config: FenceConfig) -> Self {
        Self {
            job_id: job_id.into(),
            config,
            lease: None,
            old_leases: vec![],
            next_seq: 0,
            buffer: BTreeMap::new(),
            ended: false,
            failure: None,
            delivered_tokens: 0,
            chunks_delivered: 0,
            delivered_ids: Some(Vec::new()),
            delivered_text: blake3::Hasher::new(),
        }
    }

    /// The point an exact continuation would start from: `None` before
    /// anything reached the client (a lost worker is then simply
    /// replaced), after the stream ended, or when a forwarded chunk did not
    /// carry its token ids.
    pub fn continuation_point(&self) -> Option<ContinuationPoint> {
        let ids = self.delivered_ids.as_ref()?;
        if !self.started() || self.ended || ids.is_empty() || ids.len() > MAX_CONTINUATION_TOKENS {
            return None;
        }
        Some(ContinuationPoint {
            from_sequence: self.next_seq,
            delivered_tokens: ids.clone(),
            delivered_text_hash: Hash32(*self.delivered_text.finalize().as_bytes()),
        })
    }

    /// A continuation lease was granted: like [`StreamFence::grant`], but
    /// the sequence numbers go on from where the stream stands and what
    /// was forwarded stays counted. Chunks the old holder sent past a gap
    /// (still in the reorder buffer, never forwarded) are dropped: the new
    /// holder produces them again, and the old lease's chunks are refused.
    pub fn continue_with(&mut self, lease_id: &str, holder: NodeId) {
        if let Some((old, _)) = self.lease.take() {
            self.old_leases.push(old);
        }
        self.lease = Some((lease_id.into(), holder));
        self.buffer.clear();
    }

    /// The lease is revoked (its holder was lost and the stream waits for
    /// a continuation): from now on its chunks are refused, before any
    /// other lease is granted, so nothing the lost holder sends late moves
    /// the continuation point the new holder resumes from. Its buffered
    /// (never forwarded) chunks are dropped.
    pub fn revoke(&mut self) {
        if let Some((old, _)) = self.lease.take() {
            self.old_leases.push(old);
        }
        self.buffer.clear();
    }

    /// A (new) lease was granted: chunks under any earlier lease are
    /// rejected from now on, and sequence numbers restart at 0.
    pub fn grant(&mut self, lease_id: &str, holder: NodeId) {
        if let Some((old, _)) = self.lease.take() {
            self.old_leases.push(old);
        }
        self.lease = Some((lease_id.into(), holder));
        self.next_seq = 0;
        self.buffer.clear();
    }

    /// Next sequence number expected.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Whether anything reached the client (after this, no silent worker switch).
    pub fn started(&self) -> bool {
        self.chunks_delivered > 0
    }

    /// Output tokens forwarded so far.
    pub fn delivered_tokens(&self) -> u64 {
        self.delivered_tokens
    }

    /// Whether the stream ended (terminal chunk forwarded, or failed).
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// The failure, if the stream failed.
    pub fn failure(&self) -> Option<FenceFailure> {
        self.failure
    }

    /// Ends the stream (terminal result or cancellation): later chunks are
    /// rejected.
    pub fn close(&mut self) {
        self.ended = true;
        self.buffer.clear();
    }

    fn fail(&mut self, f: FenceFailure) -> Verdict {
        self.failure = Some(f);
        self.close();
        Verdict::Failed(f)
    }

    /// Judges one chunk arriving at `now_ms`.
    pub fn on_chunk(&mut self, chunk: StreamChunk, now_ms: u64) -> Verdict {
        if chunk.job_id != self.job_id {
            return Verdict::Rejected(Rejected::WrongJob);
        }
        let Some((lease_id, holder)) = &self.lease else {
            return Verdict::Rejected(Rejected::NotLeaseHolder);
        };
        if &chunk.node_id != holder {
            return Verdict::Rejected(Rejected::NotLeaseHolder);
        }
        if &chunk.lease_id != lease_id {
            return Verdict::Rejected(Rejected::StaleLease);
        }
        if verify(&chunk).is_err() {
            return Verdict::Rejected(Rejected::BadSignature);
        }
        if self.ended {
            return Verdict::Rejected(Rejected::AfterEnd);
        }
        let seq = chunk.sequence;
        if seq < self.next_seq || self.buffer.contains_key(&seq) {
            return Verdict::Duplicate;
        }
        if seq > self.next_seq {
            if seq - self.next_seq > self.config.max_reorder_gap {
                return self.fail(FenceFailure::GapTooLarge { expected: self.next_seq, got: seq });
            }
            self.buffer.insert(seq, (chunk, now_ms));
            return Verdict::Buffered;
        }
        let mut out = vec![chunk];
        self.next_seq += 1;
        while let Some((c, _)) = self.buffer.remove(&self.next_seq) {
            out.push(c);
            self.next_seq += 1;
        }
        if let Some(end) = out.iter().position(|c| c.finish_reason.is_some()) {
            out.truncate(end + 1);
            self.close();
        }
        self.chunks_delivered += out.len() as u64;
        for c in &out {
            let n = c.usage_delta.output_tokens as usize;
            match &mut self.delivered_ids {
                Some(ids) if c.delta.token_ids.len() == n => ids.extend(&c.delta.token_ids),
                _ => self.delivered_ids = None,
            }
            if let Some(t) = &c.delta.content {
                self.delivered_text.update(t.as_bytes());
            }
        }
        let n =
            out.iter().fold(0u64, |a, c| a.saturating_add(u64::from(c.usage_delta.output_tokens)));
        self.delivered_tokens = self.delivered_tokens.saturating_add(n);
        Verdict::Deliver(out)
    }

    /// Time passes: a gap open longer than the wait bound fails the stream.
    pub fn on_tick(&mut self, now_ms: u64) -> Option<FenceFailure> {
        let oldest = self.buffer.values().map(|(_, t)| *t).min()?;
        if now_ms.saturating_sub(oldest) > self.config.max_reorder_wait_ms {
            let missing = self.next_seq;
            if let Verdict::Failed(f) = self.fail(FenceFailure::PersistentGap { missing }) {
                return Some(f);
            }
        }
        None
    }
}

#[cfg(test)]
#[path = "continuation_tests.rs"]
mod continuation_tests;
#[cfg(test)]
mod tests;
