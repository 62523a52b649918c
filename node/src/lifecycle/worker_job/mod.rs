//! The worker's side of one job as a sans-IO machine (quinn-proto style):
//! the async shell (`jobs::worker`) feeds it [`Input`]s with the time, and
//! performs the [`Effect`]s it returns; the machine never does I/O, reads
//! no clock and owns every rule of the worker's half of 26.12–26.16:
//!
//! claim → (lease) → fetch the payload → run the engine → stream signed
//! sequenced chunks, at most [`IN_FLIGHT`] unacknowledged → finish chunk →
//! signed final result, renewing the lease every `renew_interval_ms` until
//! the engine is done. A cancellation or a refused chunk stops the engine;
//! the result then says `cancelled` and still meters what was generated.
//!
//! [`Slots`] is the worker's admission: a slot per running job and a
//! bounded backlog of announced jobs, claimed when a slot frees.

mod continuation;
#[cfg(test)]
mod continuation_tests;
mod payload;
#[cfg(test)]
mod payload_tests;
mod policy;
#[cfg(test)]
mod priority_tests;
mod result;
#[cfg(test)]
mod share_tests;
mod slots;
#[cfg(test)]
mod tests;

pub use continuation::{Mismatch, REFUSED_CODE};
pub use policy::{continues, Policy};
pub use slots::{Offer, Share, Slots, BACKLOG};

use std::collections::VecDeque;

use gcs_protocol::{
    ids, sign, ApiRequestJob, CapabilityMatch, ClaimPolicy, ClaimRejectReason, Delta, Estimates,
    FinalResult, FinishReason, JobClaim, LeaseGrant, LeaseRenewal, Message, MessageType, ModelInfo,
    NodeKey, StreamChunk, TokenLogprob, UsageDelta, MAX_CHUNK_TOKENS, PROTOCOL_VERSION,
};
#[cfg(test)]
use gcs_protocol::{Hash32, ResultStatus};

use crate::jobs::executor::{ExecError, ExecOutcome};
pub use crate::jobs::wire::LeasedPayload;

/// Unacknowledged chunks allowed in flight (≤ the gateway's reorder gap of
/// 8): the window is the stream's backpressure, and a round trip per token
/// does not cap throughput on slow links.
pub const IN_FLIGHT: usize = 8;

/// How long a claim is valid.
pub const CLAIM_TTL_MS: u64 = 10_000;

/// A claim not answered within the job's claim timeout plus this slack is
/// given up (the gateway answers at once when it hears it; a gateway that
/// does not answer must not hold the slot for the 30 s request timeout).
pub const CLAIM_ANSWER_SLACK_MS: u64 = 4_000;
/// The longest a claim waits for its answer, whatever the job says.
pub const MAX_CLAIM_WAIT_MS: u64 = 10_000;

/// Error messages carried in a result are cut to this many characters.
const MAX_ERROR_CHARS: usize = 4000;

/// A request the worker sends to the job's gateway; its answer comes back
/// as [`Input::Answer`] naming it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// The claim.
    Claim,
    /// The payload fetch.
    Payload,
    /// The chunk with this sequence number.
    Chunk(u64),
    /// A lease renewal.
    Renewal,
    /// The final result.
    Result,
}

/// The gateway's answer to a [`Request`], as the shell received it.
#[derive(Debug)]
pub enum Answer {
    /// Taken.
    Ack,
    /// An opened, signature-checked envelope (lease grant, claim rejection).
    Envelope(Box<Message>),
    /// The payload, with what only the lease holder learns.
    Payload(Box<LeasedPayload>),
    /// Refused by the gateway, with its reason.
    Refused(String),
    /// No answer: the request failed or timed out (transport error).
    Failed(String),
}

