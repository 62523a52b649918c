//! Typed node errors.

use thiserror::Error;

/// What can stop a node from starting or serving.
#[derive(Debug, Error)]
pub enum NodeError {
    /// The data directory cannot be created or used.
    #[error("data directory {path}: {reason}")]
    DataDir {
        /// Directory.
        path: String,
        /// Why.
        reason: String,
    },
    /// The identity key file is unreadable or invalid.
    #[error("identity key {path}: {reason}")]
    Identity {
        /// File.
        path: String,
        /// Why.
        reason: String,
    },
    /// The keyspace failed.
    #[error(transparent)]
    Keyspace(#[from] gcs_keyspace::KeyspaceError),
    /// A protocol message could not be built.
    #[error(transparent)]
    Protocol(#[from] gcs_protocol::ProtocolError),
    /// The network could not start (bad address, port in use, ...).
    #[error("network: {0}")]
    Network(String),
    /// An idempotency key was reused with a different request body (HTTP 422).
    #[error("idempotency key already used for job {job_id} with a different request body")]
    IdempotencyConflict {
        /// The job the key belongs to.
        job_id: String,
    },
    /// The network event loop is gone.
    #[error("network event loop stopped")]
    NetworkStopped,
}
