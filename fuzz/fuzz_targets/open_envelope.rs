//! Envelope decoding plus verification on arbitrary bytes: must never panic,
//! and anything it accepts must re-encode to bytes that open again to the
//! same message (no accepted message is ambiguous).
#![no_main]

use gcs_protocol::{open, Limits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits { max_clock_skew_ms: u64::MAX / 4, ..Limits::default() };
    if let Ok(m) = open(data, 1_783_468_800_000, &limits) {
        let again = m.encode().expect("accepted message re-encodes");
        let back = open(&again, 1_783_468_800_000, &limits).expect("re-encoded message opens");
        assert_eq!(back, m);
    }
    let _ = gcs_protocol::decode(data, &limits);
});
