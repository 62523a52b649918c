//! The model catalogue's numbers are the weights' own: registrations
//! advertise `context_tokens` and `vocab_size` from node/src/models.rs, and
//! the gateway refuses requests against them (gateway::validate), so they
//! must equal what the engine reads from the GGUF file (and the file hash
//! and engine build they advertise are the real ones); and no token may be
//! longer than the edge's prompt bound assumes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;

#[test]
fn the_chat_models_catalogue_entry_matches_its_weights() {
    let dir =
        std::env::var_os("GCS_MODEL_DIR").map(std::path::PathBuf::from).unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/gcs/models")
        });
    let entry = gcs_node::models::entry("smollm2-135m-instruct").unwrap();
    let path = entry.path(&dir);
    if !path.is_file() {
        prereq::missing(&path.display().to_string(), "run scripts/fetch-models.sh");
        return;
    }
    let engine = gcs_engine::Engine::load(&path, &gcs_engine::cpu_device()).unwrap();
    let c = &engine.model.config;
    assert_eq!(entry.vocab_size as usize, c.vocab, "vocab_size");
    assert_eq!(entry.context_tokens as usize, c.context_length, "context_tokens");
    // The edge's prompt bound (bytes / MAX_BYTES_PER_TOKEN tokens at least)
    // holds only if no token is longer.
    let t = &engine.tokenizer;
    let longest = (0..t.vocab_size() as u32).map(|id| t.token_bytes(id).len()).max().unwrap();
    assert!(
        longest <= gcs_gateway::validate::MAX_BYTES_PER_TOKEN,
        "a {longest}-byte token breaks the edge's prompt bound"
    );
    eprintln!("longest token: {longest} bytes");
}

#[test]
fn the_gemma_catalogue_entry_matches_its_weights() {
    let dir =
        std::env::var_os("GCS_MODEL_DIR").map(std::path::PathBuf::from).unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/gcs/models")
        });
    let entry = gcs_node::models::entry("gemma-3-270m").unwrap();
    let path = entry.path(&dir);
    if !path.is_file() {
        prereq::missing(&path.display().to_string(), "run scripts/fetch-models.sh gemma3-270m");
        return;
    }
    let engine = gcs_engine::Engine::load(&path, &gcs_engine::cpu_device()).unwrap();
    let c = &engine.model.config;
    assert_eq!(c.arch, "gemma3");
    assert_eq!(entry.vocab_size as usize, c.vocab, "vocab_size");
    assert_eq!(entry.context_tokens as usize, c.context_length, "context_tokens");
    let t = &engine.tokenizer;
    let longest = (0..t.vocab_size() as u32).map(|id| t.token_bytes(id).len()).max().unwrap();
    eprintln!("gemma longest token: {longest} bytes");
    assert!(
        longest <= gcs_gateway::validate::MAX_BYTES_PER_TOKEN,
        "a {longest}-byte token breaks the edge's prompt bound"
    );
}

/// blake3 of the packaged SmolLM2 file (fetched from a sha256-checked wheel
/// by scripts/fetch-models.sh), so any other bytes fail here.
const SMOLLM2_BLAKE3: &str = "5f4fa13bfc6dd4a91fd00e22974a9c4e9ed628fd7d7f307398ddf30260d6b2c3";

#[test]
fn a_workers_registration_names_its_engine_build_and_model_file() {
    let dir =
        std::env::var_os("GCS_MODEL_DIR").map(std::path::PathBuf::from).unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/gcs/models")
        });
    let entry = gcs_node::models::entry("smollm2-135m-instruct").unwrap();
    if !entry.path(&dir).is_file() {
        prereq::missing(&entry.path(&dir).display().to_string(), "run scripts/fetch-models.sh");
        return;
    }
    let hosted = gcs_node::models::available(&dir, &["gnus-auto".into()]).unwrap();
    let m = &hosted[0];
    assert_eq!(m.engine_build, gcs_node::models::ENGINE_BUILD);
    assert_eq!(
        m.engine_build,
        format!("gcs-engine {}+out.{}", env!("CARGO_PKG_VERSION"), gcs_engine::OUTPUT_REVISION)
    );
    assert_eq!(m.model_hash, SMOLLM2_BLAKE3);
    // A signed registration carrying them validates and round-trips.
    use gcs_protocol::samples::{self, Params};
    let (key, p) = (samples::keys().0, Params::default());
    let mut r = samples::registration(&key, &p);
    r.models = hosted.clone();
    gcs_protocol::sign(&mut r, &key).unwrap();
    let bytes = gcs_protocol::encode(&r).unwrap();
    let back: gcs_protocol::NodeRegistration =
        gcs_protocol::open_as(&bytes, p.now_ms, &gcs_protocol::Limits::default()).unwrap();
    assert_eq!(back.models, hosted);
}
