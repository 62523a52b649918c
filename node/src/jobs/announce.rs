//! What a gateway announces of a job, and what it keeps (26.20.4): the
//! public `ApiRequestJob` names the tenant (or, with `metadata_minimized`,
//! a per-job opaque reference to it) and carries no project, no API key id
//! and no client idempotency key; the gateway keeps those in its local
//! record of the job ([`GatewayRecord`]). The lease holder learns the real
//! tenant and the prefix-cache salt — a secret per (gateway, tenant) — only
//! with the payload ([`super::wire::LeasedPayload`]).

use gcs_protocol::{
    ids, sign, ApiRequestJob, Hash32, JobLimits, MessageType, NodeKey, PayloadMode, PayloadRef,
    PrivacyLevel, ReplyTo, RequestInfo, Requirements, Source, TenantRef, API_JOB_VERSION,
};
use serde::{Deserialize, Serialize};

use super::JobSpec;
use crate::error::NodeError;

/// One secret of this gateway for `purpose`, from its node key (never
/// leaves the gateway; a different gateway derives different ones).
fn secret(key: &NodeKey, purpose: &str) -> [u8; 32] {
    blake3::derive_key(&format!("gcs gateway secret v1: {purpose}"), &key.seed())
}

/// The prefix-cache salt of `tenant`'s jobs from this gateway.
pub fn cache_salt(key: &NodeKey, tenant: &str) -> [u8; 32] {
    *blake3::keyed_hash(&secret(key, "prefix-cache salt"), tenant.as_bytes()).as_bytes()
}

/// The announced stand-in for a client's idempotency key: stable for one
/// tenant and key on this gateway, meaningless to anyone else.
pub fn idempotency_token(key: &NodeKey, tenant: &str, idem: &str) -> String {
    let mut h = blake3::Hasher::new_keyed(&secret(key, "idempotency token"));
    h.update(tenant.as_bytes()).update(&[0]).update(idem.as_bytes());
    format!("idem_{}", &h.finalize().to_hex()[..32])
}

/// A `metadata_minimized` job's tenant reference: fresh per job, so two
/// jobs of one tenant cannot be linked by it.
pub fn tenant_reference(key: &NodeKey, job_id: &str, tenant: &str) -> String {
    let mut h = blake3::Hasher::new_keyed(&secret(key, "tenant reference"));
    h.update(job_id.as_bytes()).update(&[0]).update(tenant.as_bytes());
    format!("tref_{}", &h.finalize().to_hex()[..32])
}

/// The [`GatewayRecord`] format version; 2 added `sealed` (1 reads as
/// not sealed).
pub const RECORD_VERSION: u16 = 2;

/// What the gateway keeps of a job it published (under `keys::payload`,
/// never replicated to peers): who pays and the body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GatewayRecord {
    /// [`RECORD_VERSION`].
    pub version: u16,
    /// Tenant, project and API key.
    pub billing: TenantRef,
    /// The payload: the body, or for an `encrypted_payload` job the body
    /// sealed to this gateway ([`super::sealed::seal_at_rest`]).
    #[serde(with = "serde_bytes")]
    pub body: Vec<u8>,
    /// Whether `body` is sealed.
    #[serde(default)]
    pub sealed: bool,
    /// The OpenAI batch the job runs for (kept so a usage record written
    /// after a restart still names it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_id: Option<String>,
    /// The price its usage record applies (batch work), kept for the same
    /// reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price_percent: Option<u8>,
}

impl GatewayRecord {
    /// The record of `spec`.
    pub fn of(spec: &JobSpec) -> Self {
        Self {
            version: RECORD_VERSION,
            billing: TenantRef {
                tenant_id: spec.tenant_id.clone(),
                project_id: spec.project_id.clone(),
                api_key_id: spec.api_key_id.clone(),
            },
            body: spec.body.clone(),
            sealed: false,
            batch_id: spec.batch_id.clone(),
            price_percent: spec.price_percent,
        }
    }

    /// Decodes a stored record; `None` for another version or garbage.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let r: Self = gcs_protocol::codec::from_cbor_bytes(bytes).ok()?;
        (1..=RECORD_VERSION).contains(&r.version).then_some(r)
    }
}

/// The signed announcement of `spec` by `key` at `now`.
pub fn build_job(
    spec: &JobSpec,
    key: &NodeKey,
    payload: &[u8],
    now: u64,
) -> Result<ApiRequestJob, NodeError> {
    let job_id = ids::new_id(ids::JOB, now)?;
    let endpoint = match spec.api_type {
        gcs_protocol::ApiType::ChatCompletion => "/v1/chat/completions",
        gcs_protocol::ApiType::Completion => "/v1/completions",
        gcs_protocol::ApiType::Embedding => "/v1/embeddings",
    };
    let tenant_id = if spec.routing.privacy_mode == PrivacyLevel::MetadataMinimized {
        tenant_reference(key, &job_id, &spec.tenant_id)
    } else {
        spec.tenant_id.clone()
    };
    let limits = JobLimits { ..spec.limits.clone() };
    let mut job = ApiRequestJob {
        message_type: MessageType::ApiRequestJob,
        version: API_JOB_VERSION,
        idempotency_key: idempotency_token(key, &spec.tenant_id, &spec.idempotency_key),
        gateway_node_id: key.node_id(),
        source: Source {
            // The worker's priority class (`executor::Priority::of_job`).
            kind: if spec.batch_id.is_some() {
                super::executor::SOURCE_KIND_BATCH.into()
            } else {
                "openai_compatible_api".into()
            },
            endpoint: endpoint.into(),
            method: "POST".into(),
            client_request_id: String::new(),
        },
        tenant: TenantRef { tenant_id, project_id: String::new(), api_key_id: String::new() },
        // Prompt privacy by default (26.20.4): gossip carries only the hash;
        // the lease holder fetches the body from this gateway directly.
        request: RequestInfo {
            api_type: spec.api_type,
            model: spec.model.clone(),
            stream: spec.stream,
            payload_ref: PayloadRef {
                mode: PayloadMode::GatewayRef,
                encrypted: spec.routing.privacy_mode == PrivacyLevel::EncryptedPayload,
                content_hash: Hash32::of(payload),
                size_bytes: payload.len() as u64,
                inline: None,
                location: Some(key.node_id().to_string()),
            },
        },
        routing: spec.routing.clone(),
        requirements: Requirements {
            min_context_tokens: 0,
            supports_streaming: spec.stream,
            supports_chat: spec.api_type != gcs_protocol::ApiType::Embedding,
            supports_embeddings: spec.api_type == gcs_protocol::ApiType::Embedding,
            allowed_model_aliases: vec![spec.model.clone()],
            max_input_tokens: 0,
            max_output_tokens: spec.max_output_tokens,
            continuation: None,
        },
        reply_to: ReplyTo::for_job(&job_id),
        created_at_ms: now,
        expires_at_ms: now + limits.wall_timeout_ms,
        limits,
        job_id,
        announcement: 0,
        parent: spec.parent.clone(),
        signature: None,
    };
    sign(&mut job, key)?;
    Ok(job)
}

#[cfg(test)]
#[path = "announce_tests.rs"]
mod tests;
