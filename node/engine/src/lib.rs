//! GCS inference engine: a GGUF llama decoder and a BERT embedder on burn.
//!
//! Quick tour:
//! - [`gguf`]: GGUF parser.
//! - [`quant`]: quantized weights and the CPU matmul kernels over them.
//! - [`tokenizer`]: tokenizer + chat template from GGUF metadata.
//! - [`llama`]: the decoder (burn module) and its KV cache.
//! - [`generate`]: end-to-end chat generation with streaming deltas.
//! - [`sampling`], [`stop`]: token sampling and stop strings.
//! - [`paged`]: the paged KV block manager with prefix caching.
//! - [`scheduler`]: continuous batching ([`BatchEngine`]) over a paged KV pool.
//! - [`bert`]: sentence embeddings (all-MiniLM-L6-v2).

// SIMD kernels (x86 intrinsics behind runtime feature detection) need
// `unsafe`; the workspace denies it by default.
#[allow(unsafe_code)]
pub mod attn;
pub mod bert;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod llama;
#[allow(unsafe_code)]
pub mod numerics;
pub mod paged;
#[allow(unsafe_code)]
pub mod quant;
pub mod sampling;
pub mod scheduler;
pub mod stop;
pub mod tokenizer;

pub use error::{EngineError, GgufError, Result};
pub use generate::{Engine, FinishReason, GenerateRequest, GenerateResult};
pub use sampling::{Logprobs, SamplingOptions, SamplingParams, TokenLogprob};
pub use scheduler::{
    BatchConfig, BatchEngine, LogprobEntry, Prompt, SeqEvent, SeqRequest, SeqResult, SeqStream,
    TokenLogprobs,
};
pub use tokenizer::ChatMessage;

/// The default CPU device (burn's Flex backend).
pub fn cpu_device() -> burn::tensor::Device {
    burn::tensor::Device::flex()
}

/// A CUDA device (burn's CUDA backend). The quantized matmul and attention
/// kernels still run on the host, so this is for experiments only.
#[cfg(feature = "cuda")]
pub fn cuda_device(index: usize) -> burn::tensor::Device {
    burn::tensor::Device::cuda(index)
}
