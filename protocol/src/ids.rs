//! Sortable unique ids: a type prefix plus a ULID (48-bit millisecond time,
//! 80 random bits), so ids sort by creation time and never collide in practice.

use ulid::Ulid;

use crate::error::ProtocolError;

/// Prefix of API request job ids.
pub const JOB: &str = "gcsapi_";
/// Prefix of claim ids.
pub const CLAIM: &str = "claim_";
/// Prefix of lease ids.
pub const LEASE: &str = "lease_";
/// Prefix of registration ids.
pub const REGISTRATION: &str = "reg_";
/// Prefix of processing task ids.
pub const TASK: &str = "task_";
/// Prefix of processing subtask ids.
pub const SUBTASK: &str = "subtask_";
/// Prefix of processing lock ids.
pub const LOCK: &str = "lock_";
/// Prefix of membership certificate ids.
pub const MEMBERSHIP: &str = "mcert_";

/// A new id `prefix` + ULID at `now_ms` (time is an input so callers stay
/// deterministic in tests).
pub fn new_id(prefix: &str, now_ms: u64) -> Result<String, ProtocolError> {
    let mut rnd = [0u8; 16];
    getrandom::getrandom(&mut rnd).map_err(|e| ProtocolError::Random(e.to_string()))?;
    let random = u128::from_le_bytes(rnd) & ((1u128 << 80) - 1);
    Ok(format!("{prefix}{}", Ulid::from_parts(now_ms, random)))
}

/// A deterministic id from explicit parts (test vectors, replays).
pub fn id_from_parts(prefix: &str, now_ms: u64, random: u128) -> String {
    format!("{prefix}{}", Ulid::from_parts(now_ms, random & ((1u128 << 80) - 1)))
}

/// Checks `id` is `prefix` + a valid ULID.
pub fn check_id(field: &'static str, id: &str, prefix: &str) -> Result<(), ProtocolError> {
    let rest = id
        .strip_prefix(prefix)
        .ok_or_else(|| ProtocolError::field(field, format!("must start with {prefix:?}")))?;
    if rest.len() != 26 || Ulid::from_string(rest).is_err() {
        return Err(ProtocolError::field(field, "must be the prefix followed by a 26-char ULID"));
    }
    Ok(())
}

/// The millisecond timestamp embedded in an id.
pub fn id_time_ms(id: &str, prefix: &str) -> Option<u64> {
    Ulid::from_string(id.strip_prefix(prefix)?).ok().map(|u| u.timestamp_ms())
}
