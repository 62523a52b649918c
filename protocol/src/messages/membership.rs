//! Membership certificates and their revocations: a tenant (or a swarm)
//! signs, with its own ed25519 key, that one node belongs to its private
//! pool, its local swarm, or its gateways (26.11.3, 26.20). The key's id
//! (`gnusnode_...` form of its public key) is the `issuer`; verifiers trust
//! an issuer only for the tenant or swarm they hold its key for
//! (specs/network.md, "Tenant-signed membership").

use serde::{Deserialize, Serialize};

use crate::crypto::{NodeId, Signature};
use crate::error::ProtocolError;
use crate::ids;
use crate::signed::{impl_signed_common, Limits, MessageType, SignedMessage};
use crate::validate::{self as v, MAX_SHORT};

/// Longest certificate lifetime: a certificate is renewed, never permanent.
pub const MAX_MEMBERSHIP_TTL_MS: u64 = 30 * 86_400_000;
/// Default certificate lifetime (24 h).
pub const DEFAULT_MEMBERSHIP_TTL_MS: u64 = 86_400_000;
/// Certificates a registration presents at most.
pub const MAX_MEMBERSHIPS: usize = 8;

/// What a certificate admits its node to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum MembershipScope {
    /// A private node of the tenant: may win its private and hybrid jobs.
    #[serde(rename = "tenant_member")]
    TenantMember,
    /// A gateway of the tenant: may write its usage records.
    #[serde(rename = "tenant_gateway")]
    TenantGateway,
    /// A node of the swarm: may win its `local_only` jobs.
    #[serde(rename = "swarm_member")]
    SwarmMember,
    /// A worker attached to one gateway: may win that gateway's
    /// `gateway_local` jobs. Issued by the gateway's own node key; the
    /// group is the gateway's node id.
    #[serde(rename = "gateway_worker")]
    GatewayWorker,
}

impl MembershipScope {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            MembershipScope::TenantMember => "tenant_member",
            MembershipScope::TenantGateway => "tenant_gateway",
            MembershipScope::SwarmMember => "swarm_member",
            MembershipScope::GatewayWorker => "gateway_worker",
        }
    }
    /// Whether the group is a swarm (else a tenant).
    pub fn is_swarm(self) -> bool {
        self == MembershipScope::SwarmMember
    }
}

/// `GCS_MEMBERSHIP_CERTIFICATE` (extension): the issuer admits `node_id`
/// to `group_id` in `scope` until `expires_at_ms`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MembershipCertificate {
    /// Always `GCS_MEMBERSHIP_CERTIFICATE`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// `mcert_` + ULID.
    pub certificate_id: String,
    /// What it admits to.
    pub scope: MembershipScope,
    /// The tenant or swarm id.
    pub group_id: String,
    /// The admitted node.
    pub node_id: NodeId,
    /// The tenant's or swarm's key; signer.
    pub issuer: NodeId,
    /// Issue time.
    pub issued_at_ms: u64,
    /// Expiry.
    pub expires_at_ms: u64,
    /// Signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl MembershipCertificate {
    /// Whether it admits `node` to `group` in `scope` at `now_ms` (the
    /// signature and the issuer's trust are the caller's to check).
    pub fn admits(&self, scope: MembershipScope, group: &str, node: &NodeId, now_ms: u64) -> bool {
        self.scope == scope
            && self.group_id == group
            && &self.node_id == node
            && self.issued_at_ms <= now_ms
            && now_ms < self.expires_at_ms
    }
}

impl SignedMessage for MembershipCertificate {
    const TYPE: MessageType = MessageType::MembershipCertificate;
    impl_signed_common!();
    fn signer(&self) -> &NodeId {
        &self.issuer
    }
    fn created_at_ms(&self) -> u64 {
        self.issued_at_ms
    }
    fn expires_at_ms(&self) -> Option<u64> {
        Some(self.expires_at_ms)
    }
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        v::header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("certificate_id", &self.certificate_id, ids::MEMBERSHIP)?;
        v::short("group_id", &self.group_id, MAX_SHORT)?;
        v::lifetime("expires_at_ms", self.issued_at_ms, self.expires_at_ms, MAX_MEMBERSHIP_TTL_MS)
    }
}

/// `GCS_MEMBERSHIP_REVOCATION` (extension): the issuer withdraws one
/// certificate before its expiry. It names the certificate and its node, so
/// it is stored where the certificate is and replaces it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MembershipRevocation {
    /// Always `GCS_MEMBERSHIP_REVOCATION`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// The revoked certificate.
    pub certificate_id: String,
    /// Its scope.
    pub scope: MembershipScope,
    /// Its tenant or swarm.
    pub group_id: String,
    /// Its node.
    pub node_id: NodeId,
    /// The issuer of the certificate; signer.
    pub issuer: NodeId,
    /// Creation time: every certificate of this issuer for this node issued
    /// at or before it is void.
    pub created_at_ms: u64,
    /// Signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl SignedMessage for MembershipRevocation {
    const TYPE: MessageType = MessageType::MembershipRevocation;
    impl_signed_common!();
    fn signer(&self) -> &NodeId {
        &self.issuer
    }
    fn created_at_ms(&self) -> u64 {
        self.created_at_ms
    }
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        v::header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("certificate_id", &self.certificate_id, ids::MEMBERSHIP)?;
        v::short("group_id", &self.group_id, MAX_SHORT)
    }
}
