//! Keyspace delta decoding on arbitrary bytes: typed error or a delta that
//! round-trips, never a panic.
#![no_main]

use gcs_keyspace::Delta;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = Delta::decode(data) {
        assert_eq!(Delta::decode(&d.encode()).expect("round trip"), d);
    }
});
