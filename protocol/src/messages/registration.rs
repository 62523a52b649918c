//! Node registration (26.10).

use serde::{Deserialize, Serialize};

use super::enums::{ApiType, NodeStatus};
use super::membership::{MembershipCertificate, MAX_MEMBERSHIPS};
use crate::crypto::{NodeId, PublicKey, Signature};
use crate::signed::{impl_signed_common, Limits, MessageType, SignedMessage};
use crate::error::ProtocolError;
use crate::ids;
use crate::validate::{self as v, MAX_LIST, MAX_SHORT};

/// What kinds of work a node takes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct Capabilities {
    pub api_request_job: bool,
    pub processing_chunk_job: bool,
    pub chat: bool,
    pub completion: bool,
    pub embedding: bool,
    pub rag: bool,
    pub code: bool,
    pub streaming: bool,
    pub router_planner: bool,
    pub aggregator: bool,
}

/// One model a node serves.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// Canonical model id, e.g. `smollm2-135m-instruct`.
    pub model_id: String,
    /// Aliases it answers to, e.g. `gnus-auto`.
    pub aliases: Vec<String>,
    /// Maximum context in tokens.
    pub context_tokens: u32,
    /// Weight quantization, e.g. `q4_1`.
    pub quantization: String,
    /// Execution backend, e.g. `burn-flex` (the engine's CPU backend).
    pub backend: String,
    /// API types it serves.
    pub tasks: Vec<ApiType>,
    /// Vocabulary size (token ids below it are valid), so a gateway can
    /// refuse a `logit_bias` beyond it at the edge; 0: not advertised
    /// (extension, omitted when 0 so older signatures are unchanged).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub vocab_size: u32,
    /// Engine build that serves it, e.g. `gcs-engine 0.1.0+out.1`: a stream is
    /// continued only on a worker of the same build (specs/lifecycle.md,
    /// exact continuation). Extension, omitted when empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub engine_build: String,
    /// blake3 (hex) of the model file it loaded, compared with a
    /// `Continuation`'s `model_hash`. Extension, omitted when empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model_hash: String,
    /// This model's single-stream decode speed, tokens/s, measured by the
    /// worker at start (`queue.decode_tokens_per_s` is the slowest of its
    /// models). Extension, omitted when 0 (not measured).
    #[serde(default, skip_serializing_if = "is_zero_rate")]
    pub decode_tokens_per_s: f64,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

fn is_zero_rate(v: &f64) -> bool {
    *v == 0.0
}

impl ModelInfo {
    /// Whether `name` is this model's id or one of its aliases.
    pub fn answers_to(&self, name: &str) -> bool {
        self.model_id == name || self.aliases.iter().any(|a| a == name)
    }
}

/// Queue capacity and load.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct QueueInfo {
    pub max_concurrent_api_jobs: u32,
    pub max_concurrent_processing_jobs: u32,
    pub current_api_jobs: u32,
    pub current_processing_jobs: u32,
    pub accepts_public_jobs: bool,
    pub accepts_private_jobs: bool,
    pub accepts_local_only_jobs: bool,
    /// Free KV-cache capacity in tokens (extension).
    #[serde(default)]
    pub free_kv_tokens: u64,
    /// Measured single-stream decode throughput, tokens/s (extension).
    #[serde(default)]
    pub decode_tokens_per_s: f64,
    /// The GPU the worker's engine runs on (extension; omitted on a CPU
    /// worker, so its signatures are unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accelerator: Option<Accelerator>,
}

/// A worker's GPU (`gcs-node --gpu N`), as its registration advertises it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accelerator {
    /// The engine backend on it, e.g. `cubecl-cuda` (`cubecl-wgpu` in tests).
    pub backend: String,
    /// The device as its driver names it, e.g. `NVIDIA H200`.
    pub name: String,
    /// Device memory in bytes; 0 where the runtime reports none.
    pub memory_bytes: u64,
    /// K/V capacity on it, in tokens, all chat models together.
    pub kv_tokens: u64,
}

/// Trust fields.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct Trust {
    pub reputation_score: f64,
    pub trust_tier: String,
    pub attestation_modes: Vec<String>,
}

impl Default for Trust {
    fn default() -> Self {
        Self {
            reputation_score: 0.5,
            trust_tier: "C".into(),
            attestation_modes: vec!["signed_result".into()],
        }
    }
}

/// Heartbeat timing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct Heartbeat {
    pub created_at_ms: u64,
    pub expires_at_ms: u64,
    pub ttl_ms: u64,
}

