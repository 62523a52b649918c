//! The real inference engine (`gcs-engine`) behind the worker's [`Executor`]
//! interface: the gateway's typed [`JobRequest`] in, streamed text deltas
//! and the result's OpenAI body ([`codec`]) out; embeddings in one piece.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

use gcs_engine::backend::{self as compute, ComputeDevice, GpuInfo};
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

use super::executor::{EmitIds, ExecError, ExecOutcome, ExecRequest, Executor, Priority};

/// Longest completion the engine runs (the gateway refuses longer ones).
const MAX_TOKENS: usize = gcs_gateway::request::MAX_COMPLETION_TOKENS as usize;

/// The chat models and/or the embedder a worker serves. Each chat model
/// runs on its own continuous-batching engine (every job is one sequence
/// of its batch); they share the worker's KV budget (`models::kv_blocks`).
pub struct EngineExecutor {
    chat: Vec<ChatModel>,
    embed: Option<(String, Embedder)>,
    /// Sequences each chat engine batches (the worker's job slots).
    max_running: usize,
    /// The GPU the chat engines run on (`--gpu N`).
    accelerator: Option<gcs_protocol::Accelerator>,
}

/// Jobs a CPU worker runs at once unless told (`--max-jobs`).
pub const DEFAULT_MAX_JOBS: usize = 16;

/// How a worker serves its chat models (`gcs-node` flags).
#[derive(Debug, Clone)]
pub struct Serving {
    /// Most context positions a chat model is served with (`--ctx`).
    pub max_context: Option<u32>,
    /// K/V memory of the chat models together (`--kv-cache-mb`); None: 90%
    /// of a GPU's memory less weights and headroom
    /// (`gcs_engine::backend::gpu_kv_budget`), or `models::DEFAULT_KV_BYTES`.
    pub kv_bytes: Option<u64>,
    /// Sequences per batch (`--max-jobs`); None: [`DEFAULT_MAX_JOBS`] on a
    /// CPU, from the K/V capacity on a GPU
    /// (`gcs_engine::backend::gpu_max_running`).
    pub max_running: Option<usize>,
    /// Where the chat models compute (`--gpu N`).
    pub device: ComputeDevice,
    /// The probed GPU (`gcs_engine::backend::ensure_servable`).
    pub gpu: Option<GpuInfo>,
}

impl Serving {
    /// The CPU with these limits.
    pub fn cpu(max_context: Option<u32>, kv_bytes: u64, max_running: usize) -> Self {
        Serving {
            max_context,
            kv_bytes: Some(kv_bytes),
            max_running: Some(max_running),
            device: ComputeDevice::Cpu,
            gpu: None,
        }
    }
}

/// One served chat model.
struct ChatModel {
    info: ModelInfo,
    engine: BatchEngine,
    /// Measured at start (`BatchEngine::measure_decode`), tokens/s; also
    /// in the model's registration entry (`ModelInfo::decode_tokens_per_s`).
    decode_tokens_per_s: f64,
}

/// Tokens the start-up decode measurement times (after the first).
const MEASURE_TOKENS: usize = 16;

impl std::fmt::Debug for EngineExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let chat: Vec<&str> = self.chat.iter().map(|c| c.info.model_id.as_str()).collect();
        f.debug_struct("EngineExecutor")
            .field("chat", &chat)
            .field("embed", &self.embed.as_ref().map(|e| &e.0))
            .finish()
    }
}

impl EngineExecutor {
    /// Loads the catalogue models in `models` from `model_dir`; each chat
    /// engine runs up to `max_running` sequences in one batch.
    pub fn load(
        model_dir: &Path,
        models: &[ModelInfo],
        max_running: usize,
    ) -> Result<Self, String> {
        let mut wanted = vec![];
        for m in models {
            let e = crate::models::entry(&m.model_id)
                .ok_or_else(|| format!("{}: not in the model catalogue", m.model_id))?;
            wanted.push(crate::models::Wanted::Catalog(e));
        }
        let serving = Serving::cpu(None, crate::models::DEFAULT_KV_BYTES, max_running);
        let (_, exec) = Self::serve(model_dir, &wanted, &serving).map_err(|e| e.to_string())?;
        Ok(exec)
    }

