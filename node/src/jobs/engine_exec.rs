//! The real inference engine (`gcs-engine`) behind the worker's [`Executor`]
//! interface: the gateway's typed [`JobRequest`] in, streamed text deltas
//! and the result's OpenAI body ([`codec`]) out; embeddings in one piece.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

use gcs_engine::bert::Embedder;
use gcs_engine::{
    BatchConfig, BatchEngine, ChatMessage, Engine, Grammar, Prompt as EnginePrompt,
    SamplingOptions, SeqEvent, SeqRequest,
};
use gcs_gateway::codec;
use gcs_gateway::payload::{
    Constraint, Embedding, Generation, JobRequest, Message, Prompt, Role, Sampling,
};
use gcs_gateway::tools::{grammar as tool_grammar, render};
use gcs_gateway::validate::{self, ModelLimits, PromptTokens};
use gcs_protocol::{
    ApiType, Continuation, FinishReason, Hash32, ModelInfo, TokenLogprob, TopLogprob,
};
use serde_json::json;

use super::executor::{EmitIds, ExecError, ExecOutcome, ExecRequest, Executor};

/// Longest completion the engine runs (the gateway refuses longer ones).
const MAX_TOKENS: usize = gcs_gateway::request::MAX_COMPLETION_TOKENS as usize;

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
                let path = crate::models::entry(&m.model_id)
                    .map(|e| e.path(model_dir))
                    .ok_or_else(|| format!("{}: not in the model catalogue", m.model_id))?;
                let e =
                    Engine::load(&path, &device).map_err(|e| format!("{}: {e}", path.display()))?;
                let cfg = BatchConfig { max_running: max_running.max(1), ..BatchConfig::default() };
                chat = Some((m.model_id.clone(), BatchEngine::start(e, cfg)));
            }
        }
        Ok(Self { chat, embed })
    }
}

fn sampling(s: &Sampling) -> SamplingOptions {
    SamplingOptions {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k as usize,
        min_p: s.min_p,
        seed: s.seed.unwrap_or_else(now_seed),
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        logit_bias: s.logit_bias.iter().map(|(&t, &b)| (t, b)).collect(),
    }
}

/// The engine's grammar for a job's constraint.
fn grammar(c: &Constraint) -> Grammar {
    match c {
        Constraint::JsonObject => Grammar::JsonObject,
        Constraint::JsonSchema { schema, .. } => Grammar::JsonSchema(schema.clone()),
    }
}

/// A turn the plain template path cannot show (a call or a result).
fn uses_tools(m: &Message) -> bool {
    m.role == Role::Tool || !m.tool_calls.is_empty()
}

fn now_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
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
    ) -> Result<ExecOutcome, ExecError> {
        self.run_with_ids(req, cancel, &mut |text, n, _, lps| emit(text, n, lps))
    }

    fn run_with_ids(
        &self,
        req: &ExecRequest,
        cancel: &AtomicBool,
        emit: &mut EmitIds<'_>,
    ) -> Result<ExecOutcome, ExecError> {
        self.run_from(req, None, cancel, emit)
    }

    fn resume_with_ids(
        &self,
        req: &ExecRequest,
        from: &Continuation,
        cancel: &AtomicBool,
        emit: &mut EmitIds<'_>,
    ) -> Result<ExecOutcome, ExecError> {
        self.run_from(req, Some(from), cancel, emit)
    }
}

impl EngineExecutor {
    /// A job from its start, or (`from`) continued after the tokens another
    /// worker delivered.
    fn run_from(
        &self,
        req: &ExecRequest,
        from: Option<&Continuation>,
        cancel: &AtomicBool,
        emit: &mut EmitIds<'_>,
    ) -> Result<ExecOutcome, ExecError> {
        let job = JobRequest::decode(&req.body).map_err(|e| ExecError::Invalid(e.to_string()))?;
        if job.api_type() != req.api_type {
            return Err(ExecError::Invalid(format!(
                "the payload is a {} request but the job is {}",
                job.api_type().as_str(),
                req.api_type.as_str()
            )));
        }
        match (job, from) {
            (JobRequest::Embedding(e), None) => self.embed(&e),
            (JobRequest::Embedding(_), Some(_)) => {
                Err(ExecError::Invalid("an embedding is not a stream to continue".into()))
            }
            (JobRequest::Generation(g), from) => {
                self.generate(&g, &req.cache_salt, from, cancel, emit)
            }
        }
    }
}

impl EngineExecutor {
    fn embed(&self, req: &Embedding) -> Result<ExecOutcome, ExecError> {
        let (id, e) = self
            .embed
            .as_ref()
            .ok_or(ExecError::Invalid("no embedding model on this worker".into()))?;
        let refs: Vec<&str> = req.inputs.iter().map(String::as_str).collect();
        let (vecs, tokens) =
            e.embed_counted(&refs).map_err(|e| ExecError::Engine(e.to_string()))?;
        let tokens = tokens as u64;
        let data = vecs.into_iter().enumerate().map(|(i, v)| codec::embedding(i, json!(v)));
        Ok(ExecOutcome {
            finish_reason: FinishReason::Stop,
            input_tokens: tokens,
            output_tokens: 0,
            cached_tokens: 0,
            body: codec::embedding_list(id, data.collect(), tokens),
        })
    }

