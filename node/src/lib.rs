//! The GCS node runtime behind the `gcs-node` binary. Modules, from the
//! leaves up:
//!
//! - [`topics`]: the gossip topic table (names, what each carries, who joins).
//! - [`lifecycle`]: the job rules as sans-IO machines — the gateway's
//!   `JobTracker` (claims, fence, penalties) and the worker's `WorkerJob`
//!   with its admission `Slots`.
//! - [`models`]: the model catalogue (ids, aliases, files, context) as data.
//! - [`network`]: the libp2p swarm on one event loop (gossip with
//!   application-level validation, Kademlia, mDNS, the direct job and
//!   anti-entropy protocols), driven through a [`Network`] handle.
//! - `replication` (private): which peer deltas are merged, and anti-entropy.
//! - `registry` (private): the fresh registrations a gateway routes by.
//! - [`processing`]: the processing queue's sans-IO core (26.2, 26.22).
//! - [`tenants`]: tenant and swarm keys, membership certificates, trust.
//! - [`jobs`]: the async shells that run the lifecycle machines — the
//!   gateway side, the worker side, the job wire protocol, and the engine
//!   behind the [`jobs::executor::Executor`] trait.
//! - `backend` (private): [`NodeClient`], the node as the HTTP gateway's
//!   `gcs_gateway::Backend`.
//! - `node` (private): [`start`] builds everything and runs the runtime task.

mod backend;
mod error;
mod identity;
mod indexes;
pub mod jobs;
pub mod lifecycle;
pub mod models;
pub mod network;
pub mod processing;
pub mod quota;
mod node;
mod registry;
mod replication;
mod scoring;
pub mod tenants;
pub mod topics;

pub use backend::NodeClient;
pub use error::NodeError;
pub use gcs_protocol::now_ms;
pub use identity::Identity;
pub use network::{NetEvent, Network, NetworkConfig};
pub use node::{start, NodeConfig, NodeHandle, Role, DEFAULT_PROCESSING_JOBS};