    /// Loads every model of `wanted` (catalogue entries from `model_dir`,
    /// files by path), each chat model on `serving.device` with at most
    /// `max_context` positions and its share of the K/V budget, measures
    /// each one's decode speed, and returns what registrations advertise
    /// for them, in order. A model the device cannot run (a K-quant on a
    /// GPU) is an error naming it.
    pub fn serve(
        model_dir: &Path,
        wanted: &[crate::models::Wanted],
        serving: &Serving,
    ) -> Result<(Vec<ModelInfo>, Self), crate::models::CatalogError> {
        let max_context = serving.max_context;
        use crate::models::{kv_blocks, load_chat, CatalogError, Wanted};
        let mut loaded = vec![];
        let mut embed = None;
        let mut infos = vec![];
        for w in wanted {
            match load_chat(w, model_dir, max_context)? {
                Some((info, engine)) => {
                    if loaded.iter().any(|(i, _): &(ModelInfo, Engine)| i.model_id == info.model_id)
                    {
                        return Err(CatalogError::Usage(format!(
                            "two models with the id {:?}; name one with --model-id",
                            info.model_id
                        )));
                    }
                    // Advertised in the order asked for.
                    infos.push(info.clone());
                    loaded.push((info, engine));
                }
                None => {
                    let Wanted::Catalog(e) = w else { continue };
                    let dir = model_dir.join(e.model_id);
                    // On burn tensors: burn-cuda on a CUDA GPU, batched as
                    // on the CPU; the CPU otherwise.
                    let device = compute::burn_device(serving.device);
                    let m = Embedder::load(&dir, &device)
                        .map_err(|reason| CatalogError::Load { path: dir.clone(), reason })?;
                    let mut info = e.hosted_info(model_dir)?;
                    info.backend = compute::burn_backend_name(serving.device).into();
                    infos.push(info);
                    embed = Some((e.model_id.to_string(), m));
                }
            }
        }
        let device = serving.device;
        // f16 K and V a position, on the CPU and in a GPU's pools alike.
        let per_token: Vec<usize> =
            loaded.iter().map(|(_, e)| e.model.config.kv_bytes_per_token()).collect();
        // On a GPU with dense steps (`GCS_GPU_DENSE`) the f16 copies too.
        let resident = |e: &Engine| match serving.gpu {
            Some(_) => compute::gpu_weight_bytes(&e.model, Default::default())
                .map_err(|e| CatalogError::Usage(e.to_string())),
            None => Ok(compute::weight_bytes(&e.model)),
        };
        let weights: u64 =
            loaded.iter().map(|(_, e)| resident(e)).sum::<Result<u64, CatalogError>>()?;
        let kv_bytes = serving
            .kv_bytes
            .or_else(|| compute::gpu_kv_budget(serving.gpu.as_ref()?, weights, loaded.len()))
            .unwrap_or(crate::models::DEFAULT_KV_BYTES);
        let mut blocks = kv_blocks(kv_bytes, &per_token);
        if let Some(gpu) = &serving.gpu {
            for (b, (_, e)) in blocks.iter_mut().zip(&loaded) {
                *b = (*b).min(compute::gpu_max_kv_blocks(&e.model.config, gpu.kind));
            }
        }
        // On a GPU the batch follows the K/V capacity of the smallest pool.
        let max_running = match (serving.max_running, &serving.gpu) {
            (Some(n), _) => n,
            (None, Some(_)) => loaded
                .iter()
                .zip(&blocks)
                .map(|((_, e), b)| compute::gpu_max_running(b * 16, e.model.config.context_length))
                .min()
                .unwrap_or(DEFAULT_MAX_JOBS),
            (None, None) => DEFAULT_MAX_JOBS,
        }
        .max(1);
        let backend = match &serving.gpu {
            Some(g) => g.kind,
            None => compute::BackendKind::Cpu,
        };
        // What the GPU decoders compute in, for the build they advertise.
        let arithmetic = match backend {
            compute::BackendKind::Cpu => String::new(),
            _ => compute::gpu_arithmetic(Default::default())
                .map_err(|e| CatalogError::Usage(e.to_string()))?,
        };
        let mut chat = vec![];
        for ((mut info, engine), kv_blocks) in loaded.into_iter().zip(blocks.iter().copied()) {
            let cfg = BatchConfig { max_running, kv_blocks, ..BatchConfig::default() };
            let engine = BatchEngine::start_on(engine, cfg, device).map_err(|reason| {
                CatalogError::Device { model: info.model_id.clone(), reason }
            })?;
            if backend != compute::BackendKind::Cpu {
                // A GPU computes other logits than the CPU, and each of its
                // arithmetics others again: a stream is continued only on a
                // worker of the same backend computing the same way.
                info.backend = backend.name().into();
                info.engine_build =
                    format!("{} {}{arithmetic}", info.engine_build, backend.name());
                if let Some(i) = infos.iter_mut().find(|i| i.model_id == info.model_id) {
                    i.backend = info.backend.clone();
                    i.engine_build = info.engine_build.clone();
                }
            }
            let decode_tokens_per_s = engine.measure_decode(MEASURE_TOKENS).unwrap_or_else(|e| {
                tracing::warn!(model = %info.model_id, error = %e, "decode measurement failed");
                0.0
            });
            tracing::info!(model = %info.model_id, kv_blocks, context = info.context_tokens, quantization = %info.quantization, decode_tokens_per_s, "chat model ready");
            // Each model's own figure goes into its registration entry.
            if let Some(i) = infos.iter_mut().find(|i| i.model_id == info.model_id) {
                i.decode_tokens_per_s = decode_tokens_per_s;
            }
            chat.push(ChatModel { info, engine, decode_tokens_per_s });
        }
        let accelerator = serving.gpu.as_ref().map(|g| gcs_protocol::Accelerator {
            backend: g.kind.name().into(),
            name: g.name.clone(),
            memory_bytes: g.memory_bytes,
            kv_tokens: blocks.iter().map(|b| (b * 16) as u64).sum(),
        });
        if let Some(a) = &accelerator {
            // What registrations advertise, as JSON (tests/gpu_serve.rs).
            let json = serde_json::to_string(a).unwrap_or_default();
            tracing::info!(max_jobs = max_running, accelerator = %json, "worker accelerator");
        }
        Ok((infos, Self { chat, embed, max_running, accelerator }))
    }