/// What happens to the machine.
#[derive(Debug)]
pub enum Input {
    /// The answer to a request.
    Answer(Request, Answer),
    /// The engine produced a text delta of `tokens` tokens.
    Delta {
        /// Text.
        text: String,
        /// Tokens in it.
        tokens: u32,
        /// Their ids, when the engine reports them (one per token; the
        /// chunk carries them only then, for exact continuation).
        token_ids: Vec<u32>,
        /// Per-token logprobs, when asked for.
        logprobs: Vec<TokenLogprob>,
    },
    /// The engine returned.
    EngineDone(Result<ExecOutcome, ExecError>),
    /// A signed cancellation arrived from its signer `issued_by` (the
    /// shell checked the signature and that the sender signed it). Only the
    /// job's gateway may cancel, and only this run's lease.
    Cancel {
        /// Who signed it.
        issued_by: gcs_protocol::NodeId,
        /// The lease it revokes, if it names one.
        lease_id: Option<String>,
    },
    /// Time passed.
    Tick,
}

/// Something the shell must do.
#[derive(Debug)]
pub enum Effect {
    /// Send the claim to the job's gateway.
    SendClaim(Box<JobClaim>),
    /// Fetch the payload under this lease.
    FetchPayload {
        /// Job.
        job_id: String,
        /// Lease.
        lease_id: String,
    },
    /// Run the engine on the (verified) payload, keying its prefix cache
    /// on the payload's salt; with `continuation` set (checked against the
    /// signed job), resume after the delivered tokens instead.
    StartEngine(Box<LeasedPayload>),
    /// Stop the engine within one decode step.
    StopEngine,
    /// Send (and keep: job-participant scope) a signed chunk.
    SendChunk(Box<StreamChunk>),
    /// Send a lease renewal.
    SendRenewal(LeaseRenewal),
    /// Send (and keep) the signed final result.
    SendResult(Box<FinalResult>),
    /// The job is over here; the slot is free.
    Done(Termination),
}

/// Why a job ended on this worker.
#[derive(Clone, Debug, PartialEq)]
pub enum Termination {
    /// Streamed to the end and the result delivered.
    Completed,
    /// Another claim won (or the job was no longer open).
    ClaimLost(ClaimRejectReason),
    /// Stopped early: the gateway cancelled or refused a chunk. The result
    /// says `cancelled` and meters what was generated.
    Cancelled,
    /// The engine did not run the request to its end; the result says so.
    EngineFailed(ExecError),
    /// The gateway did not answer a claim or payload request usefully.
    Gateway(String),
    /// A signed message could not be built.
    Internal(String),
}

impl Termination {
    /// A short stable label for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Termination::Completed => "completed",
            Termination::ClaimLost(_) => "claim_lost",
            Termination::Cancelled => "cancelled",
            Termination::EngineFailed(_) => "engine_failed",
            Termination::Gateway(_) => "gateway",
            Termination::Internal(_) => "internal",
        }
    }
}

#[derive(Debug, PartialEq)]
enum Phase {
    Claiming,
    Fetching,
    /// The engine runs; chunks flow.
    Running,
    /// The engine returned; waiting for in-flight chunks (then the finish
    /// chunk) to be answered before the result.
    Draining,
    /// The result is sent; waiting for its answer.
    Reporting,
    Done,
}

/// One job on this worker.
#[derive(Debug)]
pub struct WorkerJob {
    job: ApiRequestJob,
    claim: JobClaim,
    phase: Phase,
    lease: Option<LeaseGrant>,
    /// Next chunk sequence number.
    seq: u64,
    /// Chunks sent and not yet answered.
    in_flight: usize,
    /// Signed chunks waiting for the window.
    queued: VecDeque<StreamChunk>,
    /// The finish chunk's sequence number, once sent.
    finish_seq: Option<u64>,
    stopped: bool,
    outcome: Option<Result<ExecOutcome, ExecError>>,
    /// Why the job will end (set once the result is sent).
    termination: Option<Termination>,
    started_ms: u64,
    first_token_ms: Option<u64>,
    engine_done_ms: u64,
    next_renewal_ms: Option<u64>,
    /// When an unanswered claim is given up.
    claim_deadline_ms: u64,
    /// The stream this run continues, once its payload answer is accepted.
    continuation: Option<gcs_protocol::Continuation>,
}

