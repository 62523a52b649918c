//! The GCS keyspace (26.12.3, 26.23): a replicated CRDT key-value store on
//! RocksDB, one per node.
//!
//! Every key holds a CRDT — a last-writer-wins [`Register`] ordered by a
//! hybrid logical clock plus writer id, or an add-wins [`AwSet`] — so
//! replicas converge whatever order deltas arrive in. A local write is the
//! merge of a delta; the returned [`Delta`] is what the network layer
//! replicates. See `specs/keyspace.md`.

pub mod codec;
pub mod crdt;
pub mod error;
pub mod hlc;
pub mod namespace;
pub mod store;

#[cfg(test)]
mod tests;

pub use codec::{Delta, FORMAT_VERSION};
pub use crdt::{AwSet, CrdtValue, Marker, Register};
pub use error::KeyspaceError;
pub use hlc::{check_remote, Hlc, HlcClock, MAX_LOGICAL};
pub use namespace::{keys, Namespace, Scope, ValueKind, USAGE_RETENTION_MS};
pub use store::{
    COMPACT_BATCH, CfMemory, MemoryUsage,
    Change, CompactStats, Digest, Keyspace, KeyspaceOptions, MergeOutcome, Since, WatchError,
    Watcher,
};
