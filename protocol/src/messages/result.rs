//! Final results and usage records (26.17, 26.21).

use serde::{Deserialize, Serialize};

use super::enums::{ApiType, CancellationReason, ResultStatus, RoutingMode};
use crate::crypto::{Hash32, NodeId, Signature};
use crate::signed::{impl_signed_common, Limits, MessageType, SignedMessage};
use crate::error::ProtocolError;
use crate::ids;
use crate::validate::{self as v, MAX_SHORT, MAX_TEXT};

/// The OpenAI-shaped response body.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResponseBody {
    /// e.g. `openai.chat.completion`.
    pub format: String,
    /// The OpenAI JSON body.
    pub body: serde_json::Value,
}

/// A typed error (26.17.2).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorInfo {
    /// OpenAI error type, e.g. `service_unavailable`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Machine code, e.g. `gnus_no_capable_nodes`.
    pub code: String,
    /// Human-readable message.
    pub message: String,
}

impl ErrorInfo {
    /// The error type of a client error: the request cannot be served as
    /// asked on any worker (a failed result of this type is returned to the
    /// client as a 400, never requeued and never held against the worker).
    pub const CLIENT_ERROR: &'static str = "invalid_request_error";
    /// The code of a worker's refusal of a job as invalid.
    pub const INVALID_REQUEST_CODE: &'static str = "gnus_invalid_request";

    /// A client error with this message.
    pub fn invalid_request(message: impl Into<String>) -> Self {
        Self {
            kind: Self::CLIENT_ERROR.into(),
            code: Self::INVALID_REQUEST_CODE.into(),
            message: message.into(),
        }
    }

    /// Whether this is a client error (see [`Self::CLIENT_ERROR`]).
    pub fn is_client_error(&self) -> bool {
        self.kind == Self::CLIENT_ERROR
    }
}

/// Worker-side metering.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct Metering {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub tokens_sent_to_client: u64,
    /// Prompt tokens served from a reused KV prefix (extension).
    #[serde(default)]
    pub cached_tokens: u64,
    pub compute_ms: u64,
    /// Worker-side time to first token (extension).
    #[serde(default)]
    pub first_token_ms: u64,
    pub child_jobs: u32,
    pub cost_gnus: String,
}

/// Binding of a result to its claim and registration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct Attestation {
    pub claim_id: String,
    pub registration_id: String,
    pub result_hash: Hash32,
}

/// `GCS_API_FINAL_RESULT`: a worker's final result, or an error result from a
/// worker or (e.g. `gnus_no_capable_nodes`) from the gateway itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FinalResult {
    /// Always `GCS_API_FINAL_RESULT`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// Job.
    pub job_id: String,
    /// Signer: the worker, or the gateway for gateway-side errors.
    pub node_id: NodeId,
    /// The lease it was produced under (none for gateway errors).
    pub lease_id: Option<String>,
    /// Outcome.
    pub status: ResultStatus,
    /// The response body when completed.
    pub response: Option<ResponseBody>,
    /// The error when failed.
    pub error: Option<ErrorInfo>,
    /// Metering.
    pub metering: Option<Metering>,
    /// Attestation.
    pub attestation: Option<Attestation>,
    /// Number of stream chunks the worker sent (lets the gateway tell a
    /// complete stream from a truncated one; extension).
    #[serde(default)]
    pub chunks_sent: u64,
    /// Creation time.
    pub created_at_ms: u64,
    /// Signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl SignedMessage for FinalResult {
    const TYPE: MessageType = MessageType::FinalResult;
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
        if let Some(l) = &self.lease_id {
            ids::check_id("lease_id", l, ids::LEASE)?;
        }
        match (self.status, &self.response, &self.error) {
            (ResultStatus::Completed, Some(r), None) => {
                v::short("response.format", &r.format, MAX_SHORT)?
            }
            (ResultStatus::Completed, _, _) => {
                return Err(ProtocolError::field(
                    "response",
                    "completed needs a response and no error",
                ))
            }
            (ResultStatus::Failed | ResultStatus::Cancelled, None, Some(e)) => {
                v::short("error.type", &e.kind, MAX_SHORT)?;
                v::short("error.code", &e.code, MAX_SHORT)?;
                v::text("error.message", &e.message, MAX_TEXT)?;
            }
            _ => {
                return Err(ProtocolError::field(
                    "error",
                    "failed/cancelled needs an error and no response",
                ))
            }
        }
        if let Some(a) = &self.attestation {
            ids::check_id("attestation.claim_id", &a.claim_id, ids::CLAIM)?;
            ids::check_id("attestation.registration_id", &a.registration_id, ids::REGISTRATION)?;
        }
        if let Some(m) = &self.metering {
            v::short("metering.cost_gnus", &m.cost_gnus, 32)?;
            if m.tokens_sent_to_client > m.output_tokens {
                return Err(ProtocolError::field(
                    "metering.tokens_sent_to_client",
                    "exceeds output_tokens",
                ));
            }
        }
        Ok(())
    }
}

/// One lease holder's part of a continued job's output (exact
/// continuation, specs/lifecycle.md).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolderTokens {
    /// The holder.
    pub node_id: NodeId,
    /// Output tokens of its fenced chunks that reached the client.
    pub output_tokens: u64,
}

