//! API request job (26.11).

use serde::{Deserialize, Serialize};

use super::enums::{ApiType, ClaimPolicy, PayloadMode, PrivacyLevel, RoutingMode};
use crate::crypto::{Hash32, NodeId, Signature};
use crate::signed::{impl_signed_common, Limits, MessageType, SignedMessage};
use crate::error::ProtocolError;
use crate::ids;
use crate::validate::{self as v, MAX_LIST, MAX_SHORT};

/// Longest job lifetime accepted (created → expires).
pub const MAX_JOB_LIFETIME_MS: u64 = 60 * 60 * 1000;

/// Where the request came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct Source {
    pub kind: String,
    pub endpoint: String,
    pub method: String,
    pub client_request_id: String,
}

/// Who pays. A gateway's public announcement names only the tenant (or,
/// with `metadata_minimized`, a per-job opaque reference to it): project
/// and API key stay with the gateway, so they are absent on the wire when
/// empty (26.20.4).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantRef {
    /// Tenant id, or an opaque per-job reference (`metadata_minimized`).
    pub tenant_id: String,
    /// Project (empty in announcements).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub project_id: String,
    /// API key id (empty in announcements).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub api_key_id: String,
}

/// Where the request body is (26.11.2).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PayloadRef {
    /// Storage mode.
    pub mode: PayloadMode,
    /// Whether the payload is encrypted.
    pub encrypted: bool,
    /// blake3 of the payload bytes; the fetcher verifies it.
    pub content_hash: Hash32,
    /// Payload size in bytes (extension).
    #[serde(default)]
    pub size_bytes: u64,
    /// The payload itself for `inline` / `encrypted_inline` (extension).
    #[serde(default, with = "opt_bytes")]
    pub inline: Option<Vec<u8>>,
    /// Where to fetch it for reference modes: the gateway's node id for
    /// `gateway_ref`, a key for `crdt_ref`, a CID for `ipfs_cid` (extension).
    #[serde(default)]
    pub location: Option<String>,
}

/// The request itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct RequestInfo {
    pub api_type: ApiType,
    pub model: String,
    pub stream: bool,
    pub payload_ref: PayloadRef,
}

/// Routing and policy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routing {
    /// Routing mode (26.11.3).
    pub network: RoutingMode,
    /// Swarm for `local_only`.
    pub swarm_id: String,
    /// Privacy level (26.20.3).
    pub privacy_mode: PrivacyLevel,
    /// Claim policy.
    pub claim_policy: ClaimPolicy,
    /// Needs a router/planner.
    pub requires_router_planner: bool,
    /// Needs an aggregator.
    pub requires_aggregator: bool,
    /// How many independent executions.
    pub replication_factor: u8,
    /// Verification mode, `none` for MVP.
    pub verification_mode: String,
    /// Tenant allow-list for private routing (extension).
    #[serde(default)]
    pub allowed_nodes: Vec<NodeId>,
    /// Nodes excluded after failures (extension, grows on requeue).
    #[serde(default)]
    pub excluded_nodes: Vec<NodeId>,
    /// The key of the job's tenant (private, hybrid) or swarm (local-only)
    /// whose membership certificates a claimant must present (extension;
    /// set by the gateway from the tenant keys it holds, so workers can
    /// check their own certificate before claiming).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub membership_issuer: Option<NodeId>,
}

impl Routing {
    /// The MVP default: public network, standard privacy, first valid claim.
    pub fn public() -> Self {
        Self {
            network: RoutingMode::Public,
            swarm_id: "public".into(),
            privacy_mode: PrivacyLevel::Standard,
            claim_policy: ClaimPolicy::FirstValidClaim,
            requires_router_planner: false,
            requires_aggregator: false,
            replication_factor: 1,
            verification_mode: "none".into(),
            allowed_nodes: vec![],
            excluded_nodes: vec![],
            membership_issuer: None,
        }
    }
}

/// What a claimant must satisfy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct Requirements {
    pub min_context_tokens: u32,
    pub supports_streaming: bool,
    pub supports_chat: bool,
    pub supports_embeddings: bool,
    pub allowed_model_aliases: Vec<String>,
    pub max_input_tokens: u32,
    pub max_output_tokens: u32,
    /// Set when the job is re-announced as an exact continuation (extension
    /// of 26.16.9): only a worker of this engine build and model file may
    /// claim it. Omitted otherwise, so older jobs encode and sign as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuation: Option<crate::ContinuationOffer>,
}