impl WorkerJob {
    /// Starts on `job` for `model`: the first effect is the signed claim.
    pub fn new(
        job: ApiRequestJob,
        model: &ModelInfo,
        key: &NodeKey,
        registration_id: String,
        now_ms: u64,
    ) -> Result<(Self, Vec<Effect>), gcs_protocol::ProtocolError> {
        let claim = signed_claim(&job.job_id, model, key, registration_id, now_ms)?;
        let effects = vec![Effect::SendClaim(Box::new(claim.clone()))];
        let wait = job.limits.claim_timeout_ms.saturating_add(CLAIM_ANSWER_SLACK_MS);
        let me = Self {
            claim_deadline_ms: now_ms.saturating_add(wait.min(MAX_CLAIM_WAIT_MS)),
            claim,
            job,
            phase: Phase::Claiming,
            lease: None,
            seq: 0,
            in_flight: 0,
            queued: VecDeque::new(),
            finish_seq: None,
            stopped: false,
            outcome: None,
            termination: None,
            started_ms: now_ms,
            first_token_ms: None,
            engine_done_ms: 0,
            next_renewal_ms: None,
            continuation: None,
        };
        Ok((me, effects))
    }

    /// The job.
    pub fn job(&self) -> &ApiRequestJob {
        &self.job
    }

    /// The node that may cancel this job: its gateway.
    pub fn gateway(&self) -> &gcs_protocol::NodeId {
        &self.job.gateway_node_id
    }

    /// The lease this worker holds, once granted.
    pub fn lease_id(&self) -> Option<&str> {
        self.lease.as_ref().map(|l| l.lease_id.as_str())
    }

    /// Whether the shell should take the engine's next delta now: while the
    /// window has room (the shell leaves deltas in the engine's bounded
    /// channel otherwise, which is what slows the engine down), and always
    /// once stopped, so a blocked engine can reach its cancel check.
    pub fn wants_delta(&self) -> bool {
        self.phase == Phase::Running
            && (self.stopped || self.in_flight + self.queued.len() < IN_FLIGHT)
    }

    /// When the machine next needs a [`Input::Tick`].
    pub fn poll_timeout(&self) -> Option<u64> {
        match self.phase {
            Phase::Claiming => Some(self.claim_deadline_ms),
            _ => self.next_renewal_ms,
        }
    }

    /// Whether the job is over.
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// Feeds one input at `now_ms`; signs with `key`.
    pub fn handle(&mut self, input: Input, now_ms: u64, key: &NodeKey) -> Vec<Effect> {
        if self.phase == Phase::Done {
            return vec![];
        }
        let r = match input {
            Input::Answer(req, a) => self.on_answer(req, a, now_ms, key),
            Input::Delta { text, tokens, token_ids, logprobs } => {
                self.on_delta(text, tokens, token_ids, logprobs, now_ms, key)
            }
            Input::EngineDone(o) => self.on_engine_done(o, now_ms, key),
            Input::Cancel { issued_by, lease_id } => Ok(self.on_cancel(&issued_by, lease_id)),
            Input::Tick => self.on_tick(now_ms, key),
        };
        r.unwrap_or_else(|e| self.end(Termination::Internal(e.to_string())))
    }

    fn on_answer(
        &mut self,
        req: Request,
        a: Answer,
        now: u64,
        key: &NodeKey,
    ) -> Result<Vec<Effect>, gcs_protocol::ProtocolError> {
        match (req, &self.phase) {
            (Request::Claim, Phase::Claiming) => Ok(self.on_claim_answer(a, now)),
            (Request::Payload, Phase::Fetching) => self.on_payload(a, now, key),
            (Request::Chunk(s), _) if Some(s) == self.finish_seq => {
                // The finish chunk was answered: now the result.
                self.in_flight = self.in_flight.saturating_sub(1);
                self.report(now, key)
            }
            (Request::Chunk(_), _) => {
                self.in_flight = self.in_flight.saturating_sub(1);
                let mut fx = vec![];
                if !matches!(a, Answer::Ack) {
                    // The gateway no longer takes this stream (ended, fenced
                    // out, or unreachable): stop generating for nobody.
                    fx.extend(self.stop());
                }
                if let Some(c) = (!self.stopped).then(|| self.queued.pop_front()).flatten() {
                    self.in_flight += 1;
                    fx.push(Effect::SendChunk(Box::new(c)));
                }
                fx.extend(self.drain(now, key)?);
                Ok(fx)
            }
            (Request::Result, Phase::Reporting) => {
                let t = self.termination.take().unwrap_or(Termination::Completed);
                Ok(self.end(t))
            }
            // Renewal answers carry nothing the worker acts on; stale
            // answers of an earlier phase are ignored.
            _ => Ok(vec![]),
        }
    }

