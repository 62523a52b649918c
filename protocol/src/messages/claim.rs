//! Claims, claim rejections, leases and lease renewals (26.12).

use serde::{Deserialize, Serialize};

use super::enums::{ClaimPolicy, ClaimRejectReason};
use crate::crypto::{NodeId, Signature};
use crate::signed::{impl_signed_common, Limits, MessageType, SignedMessage};
use crate::error::ProtocolError;
use crate::ids;
use crate::validate::{self as v, MAX_SHORT, MAX_TEXT};

/// Longest claim lifetime.
pub const MAX_CLAIM_LIFETIME_MS: u64 = 60_000;
/// Longest single lease term; longer work renews.
pub const MAX_LEASE_TERM_MS: u64 = 10 * 60_000;

/// What the claimant says it matches.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct CapabilityMatch {
    pub model_id: String,
    pub supports_streaming: bool,
    pub context_tokens: u32,
    pub api_request_job: bool,
}

/// The claimant's estimates.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct Estimates {
    pub start_ms: u64,
    pub first_token_ms: u64,
    pub wall_ms: u64,
}

/// `GCS_API_JOB_CLAIM` (26.12.2).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobClaim {
    /// Always `GCS_API_JOB_CLAIM`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// Job claimed.
    pub job_id: String,
    /// `claim_` + ULID.
    pub claim_id: String,
    /// Claimant; signer.
    pub node_id: NodeId,
    /// The registration the claim relies on (extension).
    pub registration_id: String,
    /// Policy the claimant follows.
    pub claim_policy: ClaimPolicy,
    /// What it matches.
    pub capability_match: CapabilityMatch,
    /// Estimates.
    pub estimated: Estimates,
    /// Creation time.
    pub created_at_ms: u64,
    /// Expiry.
    pub expires_at_ms: u64,
    /// Signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl SignedMessage for JobClaim {
    const TYPE: MessageType = MessageType::JobClaim;
    impl_signed_common!();
    fn signer(&self) -> &NodeId {
        &self.node_id
    }
    fn created_at_ms(&self) -> u64 {
        self.created_at_ms
    }
    fn expires_at_ms(&self) -> Option<u64> {
        Some(self.expires_at_ms)
    }
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        v::header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("job_id", &self.job_id, ids::JOB)?;
        ids::check_id("claim_id", &self.claim_id, ids::CLAIM)?;
        ids::check_id("registration_id", &self.registration_id, ids::REGISTRATION)?;
        v::short("capability_match.model_id", &self.capability_match.model_id, MAX_SHORT)?;
        v::lifetime("expires_at_ms", self.created_at_ms, self.expires_at_ms, MAX_CLAIM_LIFETIME_MS)
    }
}

/// `GCS_API_CLAIM_REJECTION`: the gateway's answer to a losing or invalid
/// claim, so the claimant stops waiting (extension).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRejection {
    /// Always `GCS_API_CLAIM_REJECTION`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// Job.
    pub job_id: String,
    /// Rejected claim.
    pub claim_id: String,
    /// Claimant.
    pub node_id: NodeId,
    /// Gateway; signer.
    pub gateway_node_id: NodeId,
    /// Which of the eleven counts failed.
    pub reason: ClaimRejectReason,
    /// Human-readable detail.
    pub detail: String,
    /// Creation time.
    pub created_at_ms: u64,
    /// Signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl SignedMessage for ClaimRejection {
    const TYPE: MessageType = MessageType::ClaimRejection;
    impl_signed_common!();
    fn signer(&self) -> &NodeId {
        &self.gateway_node_id
    }
    fn created_at_ms(&self) -> u64 {
        self.created_at_ms
    }
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        v::header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("job_id", &self.job_id, ids::JOB)?;
        ids::check_id("claim_id", &self.claim_id, ids::CLAIM)?;
        v::text("detail", &self.detail, MAX_TEXT)
    }
}

/// `GCS_API_JOB_LEASE`: the gateway accepts a claim and grants a lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseGrant {
    /// Always `GCS_API_JOB_LEASE`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// Job.
    pub job_id: String,
    /// `lease_` + ULID; every chunk and result names it (the fencing token).
    pub lease_id: String,
    /// The accepted claim.
    pub claim_id: String,
    /// Lease holder.
    pub node_id: NodeId,
    /// Gateway; signer.
    pub gateway_node_id: NodeId,
    /// Attempt number: 0 for the first lease, +1 per requeue.
    pub attempt: u32,
    /// How often the holder must renew.
    pub renew_interval_ms: u64,
    /// Grant time.
    pub created_at_ms: u64,
    /// Lease expiry unless renewed.
    pub expires_at_ms: u64,
    /// Signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl SignedMessage for LeaseGrant {
    const TYPE: MessageType = MessageType::LeaseGrant;
    impl_signed_common!();
    fn signer(&self) -> &NodeId {
        &self.gateway_node_id
    }
    fn created_at_ms(&self) -> u64 {
        self.created_at_ms
    }
    fn expires_at_ms(&self) -> Option<u64> {
        Some(self.expires_at_ms)
    }
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        v::header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("job_id", &self.job_id, ids::JOB)?;
        ids::check_id("lease_id", &self.lease_id, ids::LEASE)?;
        ids::check_id("claim_id", &self.claim_id, ids::CLAIM)?;
        v::range("attempt", self.attempt, 0, 64)?;
        v::lifetime("expires_at_ms", self.created_at_ms, self.expires_at_ms, MAX_LEASE_TERM_MS)?;
        v::range(
            "renew_interval_ms",
            self.renew_interval_ms,
            1,
            self.expires_at_ms - self.created_at_ms,
        )
    }
}

/// `GCS_API_LEASE_RENEWAL`: the holder asks to extend its lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRenewal {
    /// Always `GCS_API_LEASE_RENEWAL`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// Job.
    pub job_id: String,
    /// Lease being renewed.
    pub lease_id: String,
    /// Holder; signer.
    pub node_id: NodeId,
    /// Chunks sent so far (progress; does not replace renewal, 26.12.3).
    pub chunks_sent: u64,
    /// Renewal time.
    pub created_at_ms: u64,
    /// Requested new expiry.
    pub expires_at_ms: u64,
    /// Signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl SignedMessage for LeaseRenewal {
    const TYPE: MessageType = MessageType::LeaseRenewal;
    impl_signed_common!();
    fn signer(&self) -> &NodeId {
        &self.node_id
    }
    fn created_at_ms(&self) -> u64 {
        self.created_at_ms
    }
    fn expires_at_ms(&self) -> Option<u64> {
        Some(self.expires_at_ms)
    }
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        v::header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("job_id", &self.job_id, ids::JOB)?;
        ids::check_id("lease_id", &self.lease_id, ids::LEASE)?;
        v::lifetime("expires_at_ms", self.created_at_ms, self.expires_at_ms, MAX_LEASE_TERM_MS)
    }
}
