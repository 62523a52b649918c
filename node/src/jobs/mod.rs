//! Jobs over the network: the gateway side (submit, claims, fenced streams,
//! usage) and the worker side (claim, fetch payload, execute, stream,
//! renew, honour cancellation), wired to the sans-IO rules in `lifecycle`.
//! The worker runs jobs through an [`executor::Executor`]; the real one is
//! [`engine_exec::EngineExecutor`].

pub mod announce;
pub mod continuations;
pub mod engine_exec;
pub mod executor;
pub(crate) mod gateway;
pub(crate) mod parent;
pub mod sealed;
pub mod wire;
pub(crate) mod worker;

pub use gcs_gateway::backend::{JobEvent, JobSpec};
use gcs_protocol::NodeId;
use libp2p::PeerId;

/// The libp2p peer id of a GCS node id (same key).
pub fn peer_of(node: &NodeId) -> Option<PeerId> {
    let pk = libp2p::identity::ed25519::PublicKey::try_from_bytes(&node.public_key().0).ok()?;
    Some(libp2p::identity::PublicKey::from(pk).to_peer_id())
}
