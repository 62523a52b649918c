//! Typed protocol errors.

use thiserror::Error;

/// Everything that can be wrong with a message, from bytes to semantics.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ProtocolError {
    /// The encoded message is larger than the configured cap.
    #[error("message is {size} bytes, over the {max}-byte limit")]
    TooLarge {
        /// Encoded size.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// Not valid CBOR / JSON, or a field has the wrong shape.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// `message_type` names no message this node knows.
    #[error("unknown message type {0:?}")]
    UnknownMessageType(String),
    /// A version this node cannot decode (see specs/protocol.md, "Versions").
    #[error("{message_type} version {version} is not supported (supported: {min}..={max})")]
    UnsupportedVersion {
        /// Message type.
        message_type: String,
        /// Version found.
        version: u64,
        /// Oldest supported.
        min: u16,
        /// Newest supported.
        max: u16,
    },
    /// The message type field disagrees with the type being decoded.
    #[error("expected {expected}, found {found}")]
    WrongMessageType {
        /// Expected type.
        expected: &'static str,
        /// Found type.
        found: String,
    },
    /// A field is out of bounds or badly formed.
    #[error("field `{field}`: {reason}")]
    Field {
        /// Field path, e.g. `heartbeat.ttl_ms`.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A node id that is not `gnusnode_` + 64 hex digits of a valid key.
    #[error("invalid node id {0:?}")]
    BadNodeId(String),
    /// The message carries no signature.
    #[error("message is not signed")]
    MissingSignature,
    /// The signature does not verify against the signer's key.
    #[error("signature does not verify")]
    BadSignature,
    /// The message expired (beyond the allowed clock skew).
    #[error("expired at {expires_at_ms} ms, now {now_ms} ms")]
    Expired {
        /// Expiry.
        expires_at_ms: u64,
        /// Receiver's clock.
        now_ms: u64,
    },
    /// Created further in the future than the allowed clock skew.
    #[error("created at {created_at_ms} ms, more than {skew_ms} ms ahead of now ({now_ms} ms)")]
    FromFuture {
        /// Creation time.
        created_at_ms: u64,
        /// Receiver's clock.
        now_ms: u64,
        /// Allowed skew.
        skew_ms: u64,
    },
    /// Encoding failed (only for values serde cannot represent).
    #[error("encode: {0}")]
    Encode(String),
    /// The OS random source failed.
    #[error("random source: {0}")]
    Random(String),
}

impl ProtocolError {
    /// Whether a peer that sent this should be penalised. Expired, future-dated
    /// and newer-version messages can come from honest peers (clock drift,
    /// upgrades), so gossip *ignores* them; everything else is *rejected*.
    pub fn is_penalisable(&self) -> bool {
        !matches!(
            self,
            ProtocolError::Expired { .. }
                | ProtocolError::FromFuture { .. }
                | ProtocolError::UnsupportedVersion { .. }
                | ProtocolError::Random(_)
                | ProtocolError::Encode(_)
        )
    }

    pub(crate) fn field(field: &'static str, reason: impl Into<String>) -> Self {
        ProtocolError::Field { field, reason: reason.into() }
    }
}