/// Timeouts and budgets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct JobLimits {
    pub claim_timeout_ms: u64,
    pub first_token_timeout_ms: u64,
    pub idle_stream_timeout_ms: u64,
    pub wall_timeout_ms: u64,
    pub max_cost_gnus: String,
    pub max_requeues: u32,
    /// Exact continuations the job allows (`gnus.continuation`: `auto` is
    /// [`crate::MAX_CONTINUATIONS`], `off` is 0; specs/lifecycle.md).
    /// Extension, omitted at its default so older jobs sign as before.
    #[serde(default = "default_continuations", skip_serializing_if = "is_default_continuations")]
    pub max_continuations: u32,
}

fn default_continuations() -> u32 {
    crate::MAX_CONTINUATIONS
}

fn is_default_continuations(n: &u32) -> bool {
    *n == crate::MAX_CONTINUATIONS
}

impl Default for JobLimits {
    /// The MVP defaults of 26.11.1 and 26.16.7.
    fn default() -> Self {
        Self {
            claim_timeout_ms: 1_000,
            first_token_timeout_ms: 10_000,
            idle_stream_timeout_ms: 30_000,
            wall_timeout_ms: 120_000,
            max_cost_gnus: "auto".into(),
            max_requeues: 2,
            max_continuations: crate::MAX_CONTINUATIONS,
        }
    }
}

/// Per-job reply channels (carried over direct streams, see specs/).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct ReplyTo {
    pub result_channel: String,
    pub stream_channel: String,
    pub claim_channel: String,
}

impl ReplyTo {
    /// The channels 26.9.4 names for `job_id`.
    pub fn for_job(job_id: &str) -> Self {
        Self {
            result_channel: format!("gcs.api.results.{job_id}"),
            stream_channel: format!("gcs.api.stream.{job_id}"),
            claim_channel: format!("gcs.api.claims.{job_id}"),
        }
    }
}

