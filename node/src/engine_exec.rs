//! The real inference engine (`gcs-engine`) behind the worker's [`Executor`]
//! interface: OpenAI chat and legacy completion bodies in, streamed text
//! deltas and an OpenAI response body out; embeddings in one piece.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use gcs_engine::bert::Embedder;
use gcs_engine::{ChatMessage, Engine, GenerateRequest, SamplingParams};
use gcs_protocol::{ApiType, FinishReason, ModelInfo};
use serde_json::{json, Value};

use crate::jobs::executor::{ExecOutcome, ExecRequest, Executor};

/// The chat model's file inside its model-cache directory.
pub const CHAT_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Default and maximum completion length.
const DEFAULT_MAX_TOKENS: usize = 256;
const MAX_TOKENS: usize = 4096;

/// The chat model and/or the embedder a worker serves.
pub struct EngineExecutor {
    chat: Option<(String, Engine)>,
    embed: Option<(String, Embedder)>,
}

impl std::fmt::Debug for EngineExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineExecutor")
            .field("chat", &self.chat.as_ref().map(|c| &c.0))
            .field("embed", &self.embed.as_ref().map(|e| &e.0))
            .finish()
    }
}

impl EngineExecutor {
    /// Loads the models in `models` from `model_dir`.
    pub fn load(model_dir: &Path, models: &[ModelInfo]) -> Result<Self, String> {
        let device = gcs_engine::cpu_device();
        let mut chat = None;
        let mut embed = None;
        for m in models {
            if m.tasks.contains(&ApiType::Embedding) {
                let dir = model_dir.join(&m.model_id);
                let e =
                    Embedder::load(&dir, &device).map_err(|e| format!("{}: {e}", dir.display()))?;
                embed = Some((m.model_id.clone(), e));
            } else {
                let path = model_dir.join(&m.model_id).join(CHAT_GGUF);
                let e =
                    Engine::load(&path, &device).map_err(|e| format!("{}: {e}", path.display()))?;
                chat = Some((m.model_id.clone(), e));
            }
        }
        Ok(Self { chat, embed })
    }
}

fn text_of(content: &Value) -> Result<String, String> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => parts
            .iter()
            .map(|p| {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str))
                {
                    (Some("text"), Some(t)) => Ok(t.to_string()),
                    _ => Err("only text content parts are supported".to_string()),
                }
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.join("")),
        Value::Null => Ok(String::new()),
        _ => Err("message content must be a string or text parts".into()),
    }
}

fn sampling(body: &Value) -> SamplingParams {
    let f = |k: &str| body.get(k).and_then(Value::as_f64);
    SamplingParams {
        temperature: f("temperature").unwrap_or(1.0) as f32,
        top_p: f("top_p").unwrap_or(1.0) as f32,
        top_k: f("top_k").unwrap_or(0.0) as usize,
        seed: body.get("seed").and_then(Value::as_u64).unwrap_or_else(now_seed),
    }
}

fn now_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn max_tokens(body: &Value) -> usize {
    body.get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64)
        .map_or(DEFAULT_MAX_TOKENS, |n| n as usize)
        .min(MAX_TOKENS)
}

fn finish(f: gcs_engine::FinishReason) -> FinishReason {
    match f {
        gcs_engine::FinishReason::Length => FinishReason::Length,
        _ => FinishReason::Stop,
    }
}

impl Executor for EngineExecutor {
    fn run(
        &self,
        req: &ExecRequest,
        cancel: &AtomicBool,
        emit: &mut dyn FnMut(&str, u32) -> bool,
    ) -> Result<ExecOutcome, String> {
        let body: Value =
            serde_json::from_slice(&req.body).map_err(|e| format!("request body: {e}"))?;
        let mut on_delta = |d: &str| !cancel.load(Ordering::SeqCst) && emit(d, 1);
        match req.api_type {
            ApiType::Embedding => {
                let (id, e) = self.embed.as_ref().ok_or("no embedding model on this worker")?;
                let inputs: Vec<String> = match body.get("input") {
                    Some(Value::String(s)) => vec![s.clone()],
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|v| v.as_str().map(str::to_string).ok_or("input must be strings"))
                        .collect::<Result<_, _>>()?,
                    _ => return Err("input must be a string or an array of strings".into()),
                };
                let refs: Vec<&str> = inputs.iter().map(String::as_str).collect();
                let vecs = e.embed(&refs).map_err(|e| e.to_string())?;
                let tokens: u64 = inputs.iter().map(|s| s.split_whitespace().count() as u64).sum();
                let data: Vec<Value> = vecs
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| json!({"object": "embedding", "index": i, "embedding": v}))
                    .collect();
                Ok(ExecOutcome {
                    finish_reason: FinishReason::Stop,
                    input_tokens: tokens,
                    output_tokens: 0,
                    cached_tokens: 0,
                    body: json!({"object": "list", "data": data, "model": id,
                                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}),
                })
            }
            ApiType::ChatCompletion | ApiType::Completion => {
                let (id, engine) = self.chat.as_ref().ok_or("no chat model on this worker")?;
                let sampling = sampling(&body);
                let max = max_tokens(&body);
                let r = if req.api_type == ApiType::ChatCompletion {
                    let messages = body
                        .get("messages")
                        .and_then(Value::as_array)
                        .ok_or("messages must be an array")?
                        .iter()
                        .map(|m| {
                            let role = m
                                .get("role")
                                .and_then(Value::as_str)
                                .ok_or("message without role")?;
                            let role = if role == "developer" { "system" } else { role };
                            Ok(ChatMessage::new(
                                role,
                                text_of(m.get("content").unwrap_or(&Value::Null))?,
                            ))
                        })
                        .collect::<Result<Vec<_>, String>>()?;
                    let gr = GenerateRequest {
                        messages,
                        max_tokens: max,
                        sampling,
                        extra_stop_ids: vec![],
                    };
                    engine.generate(&gr, &mut on_delta).map_err(|e| e.to_string())?
                } else {
                    let prompt = body
                        .get("prompt")
                        .and_then(Value::as_str)
                        .ok_or("prompt must be a string")?;
                    let ids = engine.tokenizer.encode(prompt).map_err(|e| e.to_string())?;
                    engine
                        .generate_from_tokens(&ids, max, &sampling, &[], &mut on_delta)
                        .map_err(|e| e.to_string())?
                };
                let fr = finish(r.finish_reason);
                let usage = json!({"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                                   "total_tokens": r.prompt_tokens + r.completion_tokens,
                                   "prompt_tokens_details": {"cached_tokens": 0}});
                let choice = if req.api_type == ApiType::ChatCompletion {
                    json!({"index": 0, "message": {"role": "assistant", "content": r.text}, "finish_reason": fr.as_str()})
                } else {
                    json!({"index": 0, "text": r.text, "finish_reason": fr.as_str()})
                };
                let object = if req.api_type == ApiType::ChatCompletion {
                    "chat.completion"
                } else {
                    "text_completion"
                };
                Ok(ExecOutcome {
                    finish_reason: fr,
                    input_tokens: r.prompt_tokens as u64,
                    output_tokens: r.completion_tokens as u64,
                    cached_tokens: 0,
                    body: json!({"object": object, "model": id, "choices": [choice], "usage": usage}),
                })
            }
        }
    }
}
