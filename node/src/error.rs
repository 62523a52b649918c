//! Typed node errors. Each has a kind ([`NodeError::error_type`]) that logs
//! and metrics use as a label, as TGI's router does.

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
    /// A protocol message could not be built or opened.
    #[error(transparent)]
    Protocol(#[from] gcs_protocol::ProtocolError),
    /// A listen address cannot be bound.
    #[error("network: listen on {addr}: {reason}")]
    Listen {
        /// Address.
        addr: String,
        /// Why.
        reason: String,
    },
    /// A peer address cannot be dialled.
    #[error("network: dial {addr}: {reason}")]
    Dial {
        /// Address.
        addr: String,
        /// Why.
        reason: String,
    },
    /// The libp2p transport or behaviour could not be built.
    #[error("network: {0}")]
    Transport(String),
    /// A gossip topic operation failed.
    #[error("network: {op}: {reason}")]
    Gossip {
        /// `subscribe` or `publish`.
        op: &'static str,
        /// Why.
        reason: String,
    },
    /// A direct request to a peer failed (timeout, connection closed, ...).
    #[error("network: request to {peer}: {reason}")]
    Request {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
    /// A node id that is no valid libp2p peer id.
    #[error("node id {0} names no libp2p peer")]
    BadNodeId(String),
    /// A gateway request reached a node without the gateway role.
    #[error("this node has no gateway role")]
    NotAGateway,
    /// An idempotency key was reused with a different request body (HTTP 422).
    #[error("idempotency key already used for job {job_id} with a different request body")]
    IdempotencyConflict {
        /// The job the key belongs to.
        job_id: String,
    },
    /// The network event loop is gone.
    #[error("network event loop stopped")]
    NetworkStopped,
    /// A sealed payload could not be made or opened.
    #[error(transparent)]
    Seal(#[from] gcs_protocol::seal::SealError),
    /// No node may win this job now (a pinning tenant's private job with
    /// no pinned node online): HTTP 503 `gnus_no_capable_nodes`.
    #[error("{0}")]
    NoCapableNodes(String),
}

impl NodeError {
    /// A short stable label for logs and metrics.
    pub fn error_type(&self) -> &'static str {
        match self {
            NodeError::DataDir { .. } => "data_dir",
            NodeError::Identity { .. } => "identity",
            NodeError::Keyspace(_) => "keyspace",
            NodeError::Protocol(_) => "protocol",
            NodeError::Listen { .. } => "listen",
            NodeError::Dial { .. } => "dial",
            NodeError::Transport(_) => "transport",
            NodeError::Gossip { .. } => "gossip",
            NodeError::Request { .. } => "request",
            NodeError::BadNodeId(_) => "bad_node_id",
            NodeError::NotAGateway => "not_a_gateway",
            NodeError::IdempotencyConflict { .. } => "idempotency_conflict",
            NodeError::NetworkStopped => "network_stopped",
            NodeError::Seal(_) => "seal",
            NodeError::NoCapableNodes(_) => "no_capable_nodes",
        }
    }
}

/// Why a peer's delta was not merged.
#[derive(Debug, thiserror::Error)]
pub enum RefusedDelta {
    /// Undecodable, an unknown namespace, or the store failed.
    #[error(transparent)]
    Keyspace(#[from] gcs_keyspace::KeyspaceError),
    /// The value is not a valid signed envelope.
    #[error(transparent)]
    Envelope(#[from] gcs_protocol::ProtocolError),
    /// A namespace that never leaves its scope.
    #[error("{0} is not replicated network-wide")]
    NotGlobal(&'static str),
    /// A usage tombstone.
    #[error("a usage record is never deleted")]
    UsageDeleted,
    /// A usage key holding another message.
    #[error("not a usage record")]
    NotUsage,
    /// A valid envelope filed under another record's key.
    #[error("{message_type} for {id} filed under {key}")]
    Misfiled {
        /// The envelope's type.
        message_type: gcs_protocol::MessageType,
        /// The id it names.
        id: String,
        /// The key it came under.
        key: String,
    },
    /// Usage of a tenant this gateway does not serve.
    #[error("this node does not serve tenant {0:?}")]
    TenantNotServed(String),
    /// A namespace peers may not write.
    #[error("{0} is not accepted from peers")]
    NotFromPeers(&'static str),
    /// A deletion: peers never delete records.
    #[error("a tombstone from a peer")]
    Tombstone,
    /// An envelope of another type than its namespace holds.
    #[error("a {found} where a {expected} belongs")]
    WrongType {
        /// What the namespace holds.
        expected: gcs_protocol::MessageType,
        /// What came.
        found: gcs_protocol::MessageType,
    },
    /// A set over its cap.
    #[error("more than {0} elements")]
    TooMany(usize),
    /// Signed by someone without authority over the record.
    #[error("{0}: signed by a node without authority over the record")]
    NotTheAuthor(&'static str),
    /// Usage of a tenant whose key this node does not hold.
    #[error("no membership key trusted for tenant {0:?}")]
    TenantUntrusted(String),
    /// Usage signed by a gateway the tenant has not admitted.
    #[error("{0} holds no live tenant-gateway certificate of the record's tenant")]
    GatewayNotAdmitted(String),
    /// Usage filed under another tenant than its API key's.
    #[error("API key {0} belongs to another tenant")]
    ForeignKey(String),
    /// A processing record the queue state replayed here refuses: a lock
    /// on a subtask already done or held, a late copy of a released lock,
    /// a release of a lock no longer live, a result whose lock has not
    /// reached this node, a record of a task not here yet. Honest replicas
    /// race into these, so a gossiped one is dropped, not penalised (the
    /// peer that forwarded it, or wrote it from a view a moment old, did
    /// nothing wrong); its bytes still count against its author's quota.
    #[error("{0} (stale here)")]
    Stale(gcs_protocol::ProtocolError),
}
