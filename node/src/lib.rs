//! The GCS node: identity, the libp2p network (gossip with application-level
//! validation), the registration registry and heartbeats. The `gcs-node`
//! binary wires these together.

pub mod backend;
pub mod engine_exec;
pub mod error;
pub mod identity;
pub mod jobs;
pub mod lifecycle;
pub mod network;
pub mod node;
pub mod registry;
pub mod replication;
pub mod scoring;
pub mod topics;

pub use error::NodeError;
pub use identity::Identity;
pub use network::{NetEvent, Network, NetworkConfig};
pub use node::{now_ms, start, NodeConfig, NodeHandle, Role};