    fn on_claim_answer(&mut self, a: Answer, now: u64) -> Vec<Effect> {
        match a {
            Answer::Envelope(m) => match *m {
                Message::LeaseGrant(l)
                    if l.node_id == self.claim.node_id
                        && l.claim_id == self.claim.claim_id
                        && l.job_id == self.job.job_id
                        && l.gateway_node_id == self.job.gateway_node_id =>
                {
                    let fetch = Effect::FetchPayload {
                        job_id: self.job.job_id.clone(),
                        lease_id: l.lease_id.clone(),
                    };
                    self.next_renewal_ms = Some(now + renew_every(&l));
                    self.lease = Some(l);
                    self.phase = Phase::Fetching;
                    vec![fetch]
                }
                Message::ClaimRejection(r) if r.claim_id == self.claim.claim_id => {
                    self.end(Termination::ClaimLost(r.reason))
                }
                other => self.end(Termination::Gateway(format!(
                    "claim answered with {}",
                    other.message_type()
                ))),
            },
            other => self.end(Termination::Gateway(format!("claim answered with {other:?}"))),
        }
    }

    fn on_delta(
        &mut self,
        text: String,
        tokens: u32,
        token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
        now: u64,
        key: &NodeKey,
    ) -> Result<Vec<Effect>, gcs_protocol::ProtocolError> {
        // After a stop the engine may still flush a delta: nobody takes it.
        if self.phase != Phase::Running || self.stopped {
            return Ok(vec![]);
        }
        if self.first_token_ms.is_none() {
            self.first_token_ms = Some(now.saturating_sub(self.started_ms));
        }
        let c = self.chunk(Some(text), tokens, token_ids, logprobs, None, now, key)?;
        if self.in_flight < IN_FLIGHT {
            self.in_flight += 1;
            Ok(vec![Effect::SendChunk(Box::new(c))])
        } else {
            self.queued.push_back(c);
            Ok(vec![])
        }
    }

    fn on_engine_done(
        &mut self,
        o: Result<ExecOutcome, ExecError>,
        now: u64,
        key: &NodeKey,
    ) -> Result<Vec<Effect>, gcs_protocol::ProtocolError> {
        if self.phase != Phase::Running {
            return Ok(vec![]);
        }
        self.outcome = Some(o);
        self.engine_done_ms = now;
        self.phase = Phase::Draining;
        self.drain(now, key)
    }

    fn on_tick(
        &mut self,
        now: u64,
        key: &NodeKey,
    ) -> Result<Vec<Effect>, gcs_protocol::ProtocolError> {
        if self.phase == Phase::Claiming {
            return Ok(if now >= self.claim_deadline_ms {
                self.end(Termination::Gateway("the claim was not answered in time".into()))
            } else {
                vec![]
            });
        }
        let (Some(due), Some(lease)) = (self.next_renewal_ms, &self.lease) else {
            return Ok(vec![]);
        };
        if now < due {
            return Ok(vec![]);
        }
        let term = lease.expires_at_ms.saturating_sub(lease.created_at_ms);
        let mut r = LeaseRenewal {
            message_type: MessageType::LeaseRenewal,
            version: PROTOCOL_VERSION,
            job_id: lease.job_id.clone(),
            lease_id: lease.lease_id.clone(),
            node_id: key.node_id(),
            chunks_sent: 0,
            created_at_ms: now,
            expires_at_ms: now + term,
            signature: None,
        };
        self.next_renewal_ms = Some(now + renew_every(lease));
        sign(&mut r, key)?;
        Ok(vec![Effect::SendRenewal(r)])
    }

