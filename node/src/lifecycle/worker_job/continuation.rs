//! The new holder's side of an exact continuation (extension of 26.16.9,
//! specs/lifecycle.md "Exact continuation"): which payload answers it
//! accepts as a continuation.
//!
//! A continuation is trusted only as far as the job the gateway signed:
//! the payload's [`Continuation`] must be the one the re-announced job
//! offers (`requirements.continuation`: number, engine build, model file)
//! for this very job, and its seed must be the payload's own when the
//! payload fixes one — otherwise the new holder would sample another
//! stream than the one the client has been reading. A plain job's payload
//! must carry none: running a continuation's replay on a job announced as
//! fresh (or the reverse) would duplicate or drop text at the seam.

use gcs_gateway::payload::JobRequest;
use gcs_protocol::{ApiRequestJob, Continuation};

use super::LeasedPayload;

/// The code of a failed result whose continuation this worker's engine
/// refused to replay (the delivered text is not what it releases): the
/// worker's, not the client's, so the gateway treats it as a lost worker
/// rather than answering the client with `invalid_request`.
pub const REFUSED_CODE: &str = "gnus_continuation_refused";

/// Why a payload answer is not run as (or without) a continuation.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Mismatch {
    /// The job is re-announced as a continuation; the answer has none.
    #[error("the job is announced as a continuation but the payload has none")]
    Missing,
    /// The answer continues a job announced as fresh.
    #[error("the payload carries a continuation the job does not announce")]
    Unannounced,
    /// It is another job's.
    #[error("the continuation is of another job")]
    OtherJob,
    /// It is another continuation than the one announced.
    #[error("continuation {got} answered for continuation {announced} announced")]
    Number {
        /// In the payload answer.
        got: u32,
        /// In the signed job.
        announced: u32,
    },
    /// It names another build or file than the signed job.
    #[error("the continuation names another engine build or model file than the job announces")]
    Build,
    /// The payload is not a generation this worker can read.
    #[error("the continued payload is not a generation: {0}")]
    Payload(String),
    /// Its seed is not the one the payload fixes.
    #[error("the continuation's seed is not the payload's")]
    Seed,
    /// Nothing would be left to generate.
    #[error("the continuation delivered max_tokens already")]
    Exhausted,
}

/// The continuation `p` asks this worker to run, if any, once it is
/// consistent with the signed `job`.
pub(super) fn accept(
    job: &ApiRequestJob,
    p: &LeasedPayload,
) -> Result<Option<Continuation>, Mismatch> {
    let c = match (&p.continuation, &job.requirements.continuation) {
        (None, None) => return Ok(None),
        (None, Some(_)) => return Err(Mismatch::Missing),
        (Some(_), None) => return Err(Mismatch::Unannounced),
        (Some(c), Some(o)) => {
            if c.job_id != job.job_id {
                return Err(Mismatch::OtherJob);
            }
            if c.continuation != o.continuation {
                return Err(Mismatch::Number { got: c.continuation, announced: o.continuation });
            }
            if c.engine_build != o.engine_build || c.model_hash != o.model_hash {
                return Err(Mismatch::Build);
            }
            c
        }
    };
    let g = match JobRequest::decode(&p.body) {
        Ok(JobRequest::Generation(g)) => g,
        Ok(JobRequest::Embedding(_)) => return Err(Mismatch::Payload("an embedding".into())),
        Err(e) => return Err(Mismatch::Payload(e.to_string())),
    };
    if g.sampling.seed.is_some_and(|s| s != c.seed) {
        return Err(Mismatch::Seed);
    }
    if c.delivered_tokens.len() as u64 >= u64::from(g.max_tokens) {
        // No run of the request continues past max_tokens (the engine
        // refuses it too; the gateway finishes such a stream itself).
        return Err(Mismatch::Exhausted);
    }
    Ok(Some(c.clone()))
}
