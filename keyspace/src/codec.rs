//! Stored and wire forms. Every stored value and every delta starts with a
//! one-byte format version, then canonical CBOR, so the same state is the
//! same bytes on every replica (digests depend on it) and a future format can
//! be told apart from this one.

use serde::{Deserialize, Serialize};

use crate::crdt::CrdtValue;
use crate::error::KeyspaceError;

/// Format version of stored values and deltas.
pub const FORMAT_VERSION: u8 = 1;
/// Largest delta accepted from a peer.
pub const MAX_DELTA_BYTES: usize = 4 * 1024 * 1024;

/// Encodes a value for storage.
pub fn encode_value(v: &CrdtValue) -> Vec<u8> {
    let mut out = vec![FORMAT_VERSION];
    // CrdtValue has only string keys, integers and byte strings: it always encodes.
    out.extend(gcs_protocol::codec::to_canonical_bytes(v).unwrap_or_default());
    out
}

/// Decodes a stored value.
pub fn decode_value(key: &str, bytes: &[u8]) -> Result<CrdtValue, KeyspaceError> {
    let corrupt = |reason: String| KeyspaceError::Corrupt { key: key.into(), reason };
    match bytes.first() {
        None => Err(corrupt("empty".into())),
        Some(&FORMAT_VERSION) => {
            gcs_protocol::codec::from_cbor_bytes(&bytes[1..]).map_err(|e| corrupt(e.to_string()))
        }
        Some(&v) => Err(KeyspaceError::UnsupportedFormat(v)),
    }
}

/// One replicated change: the full state of one key (state-based CRDT, so a
/// delta is idempotent and order-free).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delta {
    /// The key.
    pub key: String,
    /// Its state.
    pub value: CrdtValue,
}

impl Delta {
    /// Wire bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![FORMAT_VERSION];
        out.extend(gcs_protocol::codec::to_canonical_bytes(self).unwrap_or_default());
        out
    }
    /// Parses wire bytes; never panics on garbage.
    pub fn decode(bytes: &[u8]) -> Result<Delta, KeyspaceError> {
        if bytes.len() > MAX_DELTA_BYTES {
            return Err(KeyspaceError::MalformedDelta(format!(
                "{} bytes is too large",
                bytes.len()
            )));
        }
        match bytes.first() {
            None => Err(KeyspaceError::MalformedDelta("empty".into())),
            Some(&FORMAT_VERSION) => gcs_protocol::codec::from_cbor_bytes(&bytes[1..])
                .map_err(|e| KeyspaceError::MalformedDelta(e.to_string())),
            Some(&v) => Err(KeyspaceError::UnsupportedFormat(v)),
        }
    }
}
