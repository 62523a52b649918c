//! Typed keyspace errors.

use thiserror::Error;

/// Everything the keyspace can refuse or fail at.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KeyspaceError {
    /// RocksDB failed.
    #[error("rocksdb: {0}")]
    Db(String),
    /// The key is under no known namespace.
    #[error("key {0:?} is under no known namespace")]
    UnknownNamespace(String),
    /// The key is malformed.
    #[error("bad key {key:?}: {reason}")]
    BadKey {
        /// Key.
        key: String,
        /// Why.
        reason: &'static str,
    },
    /// A stored value could not be decoded.
    #[error("corrupt value at {key:?}: {reason}")]
    Corrupt {
        /// Key.
        key: String,
        /// Why.
        reason: String,
    },
    /// A delta from a peer could not be decoded.
    #[error("malformed delta: {0}")]
    MalformedDelta(String),
    /// A stored or wire format version this build cannot read.
    #[error("unsupported format version {0}")]
    UnsupportedFormat(u8),
    /// The value kind does not fit the namespace (register vs set).
    #[error("{key:?} holds a {expected}, not a {found}")]
    KindMismatch {
        /// Key.
        key: String,
        /// What the namespace holds.
        expected: &'static str,
        /// What arrived.
        found: &'static str,
    },
    /// A peer's logical clock counter is out of bounds.
    #[error("remote logical clock counter {0} is out of bounds")]
    ClockLogical(u32),
    /// The file system holding the keyspace is below its free-space
    /// reserve: writes are refused before the disk is actually full.
    #[error("only {free_bytes} bytes free, below the reserve of {reserve_bytes}")]
    NoSpace {
        /// Bytes available to this process.
        free_bytes: u64,
        /// `KeyspaceOptions::min_free_bytes`.
        reserve_bytes: u64,
    },
    /// A peer's clock is too far ahead.
    #[error("remote clock {remote_ms} ms is too far ahead of ours ({now_ms} ms)")]
    ClockDrift {
        /// Remote wall time.
        remote_ms: u64,
        /// Ours.
        now_ms: u64,
    },
}

impl From<rocksdb::Error> for KeyspaceError {
    fn from(e: rocksdb::Error) -> Self {
        KeyspaceError::Db(e.into_string())
    }
}
