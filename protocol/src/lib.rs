//! GCS wire protocol: the typed messages of the specification, their
//! canonical CBOR form, ed25519 signatures over blake3 digests, and
//! validation with typed errors.
//!
//! Bytes from the network go through [`open`] (or [`open_as`]), which checks
//! size, encoding, type, version, field bounds, signature and clock in that
//! order. Locally built messages are signed with [`sign`] and encoded with
//! [`encode`]. See `specs/protocol.md` for the rules and `specs/vectors/` for
//! test vectors.

pub mod clock;
pub mod codec;
pub mod crypto;
pub mod envelope;
pub mod error;
pub mod ids;
pub mod messages;
pub mod samples;
pub mod seal;
pub mod signed;
pub mod validate;

pub use clock::now_ms;
pub use crypto::{signing_digest, Hash32, NodeId, NodeKey, PublicKey, Signature};
pub use envelope::{
    check_clock, decode, encode, open, open_as, sign, verify, Limits, Message, MessageType,
    SignedMessage, MIN_SUPPORTED_VERSION, PROTOCOL_VERSION,
};
pub use signed::{max_version, API_JOB_VERSION};
pub use error::ProtocolError;
pub use messages::*;
