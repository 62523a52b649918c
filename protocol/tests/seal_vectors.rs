//! The sealed-payload format (`gcs_protocol::seal`, specs/network.md
//! "Sealed payloads") as a committed vector: fixed keys, a fixed ephemeral
//! secret, the binding, the AAD and the box. An accidental change of the
//! format fails here. Regenerate deliberately with
//! `GCS_UPDATE_VECTORS=1 cargo test -p gcs-protocol --test seal_vectors`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gcs_protocol::seal::{open_sealed, seal_with_ephemeral, x25519_public, SealBinding};
use gcs_protocol::NodeKey;
use serde_json::{json, Value};

fn path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/vectors/seal.json")
}

const PLAINTEXT: &[u8] = br#"{"messages":[{"role":"user","content":"sealed hello"}]}"#;

fn generate() -> Value {
    let (gw, worker) = (NodeKey::from_seed([42; 32]), NodeKey::from_seed([7; 32]));
    let (g, w) = (gw.node_id(), worker.node_id());
    let eph = [9u8; 32];
    let b = SealBinding::lease("gcsapi_01JVECTOR", "gcslease_01JVECTOR", &g, &w);
    let sealed = seal_with_ephemeral(PLAINTEXT, &b, eph).unwrap();
    json!({
        "description": "GCS sealed payload v1: 0x01 || ephemeral X25519 public || ChaCha20-Poly1305(key = HKDF-SHA256(salt = eph_pub || recipient_x25519, ikm = X25519(eph, recipient), info = \"gcs seal v1\"), nonce = 0^12, aad). recipient_x25519 is the Montgomery form of the recipient's ed25519 key (its node id); its secret is the expanded scalar of recipient_seed.",
        "sender_node_id": g.as_str(),
        "recipient_seed": hex::encode(worker.seed()),
        "recipient_node_id": w.as_str(),
        "recipient_x25519_hex": hex::encode(x25519_public(&w).unwrap()),
        "ephemeral_secret_hex": hex::encode(eph),
        "purpose": "lease",
        "job_id": b.job_id,
        "lease_id": b.lease_id,
        "aad_hex": hex::encode(b.aad()),
        "plaintext_hex": hex::encode(PLAINTEXT),
        "sealed_hex": hex::encode(&sealed),
    })
}

#[test]
fn the_seal_vector_matches_the_committed_file() {
    let fresh = generate();
    if std::env::var_os("GCS_UPDATE_VECTORS").is_some() {
        std::fs::write(path(), serde_json::to_string_pretty(&fresh).unwrap() + "\n").unwrap();
    }
    let committed: Value =
        serde_json::from_str(&std::fs::read_to_string(path()).expect("specs/vectors/seal.json"))
            .unwrap();
    assert_eq!(committed, fresh);
}

#[test]
fn the_committed_box_opens_with_the_recipient_seed_alone() {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path()).unwrap()).unwrap();
    let s = |k: &str| v[k].as_str().unwrap().to_string();
    let key = NodeKey::from_seed(hex::decode(s("recipient_seed")).unwrap().try_into().unwrap());
    let g: gcs_protocol::NodeId = serde_json::from_value(v["sender_node_id"].clone()).unwrap();
    let w = key.node_id();
    let (job, lease) = (s("job_id"), s("lease_id"));
    let b = SealBinding::lease(&job, &lease, &g, &w);
    assert_eq!(hex::encode(b.aad()), s("aad_hex"));
    let sealed = hex::decode(s("sealed_hex")).unwrap();
    assert_eq!(open_sealed(&sealed, &key, &b).unwrap(), hex::decode(s("plaintext_hex")).unwrap());
}