    /// Sequences each chat engine batches: the worker's job slots.
    pub fn max_running(&self) -> usize {
        self.max_running
    }

    /// The chat model a job asked for (its id or an alias); a worker with
    /// one chat model serves every chat job it was admitted with.
    fn chat_model(&self, name: &str) -> Result<&ChatModel, ExecError> {
        match self.chat.iter().find(|c| c.info.answers_to(name)) {
            Some(c) => Ok(c),
            None if self.chat.len() == 1 => Ok(&self.chat[0]),
            None if self.chat.is_empty() => {
                Err(ExecError::Invalid("no chat model on this worker".into()))
            }
            None => Err(ExecError::Invalid(format!("model {name:?} is not served by this worker"))),
        }
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
        self.chat.iter().map(|c| c.engine.free_kv_tokens() as u64).sum()
    }

    fn decode_tokens_per_s(&self) -> f64 {
        // The slowest chat model: what any chat job here gets at least.
        self.chat.iter().map(|c| c.decode_tokens_per_s).reduce(f64::min).unwrap_or(0.0)
    }

    fn accelerator(&self) -> Option<gcs_protocol::Accelerator> {
        self.accelerator.clone()
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
                self.generate(&g, req, from, cancel, emit)
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
        req: &ExecRequest,
        from: Option<&Continuation>,
        cancel: &AtomicBool,
        emit: &mut EmitIds<'_>,
    ) -> Result<ExecOutcome, ExecError> {
        let (model, cache_salt, priority) = (&req.model, &req.cache_salt, req.priority);
        let c = self.chat_model(model)?;
        let (id, engine) = (&c.info.model_id, &c.engine);
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
        sreq.priority = match priority {
            Priority::Interactive => gcs_engine::Priority::Interactive,
            Priority::Batch => gcs_engine::Priority::Batch,
        };
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