    /// A cancellation by anyone but the job's gateway, or naming another
    /// lease than this run's, changes nothing (before the grant arrives any
    /// lease of that gateway is this run's).
    fn on_cancel(
        &mut self,
        issued_by: &gcs_protocol::NodeId,
        lease_id: Option<String>,
    ) -> Vec<Effect> {
        let other_lease = matches!((&lease_id, self.lease_id()), (Some(a), Some(b)) if a != b);
        if issued_by != &self.job.gateway_node_id || other_lease {
            return vec![];
        }
        self.stop()
    }

    /// Stops the engine (once). Before the engine started there is
    /// nothing to meter or report: the job just ends here.
    fn stop(&mut self) -> Vec<Effect> {
        match self.phase {
            Phase::Claiming | Phase::Fetching => self.end(Termination::Cancelled),
            Phase::Running if !self.stopped => {
                self.stopped = true;
                self.queued.clear();
                vec![Effect::StopEngine]
            }
            _ => vec![],
        }
    }

    /// After the engine returned: once every chunk is answered, the finish
    /// chunk (completed runs only), then the result.
    fn drain(
        &mut self,
        now: u64,
        key: &NodeKey,
    ) -> Result<Vec<Effect>, gcs_protocol::ProtocolError> {
        if self.phase != Phase::Draining || self.in_flight > 0 || self.finish_seq.is_some() {
            return Ok(vec![]);
        }
        if let Some(c) = self.queued.pop_front() {
            self.in_flight += 1;
            return Ok(vec![Effect::SendChunk(Box::new(c))]);
        }
        match &self.outcome {
            Some(Ok(o)) if !self.stopped => {
                let finish = o.finish_reason;
                let c = self.chunk(None, 0, vec![], vec![], Some(finish), now, key)?;
                self.finish_seq = Some(c.sequence);
                self.in_flight += 1;
                Ok(vec![Effect::SendChunk(Box::new(c))])
            }
            _ => self.report(now, key),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn chunk(
        &mut self,
        text: Option<String>,
        tokens: u32,
        mut token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
        finish: Option<FinishReason>,
        now: u64,
        key: &NodeKey,
    ) -> Result<StreamChunk, gcs_protocol::ProtocolError> {
        let seq = self.seq;
        // Ids only when they account for every counted token (and fit the
        // bound): a partial list would be refused by the gateway.
        if token_ids.len() != tokens as usize || token_ids.len() > MAX_CHUNK_TOKENS {
            token_ids.clear();
        }
        let mut c = StreamChunk {
            message_type: MessageType::StreamChunk,
            version: PROTOCOL_VERSION,
            job_id: self.job.job_id.clone(),
            node_id: key.node_id(),
            lease_id: self.lease.as_ref().map(|l| l.lease_id.clone()).unwrap_or_default(),
            sequence: seq,
            delta: Delta {
                // A continuation's client has the role already.
                role: (seq == 0 && self.continuation.is_none()).then(|| "assistant".to_string()),
                content: text,
                logprobs,
                token_ids,
            },
            usage_delta: UsageDelta { output_tokens: tokens },
            finish_reason: finish,
            created_at_ms: now,
            signature: None,
        };
        sign(&mut c, key)?;
        self.seq += 1;
        Ok(c)
    }

    fn end(&mut self, t: Termination) -> Vec<Effect> {
        self.phase = Phase::Done;
        self.next_renewal_ms = None;
        self.queued.clear();
        vec![Effect::Done(t)]
    }
}

/// The gateway's renewal period, but never more than a third of the term
/// it granted: a grant whose period outlasts its term (a misconfigured or
/// hostile gateway) would otherwise lose every lease it grants.
fn renew_every(lease: &LeaseGrant) -> u64 {
    let term = lease.expires_at_ms.saturating_sub(lease.created_at_ms);
    lease.renew_interval_ms.min(term / 3).max(100)
}

/// A signed first-valid claim of `job_id` for `model`, valid for
/// [`CLAIM_TTL_MS`].
pub fn signed_claim(
    job_id: &str,
    model: &ModelInfo,
    key: &NodeKey,
    registration_id: String,
    now: u64,
) -> Result<JobClaim, gcs_protocol::ProtocolError> {
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
        expires_at_ms: now + CLAIM_TTL_MS,
        signature: None,
    };
    sign(&mut claim, key)?;
    Ok(claim)
}