/// `GCS_API_REQUEST_JOB`: an OpenAI request turned into a signed job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiRequestJob {
    /// Always `GCS_API_REQUEST_JOB`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// `gcsapi_` + ULID.
    pub job_id: String,
    /// An opaque token the gateway derives from the client's idempotency
    /// key (never the key itself: the gateway keeps that mapping locally).
    pub idempotency_key: String,
    /// The gateway that publishes and signs the job (extension).
    pub gateway_node_id: NodeId,
    /// Request origin.
    pub source: Source,
    /// Tenant, project, key.
    pub tenant: TenantRef,
    /// The request.
    pub request: RequestInfo,
    /// Routing policy.
    pub routing: Routing,
    /// Claimant requirements.
    pub requirements: Requirements,
    /// Timeouts.
    pub limits: JobLimits,
    /// Reply channels.
    pub reply_to: ReplyTo,
    /// Creation time.
    pub created_at_ms: u64,
    /// Expiry.
    pub expires_at_ms: u64,
    /// How many times the gateway announced this job before (extension;
    /// absent on the first announcement). Each re-announcement of an
    /// unclaimed job is new bytes, so gossip's duplicate cache does not
    /// swallow it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub announcement: u32,
    /// The API job this one is a child of (26.14.2; extension): its
    /// deadline and policy are the parent's. Absent, and so outside the
    /// signed bytes, for a job without a parent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<crate::ChildJobReference>,
    /// Signature by `gateway_node_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl SignedMessage for ApiRequestJob {
    const TYPE: MessageType = MessageType::ApiRequestJob;
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
    fn check_fields(&self, limits: &Limits) -> Result<(), ProtocolError> {
        v::header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("job_id", &self.job_id, ids::JOB)?;
        v::short("idempotency_key", &self.idempotency_key, 256)?;
        v::short("source.kind", &self.source.kind, MAX_SHORT)?;
        v::short("source.endpoint", &self.source.endpoint, MAX_SHORT)?;
        v::short("source.method", &self.source.method, 16)?;
        v::text("source.client_request_id", &self.source.client_request_id, MAX_SHORT)?;
        v::short("tenant.tenant_id", &self.tenant.tenant_id, MAX_SHORT)?;
        if self.version >= 2 {
            // Version 2: the gateway keeps project and key (26.20.4).
            for (f, s) in [
                ("tenant.project_id", &self.tenant.project_id),
                ("tenant.api_key_id", &self.tenant.api_key_id),
            ] {
                if !s.is_empty() {
                    return Err(ProtocolError::field(f, "an announcement (version 2) carries none"));
                }
            }
        } else {
            v::short("tenant.project_id", &self.tenant.project_id, MAX_SHORT)?;
            v::short("tenant.api_key_id", &self.tenant.api_key_id, MAX_SHORT)?;
        }
        v::short("request.model", &self.request.model, MAX_SHORT)?;
        let p = &self.request.payload_ref;
        match (p.mode, &p.inline) {
            (PayloadMode::Inline | PayloadMode::EncryptedInline, None) => {
                return Err(ProtocolError::field("request.payload_ref.inline", "missing"));
            }
            (PayloadMode::Inline | PayloadMode::EncryptedInline, Some(b)) => {
                if b.len() as u64 != p.size_bytes {
                    return Err(ProtocolError::field("request.payload_ref.size_bytes", "mismatch"));
                }
                if p.mode == PayloadMode::Inline && crate::Hash32::of(b) != p.content_hash {
                    return Err(ProtocolError::field(
                        "request.payload_ref.content_hash",
                        "does not match the inline payload",
                    ));
                }
            }
            (_, Some(_)) => {
                return Err(ProtocolError::field(
                    "request.payload_ref.inline",
                    "only inline modes carry the payload",
                ));
            }
            (_, None) => match &p.location {
                Some(l) => v::short("request.payload_ref.location", l, 512)?,
                None => {
                    return Err(ProtocolError::field("request.payload_ref.location", "missing"))
                }
            },
        }
        let r = &self.routing;
        v::short("routing.swarm_id", &r.swarm_id, MAX_SHORT)?;
        v::short("routing.verification_mode", &r.verification_mode, MAX_SHORT)?;
        v::range("routing.replication_factor", r.replication_factor, 1, 16)?;
        v::list("routing.allowed_nodes", &r.allowed_nodes, 256)?;
        v::list("routing.excluded_nodes", &r.excluded_nodes, 256)?;
        let q = &self.requirements;
        if let Some(offer) = &q.continuation {
            offer.check()?;
        }
        v::list("requirements.allowed_model_aliases", &q.allowed_model_aliases, MAX_LIST)?;
        for a in &q.allowed_model_aliases {
            v::short("requirements.allowed_model_aliases", a, MAX_SHORT)?;
        }
        let l = &self.limits;
        v::range("limits.claim_timeout_ms", l.claim_timeout_ms, 1, MAX_JOB_LIFETIME_MS)?;
        v::range(
            "limits.first_token_timeout_ms",
            l.first_token_timeout_ms,
            1,
            MAX_JOB_LIFETIME_MS,
        )?;
        v::range(
            "limits.idle_stream_timeout_ms",
            l.idle_stream_timeout_ms,
            1,
            MAX_JOB_LIFETIME_MS,
        )?;
        v::range("limits.wall_timeout_ms", l.wall_timeout_ms, 1, MAX_JOB_LIFETIME_MS)?;
        v::short("limits.max_cost_gnus", &l.max_cost_gnus, 32)?;
        v::range("limits.max_requeues", l.max_requeues, 0, 16)?;
        v::range("limits.max_continuations", l.max_continuations, 0, crate::MAX_CONTINUATIONS)?;
        let rt = &self.reply_to;
        for (f, c) in [
            ("reply_to.result_channel", &rt.result_channel),
            ("reply_to.stream_channel", &rt.stream_channel),
            ("reply_to.claim_channel", &rt.claim_channel),
        ] {
            v::short(f, c, 256)?;
        }
        v::lifetime("expires_at_ms", self.created_at_ms, self.expires_at_ms, MAX_JOB_LIFETIME_MS)?;
        if let Some(p) = &self.parent {
            p.check("parent")?;
            if p.parent_job.job_id == self.job_id {
                return Err(ProtocolError::field("parent", "a job cannot be its own parent"));
            }
        }
        let _ = limits;
        Ok(())
    }
}

/// `Option<Vec<u8>>` as a CBOR byte string (hex in JSON) rather than an
/// array of integers.
pub(crate) mod opt_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            None => s.serialize_none(),
            Some(b) if s.is_human_readable() => s.serialize_some(&hex::encode(b)),
            Some(b) => s.serialize_some(&serde_bytes_ref(b)),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        if d.is_human_readable() {
            let s: Option<String> = Option::deserialize(d)?;
            s.map(|s| hex::decode(s).map_err(serde::de::Error::custom)).transpose()
        } else {
            let b: Option<ByteBuf> = Option::deserialize(d)?;
            Ok(b.map(|b| b.0))
        }
    }

    struct BytesRef<'a>(&'a [u8]);
    impl serde::Serialize for BytesRef<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(self.0)
        }
    }
    fn serde_bytes_ref(b: &[u8]) -> BytesRef<'_> {
        BytesRef(b)
    }

    struct ByteBuf(Vec<u8>);
    impl<'de> Deserialize<'de> for ByteBuf {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = ByteBuf;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a byte string")
                }
                fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<ByteBuf, E> {
                    Ok(ByteBuf(v.to_vec()))
                }
                fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<ByteBuf, E> {
                    Ok(ByteBuf(v))
                }
            }
            d.deserialize_bytes(V)
        }
    }
}