/// Most child jobs one parent may count.
pub const MAX_CHILD_JOBS: u32 = 4096;

impl UsageRecord {
    /// The tokens this record charges against a budget: none for a
    /// parent's roll-up (its children's records carry them), else input +
    /// generated output at `price_percent` (rounded up).
    pub fn charged_tokens(&self) -> u64 {
        if self.child_jobs > 0 {
            return 0;
        }
        let t = self.input_tokens.saturating_add(self.output_tokens_generated);
        let p = u64::from(self.price_percent.unwrap_or(100));
        t.saturating_mul(p).div_ceil(100)
    }
}

/// `GCS_API_USAGE_RECORD` (26.21.1), one per job, signed by the gateway that
/// saw both what the worker generated and what the client received.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct UsageRecord {
    /// Always `GCS_API_USAGE_RECORD`.
    pub message_type: MessageType,
    pub version: u16,
    pub job_id: String,
    pub tenant_id: String,
    pub project_id: String,
    pub api_key_id: String,
    /// The worker that executed (last lease holder), if any.
    pub node_id: Option<NodeId>,
    /// The gateway that recorded it; signer (extension).
    pub recorded_by: NodeId,
    pub model: String,
    pub api_type: ApiType,
    pub network: RoutingMode,
    pub input_tokens: u64,
    /// Prompt tokens served from the reused KV prefix (extension).
    #[serde(default)]
    pub cached_tokens: u64,
    pub output_tokens_generated: u64,
    pub output_tokens_sent_to_client: u64,
    pub embedding_tokens: u64,
    pub retrieval_chunks: u32,
    pub child_jobs: u32,
    pub compute_ms: u64,
    pub first_token_ms: Option<u64>,
    pub wall_ms: u64,
    /// Times the job was requeued (extension).
    #[serde(default)]
    pub requeue_count: u32,
    pub cost_gnus: String,
    pub cancellation_reason: Option<CancellationReason>,
    /// Whether the stream failed after partial output (26.16.10, extension).
    #[serde(default)]
    pub failed_after_partial_output: bool,
    /// The OpenAI batch (`batch_<24 hex>`) the job ran for (extension);
    /// absent, and so outside the signed bytes, for API work, so records
    /// signed before the field existed still verify.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_id: Option<String>,
    /// A job continued on other workers: every lease holder in order and
    /// the output tokens it delivered (extension; absent, and so outside
    /// the signed bytes, for a job that never continued).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub holders: Vec<HolderTokens>,
    /// A child job's parent (extension; absent, and so outside the signed
    /// bytes, for a job without one). The child's record meters its tokens;
    /// the parent's record (`child_jobs` > 0) sums them for the reader and
    /// is not charged again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_job_id: Option<String>,
    /// The price applied to this job's tokens, in percent of the API price
    /// (extension; batch work, specs/batch.md "Pricing"; absent means 100,
    /// and is outside the signed bytes). The token counts stay real.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price_percent: Option<u8>,
    pub created_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl SignedMessage for UsageRecord {
    const TYPE: MessageType = MessageType::UsageRecord;
    impl_signed_common!();
    fn signer(&self) -> &NodeId {
        &self.recorded_by
    }
    fn created_at_ms(&self) -> u64 {
        self.created_at_ms
    }
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        v::header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("job_id", &self.job_id, ids::JOB)?;
        v::short("tenant_id", &self.tenant_id, MAX_SHORT)?;
        v::short("project_id", &self.project_id, MAX_SHORT)?;
        v::short("api_key_id", &self.api_key_id, MAX_SHORT)?;
        v::short("model", &self.model, MAX_SHORT)?;
        v::short("cost_gnus", &self.cost_gnus, 32)?;
        if let Some(b) = &self.batch_id {
            v::short("batch_id", b, MAX_SHORT)?;
        }
        if let Some(p) = &self.parent_job_id {
            ids::check_id("parent_job_id", p, ids::JOB)?;
            if self.child_jobs > 0 {
                return Err(ProtocolError::field("parent_job_id", "a child job has no children"));
            }
        }
        if let Some(p) = self.price_percent {
            // Only batch work is priced below API work: a price on a
            // record of no batch would let its gateway discount any job.
            if self.batch_id.is_none() {
                return Err(ProtocolError::field("price_percent", "only batch work has a price"));
            }
            v::range("price_percent", p, 1, 100)?;
        }
        v::range("child_jobs", self.child_jobs, 0, MAX_CHILD_JOBS)?;
        if self.output_tokens_sent_to_client > self.output_tokens_generated {
            return Err(ProtocolError::field(
                "output_tokens_sent_to_client",
                "exceeds output_tokens_generated",
            ));
        }
        if self.cached_tokens > self.input_tokens {
            return Err(ProtocolError::field("cached_tokens", "exceeds input_tokens"));
        }
        // One holder per continuation plus the first.
        v::list("holders", &self.holders, crate::MAX_CONTINUATIONS as usize + 1)?;
        let shared = self.holders.iter().fold(0u64, |a, h| a.saturating_add(h.output_tokens));
        if shared > self.output_tokens_sent_to_client {
            return Err(ProtocolError::field("holders", "exceed output_tokens_sent_to_client"));
        }
        Ok(())
    }
}
