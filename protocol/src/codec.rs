//! Canonical CBOR.
//!
//! The canonical form is RFC 8949 §4.2.1 core deterministic encoding as
//! ciborium produces it (shortest integer and length heads, definite
//! lengths), with every map's entries sorted by the bytewise order of their
//! encoded keys. Sorting makes the bytes independent of struct field order, so
//! another implementation that emits fields in a different order still
//! produces (and verifies) the same bytes.

use ciborium::value::Value;
use serde::{de::DeserializeOwned, Serialize};

use crate::error::ProtocolError;

/// Recursively sorts map entries by their encoded keys.
pub fn canonicalize(v: &mut Value) {
    match v {
        Value::Map(entries) => {
            for (k, val) in entries.iter_mut() {
                canonicalize(k);
                canonicalize(val);
            }
            let mut keyed: Vec<(Vec<u8>, (Value, Value))> = std::mem::take(entries)
                .into_iter()
                .map(|(k, val)| (encode_value(&k), (k, val)))
                .collect();
            keyed.sort_by(|a, b| a.0.cmp(&b.0));
            *entries = keyed.into_iter().map(|(_, kv)| kv).collect();
        }
        Value::Array(items) => items.iter_mut().for_each(canonicalize),
        Value::Tag(_, inner) => canonicalize(inner),
        _ => {}
    }
}

/// Encodes a value as it stands (no sorting).
pub fn encode_value(v: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    // Writing into a Vec cannot fail.
    let _ = ciborium::ser::into_writer(v, &mut out);
    out
}

/// Serialises `t` to a canonical CBOR value tree.
pub fn to_canonical_value<T: Serialize + ?Sized>(t: &T) -> Result<Value, ProtocolError> {
    let mut v = Value::serialized(t).map_err(|e| ProtocolError::Encode(e.to_string()))?;
    canonicalize(&mut v);
    Ok(v)
}

/// Canonical CBOR bytes of `t`: the same value always gives the same bytes.
pub fn to_canonical_bytes<T: Serialize + ?Sized>(t: &T) -> Result<Vec<u8>, ProtocolError> {
    Ok(encode_value(&to_canonical_value(t)?))
}

/// Decodes CBOR bytes into a value tree; any byte string gives a value or a
/// typed error, never a panic.
pub fn decode_value(bytes: &[u8]) -> Result<Value, ProtocolError> {
    let v: Value = ciborium::de::from_reader(bytes)
        .map_err(|e| ProtocolError::Malformed(format!("cbor: {e}")))?;
    Ok(v)
}

/// Deserialises a typed value out of a value tree.
pub fn from_value<T: DeserializeOwned>(v: &Value) -> Result<T, ProtocolError> {
    v.deserialized().map_err(|e| ProtocolError::Malformed(e.to_string()))
}

/// Decodes canonical (or any valid) CBOR bytes into `T`.
pub fn from_cbor_bytes<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ProtocolError> {
    from_value(&decode_value(bytes)?)
}

/// Looks up a text key in a CBOR map.
pub fn map_get<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    match v {
        Value::Map(entries) => {
            entries.iter().find(|(k, _)| matches!(k, Value::Text(t) if t == key)).map(|(_, v)| v)
        }
        _ => None,
    }
}

/// Removes a text key from a CBOR map, returning its value.
pub fn map_remove(v: &mut Value, key: &str) -> Option<Value> {
    match v {
        Value::Map(entries) => {
            let idx = entries.iter().position(|(k, _)| matches!(k, Value::Text(t) if t == key))?;
            Some(entries.remove(idx).1)
        }
        _ => None,
    }
}
