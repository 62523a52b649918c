//! Test vectors: fixed keys and messages, their canonical bytes and
//! signatures, committed in specs/vectors/messages.json. Any accidental
//! change of encoding or signing fails here. Regenerate deliberately with
//! `GCS_UPDATE_VECTORS=1 cargo test -p gcs-protocol --test vectors`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gcs_protocol::samples::{self, Params};
use gcs_protocol::*;
use serde_json::{json, Value};

fn path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/vectors/messages.json")
}

fn generate() -> Value {
    let (w, g) = samples::keys();
    let p = Params::default();
    let vectors: Vec<Value> = samples::all_signed(&w, &g, &p)
        .into_iter()
        .map(|m| {
            let t = samples::tenant_key();
            let seed = if m.signer() == &w.node_id() {
                w.seed()
            } else if m.signer() == &t.node_id() {
                t.seed()
            } else {
                g.seed()
            };
            let (json, sig) = match &m {
                Message::NodeRegistration(x) => (serde_json::to_value(x), x.signature),
                Message::ApiRequestJob(x) => (serde_json::to_value(x), x.signature),
                Message::JobClaim(x) => (serde_json::to_value(x), x.signature),
                Message::ClaimRejection(x) => (serde_json::to_value(x), x.signature),
                Message::LeaseGrant(x) => (serde_json::to_value(x), x.signature),
                Message::LeaseRenewal(x) => (serde_json::to_value(x), x.signature),
                Message::StreamChunk(x) => (serde_json::to_value(x), x.signature),
                Message::FinalResult(x) => (serde_json::to_value(x), x.signature),
                Message::UsageRecord(x) => (serde_json::to_value(x), x.signature),
                Message::Cancellation(x) => (serde_json::to_value(x), x.signature),
                Message::Requeue(x) => (serde_json::to_value(x), x.signature),
                Message::TaskLock(x) => (serde_json::to_value(x), x.signature),
                Message::TaskResult(x) => (serde_json::to_value(x), x.signature),
                Message::MembershipCertificate(x) => (serde_json::to_value(x), x.signature),
                Message::MembershipRevocation(x) => (serde_json::to_value(x), x.signature),
            };
            json!({
                "message_type": m.message_type().as_str(),
                "signer_seed": hex::encode(seed),
                "signer_node_id": m.signer().as_str(),
                "domain_tag": m.message_type().domain_tag(),
                "message": json.unwrap(),
                "canonical_cbor_hex": hex::encode(m.encode().unwrap()),
                "signature": sig.unwrap().to_hex(),
            })
        })
        .collect();
    json!({
        "description": "GCS protocol test vectors: sign with signer_seed (ed25519 secret seed) over blake3(domain_tag || 0x00 || canonical CBOR of the message without `signature`), except GCS_API_STREAM_CHUNK (see specs/protocol.md). canonical_cbor_hex includes the signature.",
        "protocol_version": PROTOCOL_VERSION,
        "vectors": vectors,
    })
}

#[test]
fn vectors_match_the_committed_file() {
    let fresh = generate();
    if std::env::var_os("GCS_UPDATE_VECTORS").is_some() {
        std::fs::write(path(), serde_json::to_string_pretty(&fresh).unwrap() + "\n").unwrap();
    }
    let committed: Value = serde_json::from_str(
        &std::fs::read_to_string(path()).expect("specs/vectors/messages.json"),
    )
    .unwrap();
    let (a, b) = (&committed["vectors"], &fresh["vectors"]);
    assert_eq!(a.as_array().unwrap().len(), b.as_array().unwrap().len());
    for (c, f) in a.as_array().unwrap().iter().zip(b.as_array().unwrap()) {
        assert_eq!(c, f, "vector for {} changed", c["message_type"]);
    }
}

#[test]
fn committed_vectors_decode_and_verify_independently() {
    let committed: Value = serde_json::from_str(&std::fs::read_to_string(path()).unwrap()).unwrap();
    let limits = Limits { max_clock_skew_ms: u64::MAX / 4, ..Limits::default() };
    for v in committed["vectors"].as_array().unwrap() {
        let bytes = hex::decode(v["canonical_cbor_hex"].as_str().unwrap()).unwrap();
        let m = open(&bytes, 1_783_468_800_000, &limits).unwrap();
        assert_eq!(m.message_type().as_str(), v["message_type"]);
        let key = NodeKey::from_seed(
            hex::decode(v["signer_seed"].as_str().unwrap()).unwrap().try_into().unwrap(),
        );
        assert_eq!(m.signer(), &key.node_id());
        // The JSON form decodes to the same message.
        let from_json: Vec<u8> = match m.message_type() {
            MessageType::StreamChunk => {
                encode(&serde_json::from_value::<StreamChunk>(v["message"].clone()).unwrap())
                    .unwrap()
            }
            MessageType::ApiRequestJob => {
                encode(&serde_json::from_value::<ApiRequestJob>(v["message"].clone()).unwrap())
                    .unwrap()
            }
            _ => bytes.clone(),
        };
        assert_eq!(from_json, bytes);
    }
}
