//! The real inference engine (`gcs-engine`) behind the worker's [`Executor`]
//! interface: OpenAI chat and legacy completion bodies in, streamed text
//! deltas and an OpenAI response body out; embeddings in one piece.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use std::time::Duration;

use gcs_engine::bert::Embedder;
use gcs_engine::{
    BatchConfig, BatchEngine, ChatMessage, Engine, Prompt, SamplingOptions, SeqEvent, SeqRequest,
};
use gcs_protocol::{ApiType, FinishReason, ModelInfo, TokenLogprob, TopLogprob};
use serde_json::{json, Value};

use crate::jobs::executor::{ExecOutcome, ExecRequest, Executor};

/// The chat model's file inside its model-cache directory.
pub const CHAT_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Default and maximum completion length.
const DEFAULT_MAX_TOKENS: usize = 256;
const MAX_TOKENS: usize = 4096;

/// The chat model and/or the embedder a worker serves. Chat runs on the
/// continuous-batching engine: every job is one sequence of its batch.
pub struct EngineExecutor {
    chat: Option<(String, BatchEngine)>,
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
    /// Loads the models in `models` from `model_dir`; the chat engine runs
    /// up to `max_running` sequences in one batch.
    pub fn load(
        model_dir: &Path,
        models: &[ModelInfo],
        max_running: usize,
    ) -> Result<Self, String> {
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
                let cfg = BatchConfig { max_running: max_running.max(1), ..BatchConfig::default() };
                chat = Some((m.model_id.clone(), BatchEngine::start(e, cfg)));
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

fn sampling(body: &Value) -> SamplingOptions {
    let f = |k: &str, d: f64| body.get(k).and_then(Value::as_f64).unwrap_or(d) as f32;
    let logit_bias = body
        .get("logit_bias")
        .and_then(Value::as_object)
        .map(|o| {
            o.iter()
                .filter_map(|(k, v)| Some((k.parse::<u32>().ok()?, v.as_f64()? as f32)))
                .collect()
        })
        .unwrap_or_default();
    SamplingOptions {
        temperature: f("temperature", 1.0),
        top_p: f("top_p", 1.0),
        top_k: body.get("top_k").and_then(Value::as_u64).unwrap_or(0) as usize,
        min_p: f("min_p", 0.0),
        seed: body
            .get("seed")
            .and_then(|s| s.as_u64().or_else(|| s.as_i64().map(|i| i as u64)))
            .unwrap_or_else(now_seed),
        frequency_penalty: f("frequency_penalty", 0.0),
        presence_penalty: f("presence_penalty", 0.0),
        logit_bias,
    }
}

fn stops(body: &Value) -> Vec<String> {
    match body.get("stop") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect(),
        _ => vec![],
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
    fn free_kv_tokens(&self) -> u64 {
        self.chat.as_ref().map_or(0, |(_, e)| e.free_kv_tokens() as u64)
    }

    fn run(
        &self,
        req: &ExecRequest,
        cancel: &AtomicBool,
        emit: &mut dyn FnMut(&str, u32, Vec<TokenLogprob>) -> bool,
    ) -> Result<ExecOutcome, String> {
        let body: Value =
            serde_json::from_slice(&req.body).map_err(|e| format!("request body: {e}"))?;
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
                let prompt = if req.api_type == ApiType::ChatCompletion {
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
                    Prompt::Chat(messages)
                } else {
                    let prompt = match body.get("prompt") {
                        Some(Value::String(p)) => p.as_str(),
                        Some(Value::Array(a)) if a.len() == 1 => {
                            a[0].as_str().ok_or("prompt must be a string")?
                        }
                        _ => return Err("prompt must be a string".into()),
                    };
                    Prompt::Tokens(engine.tokenizer().encode(prompt).map_err(|e| e.to_string())?)
                };
                let mut sreq = SeqRequest::new(prompt, max_tokens(&body));
                sreq.sampling = sampling(&body);
                sreq.stop = stops(&body);
                sreq.tenant = req.tenant_id.clone();
                if body.get("logprobs").and_then(Value::as_bool) == Some(true) {
                    let top = body.get("top_logprobs").and_then(Value::as_u64).unwrap_or(0);
                    sreq.logprobs = Some(top.min(20) as usize);
                }
                // Tokens (and their logprobs) whose text is held back (a
                // partial character, a possible stop string) ride on the
                // next delta that has text, so every token is counted once.
                let (mut pending_n, mut pending_lp) = (0u32, Vec::new());
                let stream = engine.submit(sreq).map_err(|e| e.to_string())?;
                let r = loop {
                    let ev = match stream.recv_timeout(Duration::from_millis(20)) {
                        Ok(ev) => ev,
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                            if cancel.load(Ordering::SeqCst) {
                                stream.cancel();
                            }
                            continue;
                        }
                        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                            return Err("the engine stopped".into())
                        }
                    };
                    match ev {
                        SeqEvent::Delta { text, token_ids, logprobs } => {
                            pending_n += token_ids.len() as u32;
                            let tok = engine.tokenizer();
                            pending_lp.extend(logprobs.iter().map(|lp| wire_logprob(tok, lp)));
                            let sent = text.is_empty()
                                || emit(
                                    &text,
                                    std::mem::take(&mut pending_n),
                                    std::mem::take(&mut pending_lp),
                                );
                            if cancel.load(Ordering::SeqCst) || !sent {
                                // Freed at the engine's next step; Done follows.
                                stream.cancel();
                            }
                        }
                        SeqEvent::Done(r) => break r,
                        SeqEvent::Error(e) => return Err(e),
                    }
                };
                let fr = finish(r.finish_reason);
                let usage = json!({"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                                   "total_tokens": r.prompt_tokens + r.completion_tokens,
                                   "prompt_tokens_details": {"cached_tokens": r.cached_tokens}});
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
                    cached_tokens: r.cached_tokens as u64,
                    body: json!({"object": object, "model": id, "choices": [choice], "usage": usage}),
                })
            }
        }
    }
}

/// The engine's logprobs of one token (token ids) in wire form (text and bytes).
fn wire_logprob(
    tok: &gcs_engine::tokenizer::GgufTokenizer,
    lp: &gcs_engine::Logprobs,
) -> TokenLogprob {
    let text = |id: u32| {
        let bytes = tok.token_bytes(id).to_vec();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    };
    let (token, bytes) = text(lp.chosen.token);
    TokenLogprob {
        token,
        logprob: lp.chosen.logprob,
        bytes,
        top: lp
            .top
            .iter()
            .map(|a| {
                let (token, bytes) = text(a.token);
                TopLogprob { token, logprob: a.logprob, bytes }
            })
            .collect(),
    }
}
