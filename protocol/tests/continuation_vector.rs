//! The continuation state's test vector (specs/vectors/continuation.json):
//! its JSON form and canonical CBOR bytes. Regenerate deliberately with
//! `GCS_UPDATE_VECTORS=1 cargo test -p gcs-protocol --test continuation_vector`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gcs_protocol::{Continuation, Hash32, CONTINUATION_VERSION};
use serde_json::{json, Value};

fn path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/vectors/continuation.json")
}

fn sample() -> Continuation {
    Continuation {
        version: CONTINUATION_VERSION,
        job_id: "gcsapi_01HZX3K9Q2W8E7R6T5Y4V3M2N1".into(),
        continuation: 1,
        from_sequence: 7,
        delivered_tokens: vec![1, 28, 4096, 49151],
        delivered_text_hash: Hash32::of("The sky is".as_bytes()),
        seed: 42,
        engine_build: "gcs-engine/0.1.0".into(),
        model_hash: "ab".repeat(32),
    }
}

fn generate() -> Value {
    let c = sample();
    json!({
        "description": "GCS exact-continuation state (specs/lifecycle.md, Exact continuation): canonical CBOR of the struct; not signed itself (it travels inside the gateway's signed answer).",
        "continuation_version": CONTINUATION_VERSION,
        "value": serde_json::to_value(&c).unwrap(),
        "canonical_cbor_hex": hex::encode(c.encode().unwrap()),
    })
}

#[test]
fn continuation_vector_matches_the_committed_file() {
    let fresh = generate();
    if std::env::var_os("GCS_UPDATE_VECTORS").is_some() {
        std::fs::write(path(), serde_json::to_string_pretty(&fresh).unwrap() + "\n").unwrap();
    }
    let committed: Value =
        serde_json::from_str(&std::fs::read_to_string(path()).expect("continuation.json")).unwrap();
    assert_eq!(committed, fresh);
    // The committed bytes decode to the committed JSON value.
    let bytes = hex::decode(committed["canonical_cbor_hex"].as_str().unwrap()).unwrap();
    let c = Continuation::decode(&bytes).unwrap();
    assert_eq!(serde_json::to_value(&c).unwrap(), committed["value"]);
}
