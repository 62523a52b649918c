//! The decode pipeline shared by every message type (size, encoding, type,
//! version, bounds, signature, clock) and the [`Message`] enum over them.

use ciborium::value::Value;

use crate::codec::{self, from_value, map_get, map_remove};
use crate::crypto::{verify_digest, NodeId, NodeKey, Signature};
use crate::error::ProtocolError;
use crate::signed::digest_of;
pub use crate::signed::{
    encode, sign, verify, Limits, MessageType, SignedMessage, MIN_SUPPORTED_VERSION,
    PROTOCOL_VERSION,
};

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
    let max = crate::signed::max_version(ty);
    if version < u64::from(MIN_SUPPORTED_VERSION) || version > u64::from(max) {
        return Err(ProtocolError::UnsupportedVersion {
            message_type: mt.into(),
            version,
            min: MIN_SUPPORTED_VERSION,
            max,
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
    MembershipCertificate(MembershipCertificate),
    MembershipRevocation(MembershipRevocation),
}
