//! Error types for the engine.

use std::path::PathBuf;

/// Errors from parsing a GGUF file. Every variant names the file so that a
/// node operator can tell which model is broken.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: I/O error: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file (bad magic {magic:#010x})")]
    BadMagic { path: PathBuf, magic: u32 },
    #[error("{path}: unsupported GGUF version {version}")]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("{path}: truncated while reading {what} at offset {offset}")]
    Truncated { path: PathBuf, what: &'static str, offset: usize },
    #[error("{path}: malformed: {reason}")]
    Malformed { path: PathBuf, reason: String },
    #[error("{path}: tensor {name}: unsupported ggml type {} (id {ggml_type})", crate::quant::ggml_type_name(*ggml_type))]
    UnsupportedType { path: PathBuf, name: String, ggml_type: u32 },
    #[error("{path}: missing metadata key {key}")]
    MissingKey { path: PathBuf, key: String },
    #[error("{path}: missing tensor {name}")]
    MissingTensor { path: PathBuf, name: String },
}

/// Top-level engine error.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("model {path}: {reason}")]
    Model { path: PathBuf, reason: String },
    #[error("{path}: I/O error: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The batch engine's waiting queue is full; retry later (HTTP 429).
    #[error("engine busy: {waiting} requests already waiting")]
    Busy { waiting: usize },
    /// The batch engine has shut down.
    #[error("engine stopped")]
    Stopped,
    /// The compute backend failed (a GPU runtime error, with its message).
    #[error("compute backend: {0}")]
    Backend(String),
    /// A step of batch work only gave way, at a layer boundary, to an
    /// interactive request that arrived while it ran; nothing of it was
    /// kept, and the scheduler runs it again later.
    #[error("a batch step gave way to an interactive request")]
    Yielded,
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
