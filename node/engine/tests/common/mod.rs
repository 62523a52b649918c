//! Shared helpers for integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

pub fn models_dir() -> PathBuf {
    if let Ok(d) = std::env::var("GCS_MODEL_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    PathBuf::from(home).join(".cache/gcs/models")
}

/// Path of the SmolLM2 GGUF, or None (with a message) when absent.
pub fn smollm_path() -> Option<PathBuf> {
    let p = models_dir().join("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.exists() {
        Some(p)
    } else {
        eprintln!("SKIP: model {} not found; run scripts/fetch-models.sh", p.display());
        None
    }
}

pub fn minilm_dir() -> Option<PathBuf> {
    let p = models_dir().join("all-minilm-l6-v2");
    if p.join("model.safetensors").exists() {
        Some(p)
    } else {
        eprintln!("SKIP: model {} not found; run scripts/fetch-models.sh", p.display());
        None
    }
}

pub fn fixture(name: &str) -> Option<serde_json::Value> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    match std::fs::read(&p) {
        Ok(b) => Some(serde_json::from_slice(&b).expect("fixture is valid JSON")),
        Err(_) => {
            eprintln!("SKIP: fixture {} not found", p.display());
            None
        }
    }
}
