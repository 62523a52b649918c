//! Field-bound helpers used by every message's `check_fields`.

use crate::signed::{MessageType, MIN_SUPPORTED_VERSION};
use crate::error::ProtocolError;

/// Longest free-form short string (ids, names, codes).
pub const MAX_SHORT: usize = 128;
/// Longest human-readable text (error messages, reasons).
pub const MAX_TEXT: usize = 4096;
/// Most entries in a list field (models, aliases, nodes).
pub const MAX_LIST: usize = 64;
/// Longest stream delta text.
pub const MAX_DELTA: usize = 16 * 1024;

/// `message_type` and `version` of a locally built message.
pub fn header(ty: MessageType, expected: MessageType, version: u16) -> Result<(), ProtocolError> {
    if ty != expected {
        return Err(ProtocolError::WrongMessageType {
            expected: expected.as_str(),
            found: ty.as_str().into(),
        });
    }
    let max = crate::signed::max_version(expected);
    if !(MIN_SUPPORTED_VERSION..=max).contains(&version) {
        return Err(ProtocolError::UnsupportedVersion {
            message_type: ty.as_str().into(),
            version: version.into(),
            min: MIN_SUPPORTED_VERSION,
            max,
        });
    }
    Ok(())
}

/// A non-empty string of at most `max` bytes without control characters.
pub fn short(field: &'static str, s: &str, max: usize) -> Result<(), ProtocolError> {
    if s.is_empty() {
        return Err(ProtocolError::field(field, "must not be empty"));
    }
    text(field, s, max)?;
    if s.chars().any(char::is_control) {
        return Err(ProtocolError::field(field, "must not contain control characters"));
    }
    Ok(())
}

/// A string of at most `max` bytes.
pub fn text(field: &'static str, s: &str, max: usize) -> Result<(), ProtocolError> {
    if s.len() > max {
        return Err(ProtocolError::field(field, format!("longer than {max} bytes")));
    }
    Ok(())
}

/// A list of at most `max` entries.
pub fn list<T>(field: &'static str, l: &[T], max: usize) -> Result<(), ProtocolError> {
    if l.len() > max {
        return Err(ProtocolError::field(field, format!("more than {max} entries")));
    }
    Ok(())
}

/// `lo <= v <= hi`.
pub fn range<T: PartialOrd + std::fmt::Display>(
    field: &'static str,
    v: T,
    lo: T,
    hi: T,
) -> Result<(), ProtocolError> {
    if v < lo || v > hi {
        return Err(ProtocolError::field(field, format!("{v} is outside {lo}..={hi}")));
    }
    Ok(())
}

/// `created < expires` and the lifetime is at most `max_ttl`.
pub fn lifetime(
    field: &'static str,
    created: u64,
    expires: u64,
    max_ttl: u64,
) -> Result<(), ProtocolError> {
    if expires <= created {
        return Err(ProtocolError::field(field, "expires before it is created"));
    }
    if expires - created > max_ttl {
        return Err(ProtocolError::field(field, format!("lifetime over {max_ttl} ms")));
    }
    Ok(())
}

/// A finite float in `lo..=hi`.
pub fn finite(field: &'static str, v: f64, lo: f64, hi: f64) -> Result<(), ProtocolError> {
    if !v.is_finite() {
        return Err(ProtocolError::field(field, "must be finite"));
    }
    range(field, v, lo, hi)
}
