//! Jobs over the network: the gateway side (submit, claims, fenced streams,
//! usage) and the worker side (claim, fetch payload, execute, stream,
//! renew, honour cancellation), wired to the sans-IO rules in `lifecycle`.

pub mod executor;
pub mod gateway;
pub mod wire;
pub mod worker;

use gcs_protocol::{ApiType, ErrorInfo, FinalResult, JobLimits, NodeId, StreamChunk};
use libp2p::PeerId;

/// What a client of the gateway asks for.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// API surface.
    pub api_type: ApiType,
    /// Model or alias.
    pub model: String,
    /// Whether the client streams.
    pub stream: bool,
    /// The OpenAI request body (JSON bytes).
    pub body: Vec<u8>,
    /// Tenant.
    pub tenant_id: String,
    /// Project.
    pub project_id: String,
    /// API key id.
    pub api_key_id: String,
    /// Client idempotency key (or a request hash).
    pub idempotency_key: String,
    /// Timeouts.
    pub limits: JobLimits,
    /// Requested output budget.
    pub max_output_tokens: u32,
}

/// What the gateway tells the client, in order.
#[derive(Clone, Debug)]
pub enum JobEvent {
    /// A worker won the job (first grant or after a requeue).
    Leased {
        /// The lease holder.
        node_id: NodeId,
    },
    /// The next fenced chunk.
    Chunk(Box<StreamChunk>),
    /// Finished.
    Completed(Box<FinalResult>),
    /// Failed; `after_partial_output` says whether chunks were already sent.
    Failed {
        /// OpenAI-shaped error.
        error: ErrorInfo,
        /// Whether chunks were already sent.
        after_partial_output: bool,
    },
    /// Cancelled at the client's request.
    Cancelled,
}

/// The libp2p peer id of a GCS node id (same key).
pub fn peer_of(node: &NodeId) -> Option<PeerId> {
    let pk = libp2p::identity::ed25519::PublicKey::try_from_bytes(&node.public_key().0).ok()?;
    Some(libp2p::identity::PublicKey::from(pk).to_peer_id())
}
