//! Shared helpers for integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

#[cfg(feature = "wgpu")]
pub mod gpu;
#[path = "../../../../tests/support/prereq.rs"]
pub mod prereq;
pub mod rng;

pub fn models_dir() -> PathBuf {
    if let Ok(d) = std::env::var("GCS_MODEL_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    PathBuf::from(home).join(".cache/gcs/models")
}

/// Path of the SmolLM2 GGUF, or None (SKIP; a failure under `CI=true`).
#[track_caller]
pub fn smollm_path() -> Option<PathBuf> {
    let p = models_dir().join("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    let what = format!("model {}", p.display());
    prereq::require(p.exists().then_some(p), &what, "run scripts/fetch-models.sh")
}

/// Path of the Gemma 3 270M GGUF, or None (SKIP; a failure under `CI=true`).
#[track_caller]
pub fn gemma_path() -> Option<PathBuf> {
    let p = models_dir().join("gemma-3-270m/gemma-3-270m-q4_k_m.gguf");
    let what = format!("model {}", p.display());
    prereq::require(p.exists().then_some(p), &what, "run scripts/fetch-models.sh gemma3-270m")
}

/// The all-MiniLM-L6-v2 directory, or None (SKIP; a failure under `CI=true`).
#[track_caller]
pub fn minilm_dir() -> Option<PathBuf> {
    let p = models_dir().join("all-minilm-l6-v2");
    let what = format!("model {}", p.join("model.safetensors").display());
    prereq::require(
        p.join("model.safetensors").exists().then_some(p),
        &what,
        "run scripts/fetch-models.sh",
    )
}

/// A committed fixture, or None (SKIP; a failure under `CI=true`).
#[track_caller]
pub fn fixture(name: &str) -> Option<serde_json::Value> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    let b = std::fs::read(&p).ok();
    let b = prereq::require(b, &format!("fixture {}", p.display()), "it is committed")?;
    Some(serde_json::from_slice(&b).expect("fixture is valid JSON"))
}

/// The `PagedDecoder` methods a test wrapper passes to its `inner`
/// decoder unchanged (all but the forward steps it watches).
#[allow(unused_macros)]
macro_rules! delegate_decoder {
    () => {
        fn kind(&self) -> gcs_engine::backend::BackendKind {
            self.inner.kind()
        }
        fn config(&self) -> &gcs_engine::llama::LlamaConfig {
            self.inner.config()
        }
        fn vocab(&self) -> usize {
            self.inner.vocab()
        }
        fn kv_blocks(&self) -> usize {
            self.inner.kv_blocks()
        }
        fn kv_bytes_per_token(&self) -> usize {
            self.inner.kv_bytes_per_token()
        }
        fn copy_block(&mut self, src: u32, dst: u32) {
            self.inner.copy_block(src, dst)
        }
    };
}
#[allow(unused_imports)]
pub(crate) use delegate_decoder;

/// A stream's tokens and logprobs, read to its end (its error panics).
pub fn tokens_and_logprobs(
    s: gcs_engine::SeqStream,
) -> (Vec<u32>, Vec<gcs_engine::sampling::Logprobs>) {
    let (mut toks, mut lps) = (vec![], vec![]);
    loop {
        match s.recv().expect("the stream ended without its last event") {
            gcs_engine::SeqEvent::Delta { token_ids, logprobs, .. } => {
                toks.extend(token_ids);
                lps.extend(logprobs);
            }
            gcs_engine::SeqEvent::Done(_) => return (toks, lps),
            gcs_engine::SeqEvent::Error(e) => panic!("{e}"),
        }
    }
}
