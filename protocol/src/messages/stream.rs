//! Stream chunks, cancellations and requeues (26.16, 26.19).

use ciborium::value::Value;
use serde::{Deserialize, Serialize};

use super::enums::{CancellationReason, FinishReason, RequeueReason};
use crate::codec::{canonicalize, encode_value, map_get, to_canonical_bytes};
use crate::crypto::{Hash32, NodeId, Signature};
use crate::signed::{impl_signed_common, Limits, MessageType, SignedMessage};
use crate::error::ProtocolError;
use crate::ids;
use crate::validate::{self as v, MAX_DELTA, MAX_SHORT};

/// The text delta of one chunk.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    /// `assistant` on the first chunk, else none.
    pub role: Option<String>,
    /// Text.
    pub content: Option<String>,
    /// Log-probabilities of the tokens behind this text, when the request
    /// asked for them (OpenAI `logprobs.content`). Absent otherwise, so
    /// chunks without them encode as before.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<TokenLogprob>,
    /// The ids of the tokens behind this text (exact continuation: the
    /// gateway knows the delivered tokens and can hand them to another
    /// worker). One per counted output token when present; absent from
    /// workers that do not report them, so such chunks encode as before.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub token_ids: Vec<u32>,
}

/// Most tokens one chunk carries log-probabilities for.
pub const MAX_CHUNK_LOGPROBS: usize = 64;
/// Most token ids one chunk carries (a chunk's text is at most
/// `MAX_DELTA` bytes; held-back tokens can add a few more).
pub const MAX_CHUNK_TOKENS: usize = 4096;
/// Most alternatives per token (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One generated token's log-probability and, if asked, the most likely
/// alternatives at its position.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    /// The token as text (lossy for a partial UTF-8 character).
    pub token: String,
    /// Natural log-probability.
    pub logprob: f32,
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// Alternatives, most likely first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top: Vec<TopLogprob>,
}

/// An alternative token at one position.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    /// The token as text.
    pub token: String,
    /// Natural log-probability.
    pub logprob: f32,
    /// The token's bytes.
    pub bytes: Vec<u8>,
}

/// Usage carried by one chunk.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageDelta {
    /// Tokens this chunk carries.
    pub output_tokens: u32,
}

/// `GCS_API_STREAM_CHUNK` (26.16.5). Its signature covers job id, node id,
/// lease id, sequence, the delta hash and the timestamp (26.16.11).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StreamChunk {
    /// Always `GCS_API_STREAM_CHUNK`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// Job.
    pub job_id: String,
    /// Worker; signer.
    pub node_id: NodeId,
    /// The lease the worker holds (fencing token, extension).
    pub lease_id: String,
    /// 0, 1, 2, ... per lease.
    pub sequence: u64,
    /// Text delta.
    pub delta: Delta,
    /// Usage delta.
    pub usage_delta: UsageDelta,
    /// Set on the last chunk of a choice.
    pub finish_reason: Option<FinishReason>,
    /// Creation time.
    pub created_at_ms: u64,
    /// Signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

#[derive(Serialize)]
struct DeltaContent<'a> {
    delta: &'a Delta,
    usage_delta: &'a UsageDelta,
    finish_reason: &'a Option<FinishReason>,
}

/// Fields of a chunk the signature covers directly; the rest is covered
/// through `delta_hash`.
const CHUNK_SIGNED_FIELDS: [&str; 6] =
    ["job_id", "node_id", "lease_id", "sequence", "created_at_ms", "version"];
/// Not folded into the delta hash: the directly signed fields, and the type
/// (checked on decode). Everything else is — `delta`, `usage_delta`,
/// `finish_reason` and any field a later version adds — so that no field can
/// be renamed, dropped or added without breaking the signature (a missing
/// `finish_reason` is not the same as a null one).
const CHUNK_UNHASHED_FIELDS: [&str; 8] = [
    "job_id",
    "node_id",
    "lease_id",
    "sequence",
    "created_at_ms",
    "version",
    "message_type",
    "signature",
];

fn rest(v: &Value, exclude: &[&str]) -> Value {
    let Value::Map(m) = v else { return Value::Null };
    let mut out = Value::Map(
        m.iter()
            .filter(|(k, _)| !matches!(k, Value::Text(t) if exclude.contains(&t.as_str())))
            .cloned()
            .collect(),
    );
    canonicalize(&mut out);
    out
}

fn pick(v: &Value, fields: &[&str]) -> Value {
    let mut m = Value::Map(
        fields
            .iter()
            .map(|f| (Value::Text((*f).into()), map_get(v, f).cloned().unwrap_or(Value::Null)))
            .collect(),
    );
    canonicalize(&mut m);
    m
}

impl StreamChunk {
    /// blake3 of the canonical delta, usage delta and finish reason.
    pub fn delta_hash(&self) -> Result<Hash32, ProtocolError> {
        let content = DeltaContent {
            delta: &self.delta,
            usage_delta: &self.usage_delta,
            finish_reason: &self.finish_reason,
        };
        Ok(Hash32::of(&to_canonical_bytes(&content)?))
    }
}

