//! What every signed message type shares, below the messages themselves:
//! message type tags, versions, size limits, the [`SignedMessage`] trait,
//! signing and verification. `envelope` builds the decode pipeline and the
//! [`crate::envelope::Message`] enum over the message types on top of it.

use std::fmt;

use ciborium::value::Value;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::codec::{self, encode_value, map_remove, to_canonical_value};
use crate::crypto::{signing_digest, verify_digest, NodeId, NodeKey, Signature};
use crate::error::ProtocolError;

/// The version this build writes.
pub const PROTOCOL_VERSION: u16 = 1;
/// The oldest version this build decodes.
pub const MIN_SUPPORTED_VERSION: u16 = 1;
/// The `GCS_API_REQUEST_JOB` format this build writes: 2 since an
/// announcement carries no project or API key id (absent on the wire) and
/// an opaque idempotency token (26.20.4); version 1 jobs still decode.
pub const API_JOB_VERSION: u16 = 2;

/// The newest version of `ty` this build decodes.
pub fn max_version(ty: MessageType) -> u16 {
    match ty {
        MessageType::ApiRequestJob => API_JOB_VERSION,
        _ => PROTOCOL_VERSION,
    }
}

macro_rules! message_types {
    ($($variant:ident => $tag:literal),* $(,)?) => {
        /// The `message_type` field of every envelope.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub enum MessageType {
            $(
                #[doc = $tag]
                #[serde(rename = $tag)]
                $variant,
            )*
        }
        impl MessageType {
            /// Every message type.
            pub const ALL: &'static [MessageType] = &[$(MessageType::$variant),*];
            /// The wire name, e.g. `GCS_NODE_REGISTRATION`.
            pub fn as_str(self) -> &'static str {
                match self { $(MessageType::$variant => $tag),* }
            }
            /// Parses a wire name.
            pub fn parse(s: &str) -> Option<Self> {
                match s { $($tag => Some(MessageType::$variant),)* _ => None }
            }
            /// The signature domain tag: `GCS/v1/<message_type>`.
            pub fn domain_tag(self) -> &'static str {
                match self { $(MessageType::$variant => concat!("GCS/v1/", $tag)),* }
            }
        }
    };
}

message_types! {
    NodeRegistration => "GCS_NODE_REGISTRATION",
    ApiRequestJob => "GCS_API_REQUEST_JOB",
    JobClaim => "GCS_API_JOB_CLAIM",
    ClaimRejection => "GCS_API_CLAIM_REJECTION",
    LeaseGrant => "GCS_API_JOB_LEASE",
    LeaseRenewal => "GCS_API_LEASE_RENEWAL",
    StreamChunk => "GCS_API_STREAM_CHUNK",
    FinalResult => "GCS_API_FINAL_RESULT",
    UsageRecord => "GCS_API_USAGE_RECORD",
    Cancellation => "GCS_API_CANCELLATION",
    Requeue => "GCS_API_JOB_REQUEUE",
    TaskLock => "GCS_PROCESSING_TASK_LOCK",
    TaskResult => "GCS_PROCESSING_TASK_RESULT",
    TaskRelease => "GCS_PROCESSING_TASK_RELEASE",
    TaskCancel => "GCS_PROCESSING_TASK_CANCEL",
    QueueJob => "GCS_QUEUE_JOB",
    MembershipCertificate => "GCS_MEMBERSHIP_CERTIFICATE",
    MembershipRevocation => "GCS_MEMBERSHIP_REVOCATION",
}

impl fmt::Display for MessageType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Receiver-side bounds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest encoded message accepted (gossip's transmit cap by default).
    pub max_message_bytes: usize,
    /// How far a sender's clock may be ahead of, or an expiry behind, ours.
    pub max_clock_skew_ms: u64,
    /// Longest registration lifetime accepted (26.10.2: short-lived).
    pub max_registration_ttl_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_message_bytes: 64 * 1024,
            max_clock_skew_ms: 5_000,
            max_registration_ttl_ms: 120_000,
        }
    }
}

/// A signed GCS message.
pub trait SignedMessage: Serialize + DeserializeOwned + Clone + fmt::Debug {
    /// Its `message_type`.
    const TYPE: MessageType;
    /// The node whose key signs it.
    fn signer(&self) -> &NodeId;
    /// The `message_type` field as carried.
    fn message_type(&self) -> MessageType;
    /// The `version` field as carried.
    fn version(&self) -> u16;
    /// The signature, if signed.
    fn signature(&self) -> Option<&Signature>;
    /// Sets the signature.
    fn set_signature(&mut self, sig: Option<Signature>);
    /// Creation time (ms since the Unix epoch).
    fn created_at_ms(&self) -> u64;
    /// Expiry, if the message has one.
    fn expires_at_ms(&self) -> Option<u64> {
        None
    }
    /// Field bounds and internal consistency (no clock, no signature).
    fn check_fields(&self, limits: &Limits) -> Result<(), ProtocolError>;
    /// The bytes the signature covers, given the canonical value of the
    /// message without its `signature` entry. By default that value's
    /// encoding, so fields this build does not know are still covered.
    fn signing_payload(&self, without_signature: &Value) -> Result<Vec<u8>, ProtocolError> {
        Ok(encode_value(without_signature))
    }
}

fn canonical_without_signature<T: Serialize>(msg: &T) -> Result<Value, ProtocolError> {
    let mut v = to_canonical_value(msg)?;
    map_remove(&mut v, "signature");
    Ok(v)
}

pub(crate) fn digest_of<T: SignedMessage>(msg: &T, without_sig: &Value) -> Result<[u8; 32], ProtocolError> {
    Ok(signing_digest(T::TYPE.domain_tag(), &msg.signing_payload(without_sig)?))
}

/// Signs `msg` with `key`; the key must be the message's signer.
pub fn sign<T: SignedMessage>(msg: &mut T, key: &NodeKey) -> Result<(), ProtocolError> {
    if &key.node_id() != msg.signer() {
        return Err(ProtocolError::field(
            "signer",
            "signing key does not match the signer node id",
        ));
    }
    let v = canonical_without_signature(msg)?;
    let sig = key.sign_digest(&digest_of(msg, &v)?);
    msg.set_signature(Some(sig));
    Ok(())
}

/// Verifies the signature of a typed message.
pub fn verify<T: SignedMessage>(msg: &T) -> Result<(), ProtocolError> {
    let sig = msg.signature().ok_or(ProtocolError::MissingSignature)?;
    let v = canonical_without_signature(msg)?;
    verify_digest(msg.signer(), &digest_of(msg, &v)?, sig)
}

/// Canonical CBOR bytes of a message, signature included.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtocolError> {
    codec::to_canonical_bytes(msg)
}

/// Implements the boilerplate half of [`SignedMessage`] for a struct with
/// `message_type`, `version`, `signature`, `created_at_ms` fields.
macro_rules! impl_signed_common {
    () => {
        fn message_type(&self) -> $crate::signed::MessageType {
            self.message_type
        }
        fn version(&self) -> u16 {
            self.version
        }
        fn signature(&self) -> Option<&$crate::crypto::Signature> {
            self.signature.as_ref()
        }
        fn set_signature(&mut self, sig: Option<$crate::crypto::Signature>) {
            self.signature = sig;
        }
    };
}
pub(crate) use impl_signed_common;
