//! The per-job direct-stream protocol ([`PROTOCOL`]): claims, leases,
//! chunks, results, renewals and cancellations travel between the gateway
//! and the worker as signed protocol envelopes, not as gossip; the payload
//! goes to the lease holder only, with what only it may learn.

use serde::{Deserialize, Serialize};

/// The stream protocol's name; 1.1.0: the payload answer is a
/// [`LeasedPayload`] (1.0.0 sent the bare body).
pub const PROTOCOL: &str = "/gcs/job/1.1.0";

/// The [`LeasedPayload`] format version.
pub const LEASED_PAYLOAD_VERSION: u16 = 1;

/// What the lease holder gets, and nobody else (26.20.4): the request body
/// (its hash is in the signed job), the job's real tenant (a
/// `metadata_minimized` announcement names only an opaque reference), and
/// the prefix-cache salt — a secret of the gateway per tenant, so jobs of
/// other gateways or tenants never hit this tenant's cached prefixes and
/// `cached_tokens` tells a prober nothing.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeasedPayload {
    /// [`LEASED_PAYLOAD_VERSION`].
    pub version: u16,
    /// The typed request (`gcs_gateway::payload::JobRequest`).
    #[serde(with = "serde_bytes")]
    pub body: Vec<u8>,
    /// The tenant the job runs for.
    pub tenant_id: String,
    /// 32 secret bytes; equal salts may share cached prefixes.
    #[serde(with = "serde_bytes")]
    pub cache_salt: Vec<u8>,
    /// For a continuation lease only: where the stream stands (the tokens
    /// the client received, the seed, the sequence to number from). Omitted
    /// otherwise, so a plain answer encodes as in version 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuation: Option<gcs_protocol::Continuation>,
}

impl std::fmt::Debug for LeasedPayload {
    // The salt is a secret and the body a prompt: neither goes to a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeasedPayload")
            .field("version", &self.version)
            .field("body_bytes", &self.body.len())
            .field("tenant_id", &self.tenant_id)
            .finish_non_exhaustive()
    }
}

/// Longest tenant id a worker accepts in a [`LeasedPayload`].
pub const MAX_TENANT_ID: usize = 128;

impl LeasedPayload {
    /// A payload answer of the current version.
    pub fn new(body: Vec<u8>, tenant_id: String, cache_salt: [u8; 32]) -> Self {
        Self {
            version: LEASED_PAYLOAD_VERSION,
            body,
            tenant_id,
            cache_salt: cache_salt.to_vec(),
            continuation: None,
        }
    }

    /// Why the worker must not run it, if anything is wrong with its form.
    pub fn problem(&self) -> Option<&'static str> {
        if self.version != LEASED_PAYLOAD_VERSION {
            Some("unsupported payload answer version")
        } else if self.cache_salt.len() != 32 {
            Some("the cache salt is not 32 bytes")
        } else if self.tenant_id.is_empty() || self.tenant_id.len() > MAX_TENANT_ID {
            Some("the tenant id is empty or too long")
        } else if self.continuation.as_ref().is_some_and(|c| c.check().is_err()) {
            Some("the continuation is malformed")
        } else {
            None
        }
    }

    /// The salt as the engine keys its prefix cache on it.
    pub fn salt_hex(&self) -> String {
        hex::encode(&self.cache_salt)
    }
}

/// A request on the job protocol.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum JobRequest {
    /// A signed envelope (claim, chunk, result, renewal, cancellation).
    Envelope(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The lease holder fetches the request body (26.11.2 `gateway_ref`).
    FetchPayload {
        /// Job.
        job_id: String,
        /// The lease the fetcher holds.
        lease_id: String,
    },
    /// A processing lock holder fetches one input chunk of its subtask
    /// (specs/batch.md, "Processing on the network").
    FetchChunk(Box<ChunkFetch>),
    /// A processing lock holder hands in one signed output.
    DeliverOutput(Box<OutputDelivery>),
    /// A gateway of a task's tenant pulls what it lacks of the task
    /// (specs/batch.md, "Mirrors").
    MirrorPull(Box<MirrorPull>),
}

/// Version of [`ChunkFetch`] and [`OutputDelivery`].
pub const PROCESSING_WIRE_VERSION: u16 = 1;
/// Largest lock delta a processing request may carry (a lock record is at
/// most 64 KiB, plus the delta's own fields).
pub const MAX_LOCK_DELTA_BYTES: usize = 80 << 10;

/// A fetch of one input chunk, with the lock it is asked under: the
/// gateway merges the lock first (gossip may not have carried it yet).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChunkFetch {
    /// [`PROCESSING_WIRE_VERSION`].
    pub version: u16,
    /// The lock's delta (`gcs_keyspace::Delta::encode`), its latest renewal.
    #[serde(with = "serde_bytes")]
    pub lock: Vec<u8>,
    /// Task.
    pub task_id: String,
    /// `c<index>`.
    pub chunk_id: String,
}

/// One signed output, with the lock it ran under.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OutputDelivery {
    /// [`PROCESSING_WIRE_VERSION`].
    pub version: u16,
    /// The lock's delta, its latest renewal.
    #[serde(with = "serde_bytes")]
    pub lock: Vec<u8>,
    /// The encoded, signed output chunk.
    #[serde(with = "serde_bytes")]
    pub output: Vec<u8>,
}

/// Version of [`MirrorPull`].
pub const MIRROR_VERSION: u16 = 1;
/// A gateway's pull of what it lacks of one task (specs/batch.md,
/// "Mirrors"; `processing::mirror`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MirrorPull {
    /// [`MIRROR_VERSION`].
    pub version: u16,
    /// The asking gateway (its peer id must be the request's sender).
    pub asker: gcs_protocol::NodeId,
    /// Task.
    pub task_id: String,
    /// Chunk ids whose input the asker lacks.
    pub inputs: Vec<String>,
    /// Chunk ids whose accepted output the asker lacks.
    pub outputs: Vec<String>,
    /// Whether the asker lacks the task's batch manifest
    /// (`processing::manifest`).
    #[serde(default)]
    pub manifest: bool,
}

/// What the asked gateway holds of them: encoded, signed records, inputs
/// first; a record past the budget (`processing::mirror::PULL_BUDGET`)
/// waits for the next pull.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct MirrorPage {
    /// Input chunks.
    pub inputs: Vec<serde_bytes::ByteBuf>,
    /// Output chunks (every lock's, the asker keeps what it accepts).
    pub outputs: Vec<serde_bytes::ByteBuf>,
    /// The task's batch manifest, when asked for and held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest: Option<serde_bytes::ByteBuf>,
}

/// The answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum JobResponse {
    /// Taken.
    Ack,
    /// A signed envelope in return (lease grant, claim rejection).
    Envelope(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The payload, to the lease holder.
    Payload(Box<LeasedPayload>),
    /// An encoded, signed input chunk, to a processing lock holder.
    Chunk(#[serde(with = "serde_bytes")] Vec<u8>),
    /// What a mirror pull asked for, as held here.
    Mirror(Box<MirrorPage>),
    /// Refused, with the reason.
    Refused(String),
}
