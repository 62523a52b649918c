//! GCS inference engine: a GGUF llama decoder and a BERT embedder on burn.
//!
//! Modules, from the file format up:
//! - [`quant`]: the ggml tensor types, quantized weight matrices and the
//!   CPU matmul kernels over them.
//! - [`gguf`]: the GGUF parser (its tensors are of [`quant`]'s types).
//! - [`tokenizer`]: tokenizer + chat template from GGUF metadata.
//! - [`numerics`]: llama.cpp's float kernels (`expf`, dot-product orders, RMSNorm, SwiGLU).
//! - [`attn`]: RoPE, the contiguous KV cache, the paged [`attn::KvPool`] and causal attention;
//!   [`attn_paged`]: the vectorised kernel over the paged pool.
//! - [`llama`]: the decoder (burn module) over either KV store; [`qwen2`] and
//!   [`gemma3`]: what those architectures add to it.
//! - [`sampling`], [`stop`]: token sampling with logprobs, and stop strings.
//! - [`constraint`]: grammar-constrained decoding (JSON / JSON Schema) with llguidance.
//! - [`generate`]: [`Engine`], one chat generation at a time with streaming deltas.
//! - [`paged`]: the paged KV block manager with prefix caching.
//! - [`par`]: the spinning fork-join pool a forward pass's parallel regions run on.
//! - [`scheduler`]: continuous batching ([`BatchEngine`]) over a paged KV pool,
//!   run by one engine thread's step loop.
//! - [`card`]: what a GGUF chat file says about itself (name, format, context).
//! - [`backend`]: compute backends behind one paged decode step (CPU today).
//! - [`bert`]: sentence embeddings (all-MiniLM-L6-v2).
//! - [`error`]: [`EngineError`] and [`GgufError`].

// SIMD kernels (x86 intrinsics behind runtime feature detection) need
// `unsafe`; the workspace denies it by default.
#[allow(unsafe_code)]
pub mod attn;
#[allow(unsafe_code)]
pub mod attn_paged;
pub mod backend;
pub mod bert;
pub mod card;
pub mod constraint;
pub mod devcheck;
pub mod error;
pub mod gemma3;
pub mod generate;
pub mod gguf;
pub mod llama;
#[allow(unsafe_code)]
pub mod numerics;
#[allow(unsafe_code)]
pub mod par;
pub mod paged;
#[allow(unsafe_code)]
pub mod quant;
pub mod qwen2;
pub mod sampling;
pub mod scheduler;
pub mod spm;
pub mod stop;
pub mod tokenizer;

pub use card::ModelCard;
pub use constraint::Grammar;
pub use error::{EngineError, GgufError, Result};
pub use generate::{Engine, FinishReason, GenerateRequest, GenerateResult};
pub use sampling::{Logprobs, SamplingOptions, SamplingParams, TokenLogprob};
pub use scheduler::{
    BatchConfig, BatchEngine, Priority, Prompt, SeqEvent, SeqRequest, SeqResult, SeqStream,
};
pub use tokenizer::ChatMessage;

/// The revision of what the engine outputs: the tokens, text and logprobs
/// a request and its seed give. An interrupted stream is continued only on
/// a worker advertising the lost holder's engine build, and the crate
/// version stays the same between commits, so the build names this too
/// (`gcs-node`'s `ENGINE_BUILD`). Bump it with any change that alters an
/// output on any backend: `tests/output_revision.rs` pins a fingerprint of
/// the CPU backend's outputs to it and fails until it is bumped. A macro so
/// that `concat!` can build the advertised string at compile time.
#[macro_export]
macro_rules! output_revision {
    () => {
        "1"
    };
}

/// [`output_revision!`] as a constant.
pub const OUTPUT_REVISION: &str = output_revision!();

/// The default CPU device (burn's Flex backend).
pub fn cpu_device() -> burn::tensor::Device {
    burn::tensor::Device::flex()
}

/// A CUDA device (burn's CUDA backend): the BERT embedder on a GPU
/// ([`backend::burn_device`]) and the device check's naive loop. The chat
/// decoder's GPU path is `backend::gpu`, not burn tensors.
#[cfg(feature = "cuda")]
pub fn cuda_device(index: usize) -> burn::tensor::Device {
    burn::tensor::Device::cuda(index)
}