    fn generate(
        &self,
        g: &Generation,
        cache_salt: &str,
        from: Option<&Continuation>,
        cancel: &AtomicBool,
        emit: &mut EmitIds<'_>,
    ) -> Result<ExecOutcome, ExecError> {
        let (id, engine) =
            self.chat.as_ref().ok_or(ExecError::Invalid("no chat model on this worker".into()))?;
        let (api, prompt) = match &g.prompt {
            // Tools, or a history with tool turns: rendered here, as the
            // template expects them (natively, or the documented fallback).
            Prompt::Chat(msgs) if g.tools.is_some() || msgs.iter().any(uses_tools) => {
                let tok = engine.tokenizer();
                let input =
                    render::template_input(msgs, g.tools.as_ref(), tok.template_renders_tools());
                let text = tok
                    .render_chat(&input.messages, input.tools.as_deref(), true)
                    .map_err(exec_error)?;
                (
                    ApiType::ChatCompletion,
                    EnginePrompt::Tokens(tok.encode(&text).map_err(exec_error)?),
                )
            }
            Prompt::Chat(msgs) => {
                let msgs = msgs.iter().map(|m| ChatMessage::new(m.role.as_str(), &m.content));
                (ApiType::ChatCompletion, EnginePrompt::Chat(msgs.collect()))
            }
            Prompt::Text(text) => {
                let ids = engine.tokenizer().encode(text).map_err(exec_error)?;
                (ApiType::Completion, EnginePrompt::Tokens(ids))
            }
        };
        // The gateway's check, with this engine's own limits: a request
        // that slipped past it (another build, an unknown vocabulary) is
        // refused as the client's error before it takes a batch slot. The
        // chat prompt's exact count is the engine's (after its template).
        let limits = ModelLimits {
            context_tokens: u32::try_from(engine.context()).ok(),
            vocab_size: u32::try_from(engine.vocab()).ok(),
        };
        let counted = match &prompt {
            EnginePrompt::Tokens(ids) => PromptTokens::Exact(ids.len() as u64),
            EnginePrompt::Chat(_) => PromptTokens::FromBytes,
        };
        validate::generation(g, limits, counted).map_err(|e| ExecError::Invalid(e.to_string()))?;
        let mut sreq = SeqRequest::new(prompt, (g.max_tokens as usize).min(MAX_TOKENS));
        sreq.sampling = sampling(&g.sampling);
        sreq.stop = g.stop.clone();
        sreq.tenant = cache_salt.to_string();
        sreq.logprobs = g.logprobs.map(|top| usize::from(top.min(20)));
        // Compiled by `submit`, on this thread, within llguidance's fuel
        // limits; a schema this engine cannot compile is the client's error.
        sreq.grammar = match &g.tools {
            Some(t) => {
                let lark = tool_grammar::lark(t, g.constraint.as_ref())
                    .map_err(|e| ExecError::Invalid(e.to_string()))?;
                Some(Grammar::Lark(lark))
            }
            None => g.constraint.as_ref().map(grammar),
        };
        // Tokens (and their logprobs) whose text is held back (a partial
        // character, a possible stop string) ride on the next delta that
        // has text, so every token is counted once.
        let (mut pending_n, mut pending_ids, mut pending_lp) = (0u32, Vec::new(), Vec::new());
        let stream = match from {
            None => engine.submit(sreq).map_err(exec_error)?,
            Some(c) => {
                // The seed the delivered tokens were sampled with; the
                // replay must release exactly the text the client has.
                sreq.sampling.seed = c.seed;
                let s = engine.resume(sreq, &c.delivered_tokens).map_err(exec_error)?;
                if Hash32::of(s.resumed_text().as_bytes()) != c.delivered_text_hash {
                    return Err(ExecError::Invalid(
                        "continuation: the delivered text is not what this engine's replay \
                         releases (another engine build or model file)"
                            .into(),
                    ));
                }
                s
            }
        };
        let r = loop {
            let ev = match stream.recv_timeout(Duration::from_millis(20)) {
                Ok(ev) => ev,
                Err(RecvTimeoutError::Timeout) => {
                    if cancel.load(Ordering::SeqCst) {
                        stream.cancel();
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(ExecError::Engine("the engine stopped".into()))
                }
            };
            match ev {
                SeqEvent::Delta { text, token_ids, logprobs } => {
                    pending_n += token_ids.len() as u32;
                    pending_ids.extend_from_slice(&token_ids);
                    let tok = engine.tokenizer();
                    pending_lp.extend(logprobs.iter().map(|lp| wire_logprob(tok, lp)));
                    let sent = text.is_empty()
                        || emit(
                            &text,
                            std::mem::take(&mut pending_n),
                            &std::mem::take(&mut pending_ids),
                            std::mem::take(&mut pending_lp),
                        );
                    if cancel.load(Ordering::SeqCst) || !sent {
                        // Freed at the engine's next step; Done follows.
                        stream.cancel();
                    }
                }
                SeqEvent::Done(r) => break r,
                SeqEvent::Error(e) => return Err(ExecError::Engine(e)),
            }
        };
        let fr = finish(r.finish_reason);
        let (prompt_n, completion_n) = (r.prompt_tokens as u64, r.completion_tokens as u64);
        let cached = r.cached_tokens as u64;
        let choice = codec::choice(api, 0, &r.text, serde_json::Value::Null, fr.as_str());
        Ok(ExecOutcome {
            finish_reason: fr,
            input_tokens: prompt_n,
            output_tokens: completion_n,
            cached_tokens: cached,
            body: codec::result_body(api, id, choice, codec::usage(prompt_n, completion_n, cached)),
        })
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

/// The engine's refusals of the request itself are client errors; the
/// rest are the engine's.
fn exec_error(e: gcs_engine::EngineError) -> ExecError {
    match e {
        gcs_engine::EngineError::InvalidRequest(m) => ExecError::Invalid(m),
        gcs_engine::EngineError::Tokenizer(m) => ExecError::Invalid(format!("tokenizer: {m}")),
        other => ExecError::Engine(other.to_string()),
    }
}
