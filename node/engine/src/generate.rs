//! End-to-end generation: chat messages → prompt → tokens → streamed text.

use std::path::Path;
use std::time::Instant;

use burn::tensor::Device;

use crate::card::ModelCard;
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
use crate::llama::{KvCache, Llama, SeqInput};
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::{ChatMessage, GgufTokenizer, Utf8Stream};

/// A chat completion request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub messages: Vec<ChatMessage>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Extra stop token ids on top of the model's EOS / end-of-turn tokens.
    pub extra_stop_ids: Vec<u32>,
}

/// Why the engine ended a sequence, for [`Engine::generate`] and
/// [`crate::BatchEngine`] alike. The wire has its own finish reason (without
/// `Cancelled`); the node converts this one where it builds a job's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was produced.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The callback asked to stop (e.g. client went away).
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct GenerateResult {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub finish_reason: FinishReason,
    /// Seconds spent on the prompt (time to first token).
    pub prefill_secs: f64,
    /// Seconds spent decoding after the first token.
    pub decode_secs: f64,
}

/// A loaded chat model: weights, tokenizer and the device they run on.
pub struct Engine {
    pub model: Llama,
    pub tokenizer: GgufTokenizer,
    pub device: Device,
    /// What the file says about itself (name, format, served context).
    pub card: ModelCard,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("config", &self.model.config).finish()
    }
}

impl Engine {
    /// Load a GGUF chat model.
    pub fn load(path: impl AsRef<Path>, device: &Device) -> Result<Self> {
        Self::load_capped(path, device, None)
    }

    /// [`Engine::load`] serving at most `max_context` positions.
    pub fn load_capped(
        path: impl AsRef<Path>,
        device: &Device,
        max_context: Option<usize>,
    ) -> Result<Self> {
        let g = GgufFile::open(path)?;
        let tokenizer = GgufTokenizer::from_gguf(&g)?;
        let model = Llama::from_gguf_capped(&g, device, max_context)?;
        let card = ModelCard::of(&g, &model.config, tokenizer.has_chat_template());
        Ok(Self { model, tokenizer, device: device.clone(), card })
    }

    /// Render the chat template and tokenize.
    pub fn prompt_tokens(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        self.tokenizer.encode_chat(messages)
    }

    /// Generate a chat completion. `on_delta` receives text deltas (never a
    /// split UTF-8 character); returning `false` cancels generation.
    pub fn generate(
        &self,
        req: &GenerateRequest,
        on_delta: impl FnMut(&str) -> bool,
    ) -> Result<GenerateResult> {
        let ids = self.prompt_tokens(&req.messages)?;
        self.generate_from_tokens(
            &ids,
            req.max_tokens,
            &req.sampling,
            &req.extra_stop_ids,
            on_delta,
        )
    }

    /// Logits for the last position of one sequence after feeding `tokens`.
    pub fn step(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
        // Run the forward pass on a rayon worker so that this thread takes
        // part in every parallel matmul: each of the ~120 parallel regions
        // per token then wakes one thread instead of two.
        let logits = rayon::scope(|_| self.model.forward(&mut [SeqInput { tokens, cache }]))?;
        logits
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| EngineError::InvalidRequest(format!("logits: {e:?}")))
    }

    /// Generate from an already tokenized prompt.
    pub fn generate_from_tokens(
        &self,
        prompt: &[u32],
        max_tokens: usize,
        sampling: &SamplingParams,
        extra_stop_ids: &[u32],
        mut on_delta: impl FnMut(&str) -> bool,
    ) -> Result<GenerateResult> {
        let ctx = self.model.config.context_length;
        check_prompt_len(prompt, ctx)?;
        let max_tokens = max_tokens.min(ctx - prompt.len());
        let mut sampler = Sampler::new(sampling.clone());
        let mut cache = KvCache::new();
        let mut stream = Utf8Stream::default();
        let mut text = String::new();
        let mut out_ids = Vec::new();
        let mut finish = FinishReason::Length;

        let t0 = Instant::now();
        let mut logits = self.step(prompt, &mut cache)?;
        let prefill_secs = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        for i in 0..max_tokens {
            let tok = sampler.sample(&logits);
            if self.tokenizer.stop_ids.contains(&tok) || extra_stop_ids.contains(&tok) {
                finish = FinishReason::Stop;
                break;
            }
            out_ids.push(tok);
            let delta = stream.push(self.tokenizer.token_bytes(tok));
            if !delta.is_empty() {
                text.push_str(&delta);
                if !on_delta(&delta) {
                    finish = FinishReason::Cancelled;
                    break;
                }
            }
            if i + 1 < max_tokens {
                logits = self.step(&[tok], &mut cache)?;
            }
        }
        let tail = stream.finish();
        if !tail.is_empty() {
            text.push_str(&tail);
            on_delta(&tail);
        }
        let decode_secs = t1.elapsed().as_secs_f64();
        tracing::debug!(
            prompt = prompt.len(),
            generated = out_ids.len(),
            prefill_secs,
            decode_secs,
            "generation done"
        );
        Ok(GenerateResult {
            text,
            completion_tokens: out_ids.len(),
            token_ids: out_ids,
            prompt_tokens: prompt.len(),
            finish_reason: finish,
            prefill_secs,
            decode_secs,
        })
    }
}

/// A prompt must have a token and leave room in the context for one more.
pub(crate) fn check_prompt_len(prompt: &[u32], context: usize) -> Result<()> {
    if prompt.is_empty() {
        return Err(EngineError::InvalidRequest("empty prompt".into()));
    }
    if prompt.len() >= context {
        return Err(EngineError::InvalidRequest(format!(
            "prompt of {} tokens exceeds context {context}",
            prompt.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The node shares one loaded model across request threads.
    #[test]
    fn engine_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<super::Engine>();
        check::<crate::bert::Embedder>();
        check::<crate::llama::KvCache>();
    }
}
