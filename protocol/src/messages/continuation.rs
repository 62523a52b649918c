//! Exact continuation (extension of 26.16.9): what a worker needs, beside
//! the job's payload, to continue a stream whose lease holder was lost
//! after the first token, so that the client sees the tokens the lost
//! worker would have produced.
//!
//! The sampler, stop-string and grammar states are not carried: each is a
//! function of the payload, the seed and the delivered tokens, and the new
//! holder's engine rebuilds them by replay (`gcs_engine::BatchEngine::resume`).
//! Carrying only what the gateway itself saw (fenced, signed chunks) means
//! a lost — possibly lying — worker's own account of its state is never
//! trusted. Not a signed message: it travels inside the gateway's signed
//! answer to the new holder, and it is versioned on its own.

use serde::{Deserialize, Serialize};

use crate::codec::{from_cbor_bytes, to_canonical_bytes};
use crate::crypto::Hash32;
use crate::error::ProtocolError;
use crate::ids;
use crate::validate::{self as v, MAX_SHORT};

/// The version of [`Continuation`] this build writes and reads.
pub const CONTINUATION_VERSION: u16 = 1;
/// Most delivered tokens a continuation carries (the gateway's
/// `max_tokens` bound is far below).
pub const MAX_CONTINUATION_TOKENS: usize = 16_384;
/// Most continuations of one job (each is a lost worker).
pub const MAX_CONTINUATIONS: u32 = 4;

/// The state a continuation starts from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Continuation {
    /// [`CONTINUATION_VERSION`].
    pub version: u16,
    /// The job.
    pub job_id: String,
    /// 1 for the job's first continuation, at most [`MAX_CONTINUATIONS`].
    pub continuation: u32,
    /// The sequence number of the new holder's first chunk: the fence's
    /// next expected one, so sequence numbers continue across the seam.
    pub from_sequence: u64,
    /// Output tokens the client has received, in order (the `token_ids`
    /// of the fenced chunks forwarded so far).
    pub delivered_tokens: Vec<u32>,
    /// blake3 of the text forwarded so far: the new holder's replay must
    /// release exactly this text, or it refuses (another engine or model).
    pub delivered_text_hash: Hash32,
    /// The seed the sequence samples with (the payload's own, or the one
    /// the gateway assigned at admission).
    pub seed: u64,
    /// Engine build of the lost holder (its registration's
    /// `models[].engine_build`); only a worker of the same build may continue.
    pub engine_build: String,
    /// blake3 (hex) of the model file the lost holder served.
    pub model_hash: String,
}

impl Continuation {
    /// Canonical CBOR bytes.
    pub fn encode(&self) -> Result<Vec<u8>, ProtocolError> {
        self.check()?;
        to_canonical_bytes(self)
    }

    /// Decodes and checks bytes from the network.
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtocolError> {
        let c: Self = from_cbor_bytes(bytes)?;
        c.check()?;
        Ok(c)
    }

    /// Field bounds.
    pub fn check(&self) -> Result<(), ProtocolError> {
        if self.version != CONTINUATION_VERSION {
            return Err(ProtocolError::UnsupportedVersion {
                message_type: "continuation".into(),
                version: u64::from(self.version),
                min: CONTINUATION_VERSION,
                max: CONTINUATION_VERSION,
            });
        }
        ids::check_id("job_id", &self.job_id, ids::JOB)?;
        v::range("continuation", self.continuation, 1, MAX_CONTINUATIONS)?;
        if self.delivered_tokens.is_empty() {
            // Before the first token a lost worker is simply replaced.
            return Err(ProtocolError::field("delivered_tokens", "must not be empty"));
        }
        v::list("delivered_tokens", &self.delivered_tokens, MAX_CONTINUATION_TOKENS)?;
        v::short("engine_build", &self.engine_build, MAX_SHORT)?;
        v::short("model_hash", &self.model_hash, MAX_SHORT)?;
        Ok(())
    }
}

/// What a continuation's announcement says of it, in the re-announced
/// job's `requirements.continuation` (signed with the job): which
/// continuation this is and what engine build and model file a claimant
/// must serve. The delivered tokens are not in it: they go only to the new
/// lease holder, inside its payload answer (a [`Continuation`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContinuationOffer {
    /// 1 for the job's first continuation, at most [`MAX_CONTINUATIONS`].
    pub continuation: u32,
    /// The engine build a claimant must advertise for the job's model
    /// (its registration's `models[].engine_build`).
    pub engine_build: String,
    /// The model file's blake3 (hex) a claimant must advertise
    /// (`models[].model_hash`).
    pub model_hash: String,
}

impl ContinuationOffer {
    /// The offer for `c`.
    pub fn of(c: &Continuation) -> Self {
        Self {
            continuation: c.continuation,
            engine_build: c.engine_build.clone(),
            model_hash: c.model_hash.clone(),
        }
    }

    /// Field bounds.
    pub fn check(&self) -> Result<(), ProtocolError> {
        v::range("continuation", self.continuation, 1, MAX_CONTINUATIONS)?;
        v::short("engine_build", &self.engine_build, MAX_SHORT)?;
        v::short("model_hash", &self.model_hash, MAX_SHORT)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Continuation {
        Continuation {
            version: CONTINUATION_VERSION,
            job_id: "gcsapi_01HZX3K9Q2W8E7R6T5Y4V3M2N1".into(),
            continuation: 1,
            from_sequence: 7,
            delivered_tokens: vec![1, 28, 4096, 49151],
            delivered_text_hash: Hash32::of(b"The sky"),
            seed: 42,
            engine_build: "gcs-engine 0.1.0".into(),
            model_hash: "ab".repeat(32),
        }
    }

    #[test]
    fn round_trips_and_refuses_out_of_bounds_states() {
        let c = sample();
        assert_eq!(Continuation::decode(&c.encode().unwrap()).unwrap(), c);
        let bad = |f: fn(&mut Continuation)| {
            let mut c = sample();
            f(&mut c);
            assert!(c.encode().is_err(), "{c:?}");
        };
        bad(|c| c.version = 2);
        bad(|c| c.continuation = 0);
        bad(|c| c.continuation = MAX_CONTINUATIONS + 1);
        bad(|c| c.delivered_tokens.clear());
        bad(|c| c.delivered_tokens = vec![0; MAX_CONTINUATION_TOKENS + 1]);
        bad(|c| c.engine_build.clear());
        bad(|c| c.job_id = "nope".into());
        assert!(Continuation::decode(b"\xff").is_err());
    }
}