/// `GCS_NODE_REGISTRATION`: a signed, short-lived capability advertisement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeRegistration {
    /// Always `GCS_NODE_REGISTRATION`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// `reg_` + ULID, new on every heartbeat.
    pub registration_id: String,
    /// The node; also the signer.
    pub node_id: NodeId,
    /// The node's public key; must be the key its id encodes.
    pub public_key: PublicKey,
    /// Swarm it belongs to (`public` by default).
    pub swarm_id: String,
    /// Tenant for private nodes.
    pub tenant_id: Option<String>,
    /// Online, draining or offline.
    pub status: NodeStatus,
    /// Kinds of work.
    pub capabilities: Capabilities,
    /// Models served.
    pub models: Vec<ModelInfo>,
    /// Capacity and load.
    pub queue: QueueInfo,
    /// Trust fields.
    pub trust: Trust,
    /// Timing.
    pub heartbeat: Heartbeat,
    /// Multiaddrs the node listens on, for direct streams (extension).
    #[serde(default)]
    pub addresses: Vec<String>,
    /// Membership certificates the node presents: a private, hybrid or
    /// local-only claim is valid only with one from the job's tenant or
    /// swarm naming this node (extension; at most `MAX_MEMBERSHIPS`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memberships: Vec<MembershipCertificate>,
    /// ed25519 signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl NodeRegistration {
    /// 26.10.2: fresh while `created <= now + skew` and `now < expires`.
    pub fn is_fresh(&self, now_ms: u64, limits: &Limits) -> bool {
        self.status == NodeStatus::Online
            && self.heartbeat.created_at_ms <= now_ms.saturating_add(limits.max_clock_skew_ms)
            && now_ms < self.heartbeat.expires_at_ms
    }
    /// The model entry answering to `name`.
    pub fn model(&self, name: &str) -> Option<&ModelInfo> {
        self.models.iter().find(|m| m.answers_to(name))
    }
}

impl SignedMessage for NodeRegistration {
    const TYPE: MessageType = MessageType::NodeRegistration;
    impl_signed_common!();
    fn signer(&self) -> &NodeId {
        &self.node_id
    }
    fn created_at_ms(&self) -> u64 {
        self.heartbeat.created_at_ms
    }
    fn expires_at_ms(&self) -> Option<u64> {
        Some(self.heartbeat.expires_at_ms)
    }
    fn check_fields(&self, limits: &Limits) -> Result<(), ProtocolError> {
        v::header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("registration_id", &self.registration_id, ids::REGISTRATION)?;
        if NodeId::from_public_key(&self.public_key) != self.node_id {
            return Err(ProtocolError::field("public_key", "does not match node_id"));
        }
        v::short("swarm_id", &self.swarm_id, MAX_SHORT)?;
        if let Some(t) = &self.tenant_id {
            v::short("tenant_id", t, MAX_SHORT)?;
        }
        v::list("models", &self.models, MAX_LIST)?;
        for m in &self.models {
            v::short("models.model_id", &m.model_id, MAX_SHORT)?;
            v::list("models.aliases", &m.aliases, MAX_LIST)?;
            for a in &m.aliases {
                v::short("models.aliases", a, MAX_SHORT)?;
            }
            v::text("models.quantization", &m.quantization, MAX_SHORT)?;
            v::text("models.backend", &m.backend, MAX_SHORT)?;
            v::list("models.tasks", &m.tasks, 8)?;
            v::range("models.context_tokens", m.context_tokens, 1, 16 * 1024 * 1024)?;
            v::text("models.engine_build", &m.engine_build, MAX_SHORT)?;
            v::finite("models.decode_tokens_per_s", m.decode_tokens_per_s, 0.0, 1e9)?;
            if !m.model_hash.is_empty()
                && (m.model_hash.len() != 64 || !m.model_hash.bytes().all(|b| b.is_ascii_hexdigit()))
            {
                return Err(ProtocolError::field("models.model_hash", "must be 64 hex digits"));
            }
        }
        v::finite("queue.decode_tokens_per_s", self.queue.decode_tokens_per_s, 0.0, 1e9)?;
        if let Some(a) = &self.queue.accelerator {
            v::text("queue.accelerator.backend", &a.backend, MAX_SHORT)?;
            v::text("queue.accelerator.name", &a.name, MAX_SHORT)?;
        }
        v::finite("trust.reputation_score", self.trust.reputation_score, 0.0, 1.0)?;
        v::short("trust.trust_tier", &self.trust.trust_tier, 16)?;
        v::list("trust.attestation_modes", &self.trust.attestation_modes, 16)?;
        for m in &self.trust.attestation_modes {
            v::short("trust.attestation_modes", m, MAX_SHORT)?;
        }
        let hb = &self.heartbeat;
        v::lifetime(
            "heartbeat",
            hb.created_at_ms,
            hb.expires_at_ms,
            limits.max_registration_ttl_ms,
        )?;
        if hb.expires_at_ms - hb.created_at_ms != hb.ttl_ms {
            return Err(ProtocolError::field("heartbeat.ttl_ms", "must equal expires - created"));
        }
        v::list("addresses", &self.addresses, 16)?;
        for a in &self.addresses {
            v::short("addresses", a, 256)?;
        }
        // Bounds only: each certificate's signature and issuer are checked
        // by whoever relies on it, against the tenant key it trusts.
        v::list("memberships", &self.memberships, MAX_MEMBERSHIPS)?;
        for m in &self.memberships {
            m.check_fields(limits)?;
            if m.node_id != self.node_id {
                return Err(ProtocolError::field("memberships", "names another node"));
            }
        }
        Ok(())
    }
}
