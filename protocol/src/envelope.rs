//! The signed-envelope machinery shared by every message type: message type
//! tags, versions, signing, verification and the decode pipeline.

use std::fmt;

use ciborium::value::Value;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::codec::{self, encode_value, from_value, map_get, map_remove, to_canonical_value};
use crate::crypto::{signing_digest, verify_digest, NodeId, NodeKey, Signature};
use crate::error::ProtocolError;

/// The version this build writes.
pub const PROTOCOL_VERSION: u16 = 1;
/// The oldest version this build decodes.
pub const MIN_SUPPORTED_VERSION: u16 = 1;

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
    QueueJob => "GCS_QUEUE_JOB",
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

fn digest_of<T: SignedMessage>(msg: &T, without_sig: &Value) -> Result<[u8; 32], ProtocolError> {
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

/// The version and type checks shared by every decode path.
fn check_header(v: &Value) -> Result<MessageType, ProtocolError> {
    let mt = match map_get(v, "message_type") {
        Some(Value::Text(t)) => t.as_str(),
        Some(_) => return Err(ProtocolError::Malformed("message_type is not text".into())),
        None => return Err(ProtocolError::Malformed("missing message_type".into())),
    };
    let ty = MessageType::parse(mt).ok_or_else(|| ProtocolError::UnknownMessageType(mt.into()))?;
    let version = match map_get(v, "version") {
        Some(Value::Integer(i)) => u64::try_from(*i)
            .map_err(|_| ProtocolError::Malformed("version is negative or too large".into()))?,
        Some(_) => return Err(ProtocolError::Malformed("version is not an integer".into())),
        None => return Err(ProtocolError::Malformed("missing version".into())),
    };
    if version < u64::from(MIN_SUPPORTED_VERSION) || version > u64::from(PROTOCOL_VERSION) {
        return Err(ProtocolError::UnsupportedVersion {
            message_type: mt.into(),
            version,
            min: MIN_SUPPORTED_VERSION,
            max: PROTOCOL_VERSION,
        });
    }
    Ok(ty)
}

/// Decodes a typed message from its value tree without verifying it. Returns
/// the message and the canonical value without the signature entry.
fn typed_from_value<T: SignedMessage>(mut v: Value) -> Result<(T, Value), ProtocolError> {
    codec::canonicalize(&mut v);
    let ty = check_header(&v)?;
    if ty != T::TYPE {
        return Err(ProtocolError::WrongMessageType {
            expected: T::TYPE.as_str(),
            found: ty.as_str().into(),
        });
    }
    let sig = map_remove(&mut v, "signature");
    let mut msg: T = from_value(&v)?;
    let sig = match sig {
        None | Some(Value::Null) => None,
        Some(s) => Some(from_value::<Signature>(&s)?),
    };
    msg.set_signature(sig);
    Ok((msg, v))
}

/// Full check of one typed message: fields, signature, clock.
fn check_typed<T: SignedMessage>(
    msg: &T,
    without_sig: &Value,
    now_ms: u64,
    limits: &Limits,
) -> Result<(), ProtocolError> {
    msg.check_fields(limits)?;
    let sig = msg.signature().ok_or(ProtocolError::MissingSignature)?;
    verify_digest(msg.signer(), &digest_of(msg, without_sig)?, sig)?;
    check_clock(msg.created_at_ms(), msg.expires_at_ms(), now_ms, limits)
}

/// Clock rules: nothing from further ahead than the skew, nothing past its
/// expiry by more than the skew.
pub fn check_clock(
    created_at_ms: u64,
    expires_at_ms: Option<u64>,
    now_ms: u64,
    limits: &Limits,
) -> Result<(), ProtocolError> {
    if created_at_ms > now_ms.saturating_add(limits.max_clock_skew_ms) {
        return Err(ProtocolError::FromFuture {
            created_at_ms,
            now_ms,
            skew_ms: limits.max_clock_skew_ms,
        });
    }
    if let Some(exp) = expires_at_ms {
        if now_ms > exp.saturating_add(limits.max_clock_skew_ms) {
            return Err(ProtocolError::Expired { expires_at_ms: exp, now_ms });
        }
    }
    Ok(())
}

/// Decodes and fully validates one message of a known type from bytes.
pub fn open_as<T: SignedMessage>(
    bytes: &[u8],
    now_ms: u64,
    limits: &Limits,
) -> Result<T, ProtocolError> {
    check_size(bytes, limits)?;
    let (msg, v) = typed_from_value::<T>(codec::decode_value(bytes)?)?;
    check_typed(&msg, &v, now_ms, limits)?;
    Ok(msg)
}

fn check_size(bytes: &[u8], limits: &Limits) -> Result<(), ProtocolError> {
    if bytes.len() > limits.max_message_bytes {
        return Err(ProtocolError::TooLarge { size: bytes.len(), max: limits.max_message_bytes });
    }
    Ok(())
}

macro_rules! message_enum {
    ($($variant:ident($ty:ty)),* $(,)?) => {
        /// Any signed GCS message.
        // Variants are sized like the messages; boxing would cost an
        // allocation per decode on the gossip hot path for no benefit.
        #[allow(clippy::large_enum_variant)]
        #[derive(Clone, Debug, PartialEq)]
        pub enum Message {
            $(
                #[doc = concat!("A `", stringify!($ty), "`.")]
                $variant($ty),
            )*
        }

        impl Message {
            /// Its message type.
            pub fn message_type(&self) -> MessageType {
                match self { $(Message::$variant(_) => <$ty as SignedMessage>::TYPE),* }
            }
            /// The node that signed it.
            pub fn signer(&self) -> &NodeId {
                match self { $(Message::$variant(m) => m.signer()),* }
            }
            /// Canonical bytes.
            pub fn encode(&self) -> Result<Vec<u8>, ProtocolError> {
                match self { $(Message::$variant(m) => encode(m)),* }
            }
            /// Signs it in place.
            pub fn sign(&mut self, key: &NodeKey) -> Result<(), ProtocolError> {
                match self { $(Message::$variant(m) => sign(m, key)),* }
            }
            /// Verifies its signature.
            pub fn verify(&self) -> Result<(), ProtocolError> {
                match self { $(Message::$variant(m) => verify(m)),* }
            }
        }

        $(
            impl From<$ty> for Message {
                fn from(m: $ty) -> Self { Message::$variant(m) }
            }
        )*

        /// Decodes and fully validates any message: size, CBOR, type, version,
        /// field bounds, signature, clock. The one entry point for bytes that
        /// arrive from the network.
        pub fn open(bytes: &[u8], now_ms: u64, limits: &Limits) -> Result<Message, ProtocolError> {
            check_size(bytes, limits)?;
            let v = codec::decode_value(bytes)?;
            match check_header(&v)? {
                $(
                    <$ty as SignedMessage>::TYPE => {
                        let (m, without) = typed_from_value::<$ty>(v)?;
                        check_typed(&m, &without, now_ms, limits)?;
                        Ok(Message::$variant(m))
                    }
                )*
                other => Err(ProtocolError::UnknownMessageType(other.as_str().into())),
            }
        }

        /// Decodes any message without checking signature or clock (for
        /// stored records that were validated when they arrived).
        pub fn decode(bytes: &[u8], limits: &Limits) -> Result<Message, ProtocolError> {
            check_size(bytes, limits)?;
            let v = codec::decode_value(bytes)?;
            match check_header(&v)? {
                $(
                    <$ty as SignedMessage>::TYPE => {
                        Ok(Message::$variant(typed_from_value::<$ty>(v)?.0))
                    }
                )*
                other => Err(ProtocolError::UnknownMessageType(other.as_str().into())),
            }
        }
    };
}

use crate::messages::*;

message_enum! {
    NodeRegistration(NodeRegistration),
    ApiRequestJob(ApiRequestJob),
    JobClaim(JobClaim),
    ClaimRejection(ClaimRejection),
    LeaseGrant(LeaseGrant),
    LeaseRenewal(LeaseRenewal),
    StreamChunk(StreamChunk),
    FinalResult(FinalResult),
    UsageRecord(UsageRecord),
    Cancellation(Cancellation),
    Requeue(Requeue),
    TaskLock(TaskLock),
    TaskResult(TaskResult),
}

/// Implements the boilerplate half of [`SignedMessage`] for a struct with
/// `message_type`, `version`, `signature`, `created_at_ms` fields.
macro_rules! impl_signed_common {
    () => {
        fn message_type(&self) -> $crate::envelope::MessageType {
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