impl SignedMessage for StreamChunk {
    const TYPE: MessageType = MessageType::StreamChunk;
    impl_signed_common!();
    fn signer(&self) -> &NodeId {
        &self.node_id
    }
    fn created_at_ms(&self) -> u64 {
        self.created_at_ms
    }
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        v::header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("job_id", &self.job_id, ids::JOB)?;
        ids::check_id("lease_id", &self.lease_id, ids::LEASE)?;
        if let Some(r) = &self.delta.role {
            v::short("delta.role", r, 32)?;
        }
        if let Some(c) = &self.delta.content {
            v::text("delta.content", c, MAX_DELTA)?;
        }
        v::list("delta.logprobs", &self.delta.logprobs, MAX_CHUNK_LOGPROBS)?;
        v::list("delta.token_ids", &self.delta.token_ids, MAX_CHUNK_TOKENS)?;
        let n = self.delta.token_ids.len();
        if n != 0 && n != self.usage_delta.output_tokens as usize {
            return Err(ProtocolError::field(
                "delta.token_ids",
                "must list exactly usage_delta.output_tokens ids",
            ));
        }
        for t in &self.delta.logprobs {
            v::text("delta.logprobs.token", &t.token, 256)?;
            v::list("delta.logprobs.bytes", &t.bytes, 256)?;
            v::list("delta.logprobs.top", &t.top, MAX_TOP_LOGPROBS)?;
            // NaN and positive values.
            let bad = |x: f32| x.is_nan() || x > 0.0;
            if bad(t.logprob) || t.top.iter().any(|a| bad(a.logprob)) {
                return Err(ProtocolError::field("delta.logprobs.logprob", "must be <= 0"));
            }
            for a in &t.top {
                v::text("delta.logprobs.top.token", &a.token, 256)?;
                v::list("delta.logprobs.top.bytes", &a.bytes, 256)?;
            }
        }
        Ok(())
    }
    /// The compact payload of 26.16.11 rather than the whole map: job id,
    /// node id, lease id, sequence, timestamp, version and the delta hash, so
    /// a verifier that kept only the hash can still check the signature.
    /// Computed from the received value tree (not the typed struct) so that
    /// every encoded byte counts, exactly as for the other messages.
    fn signing_payload(&self, without_signature: &Value) -> Result<Vec<u8>, ProtocolError> {
        let delta_hash =
            Hash32::of(&encode_value(&rest(without_signature, &CHUNK_UNHASHED_FIELDS)));
        let mut signed = pick(without_signature, &CHUNK_SIGNED_FIELDS);
        if let Value::Map(m) = &mut signed {
            m.push((Value::Text("delta_hash".into()), Value::Bytes(delta_hash.0.to_vec())));
        }
        canonicalize(&mut signed);
        Ok(encode_value(&signed))
    }
}

/// Partial usage at cancellation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartialUsage {
    /// Tokens delivered to the client before the cancellation.
    pub output_tokens_sent: u64,
}

/// `GCS_API_CANCELLATION` (26.16.8).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cancellation {
    /// Always `GCS_API_CANCELLATION`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// Job.
    pub job_id: String,
    /// The gateway cancelling; signer (extension).
    pub issued_by: NodeId,
    /// The lease being revoked, if any (extension).
    pub lease_id: Option<String>,
    /// Why.
    pub reason: CancellationReason,
    /// Last sequence forwarded to the client.
    pub last_sequence_sent: Option<u64>,
    /// Usage so far.
    pub partial_usage: PartialUsage,
    /// Creation time.
    pub created_at_ms: u64,
    /// Signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl SignedMessage for Cancellation {
    const TYPE: MessageType = MessageType::Cancellation;
    impl_signed_common!();
    fn signer(&self) -> &NodeId {
        &self.issued_by
    }
    fn created_at_ms(&self) -> u64 {
        self.created_at_ms
    }
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        v::header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("job_id", &self.job_id, ids::JOB)?;
        if let Some(l) = &self.lease_id {
            ids::check_id("lease_id", l, ids::LEASE)?;
        }
        Ok(())
    }
}

/// `GCS_API_JOB_REQUEUE` (26.19.2).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requeue {
    /// Always `GCS_API_JOB_REQUEUE`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// Job.
    pub job_id: String,
    /// The gateway requeueing; signer (extension).
    pub issued_by: NodeId,
    /// 1 for the first requeue.
    pub requeue_count: u32,
    /// Why.
    pub reason: RequeueReason,
    /// Nodes that may not claim again.
    pub excluded_nodes: Vec<NodeId>,
    /// Wall-clock budget left.
    pub remaining_wall_timeout_ms: u64,
    /// Creation time.
    pub created_at_ms: u64,
    /// Signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl SignedMessage for Requeue {
    const TYPE: MessageType = MessageType::Requeue;
    impl_signed_common!();
    fn signer(&self) -> &NodeId {
        &self.issued_by
    }
    fn created_at_ms(&self) -> u64 {
        self.created_at_ms
    }
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        v::header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("job_id", &self.job_id, ids::JOB)?;
        v::range("requeue_count", self.requeue_count, 1, 64)?;
        v::list("excluded_nodes", &self.excluded_nodes, 256)?;
        let _ = MAX_SHORT;
        Ok(())
    }
}
