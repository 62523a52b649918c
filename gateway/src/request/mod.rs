//! OpenAI request bodies: parsed, validated and normalised before a job is
//! built. Every field we accept is either applied (by the worker, through
//! the typed [`JobRequest`] it receives) or rejected with an
//! `invalid_request_error` naming it; unknown fields are ignored, as OpenAI
//! clients expect.

use std::collections::BTreeMap;

use gcs_protocol::{ApiType, PrivacyLevel, RoutingMode};
use serde_json::{Map, Value};

use crate::error::ApiError;
mod fields;
mod format;
mod gnus;
mod messages;
mod tools;

pub use gnus::ContinuationPolicy;
use gnus::gnus_extension;
use messages::messages;

use crate::payload::{Embedding, Generation, JobRequest, Prompt, Sampling};

/// Largest completion a request may ask for.
pub const MAX_COMPLETION_TOKENS: u64 = 4096;
/// Default completion budget when the request names none.
pub const DEFAULT_COMPLETION_TOKENS: u64 = 256;
/// Most choices (`n`) in one request.
pub const MAX_N: u64 = 8;
/// Most inputs in one embeddings request.
pub const MAX_EMBEDDING_INPUTS: usize = 2048;

/// Per-request timeout overrides from the `gnus.limits` extension.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimeoutOverrides {
    /// First token.
    pub first_token_ms: Option<u64>,
    /// Idle stream.
    pub idle_ms: Option<u64>,
    /// Wall clock.
    pub wall_ms: Option<u64>,
}

/// What every request has: the model, and how its jobs are routed and
/// admitted.
#[derive(Clone, Debug)]
pub struct Common {
    /// API surface.
    pub api_type: ApiType,
    /// Requested model or alias.
    pub model: String,
    /// Characters of prompt text, for the admission estimate.
    pub prompt_chars: usize,
    /// Routing mode (`gnus.network`, default public).
    pub network: RoutingMode,
    /// Privacy (`gnus.privacy_mode`, default standard).
    pub privacy: PrivacyLevel,
    /// Timeout overrides.
    pub timeouts: TimeoutOverrides,
    /// `gnus.continuation` (default auto).
    pub continuation: ContinuationPolicy,
    /// Fields present that GCS does not honour (ignored, as 26.15.2 asks;
    /// with `gnus.strict` they are refused instead and never get here).
    pub ignored: Vec<String>,
}

/// A validated chat or legacy completion request.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    /// Model, routing, limits.
    pub common: Common,
    /// SSE or one JSON body.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Choices to generate (`n`; each is its own job, so they may run on
    /// different workers).
    pub n: u32,
    /// The field that set the completion budget, named when it is refused.
    pub budget_field: &'static str,
    /// What each choice's worker runs.
    pub job: Generation,
}

/// A validated embeddings request.
#[derive(Clone, Debug)]
pub struct EmbeddingRequest {
    /// Model, routing, limits.
    pub common: Common,
    /// `encoding_format: base64`.
    pub base64: bool,
    /// Every input, in order (split into jobs by the handler).
    pub job: Embedding,
}

/// A validated request, by kind.
#[derive(Clone, Debug)]
pub enum Parsed {
    /// `/v1/chat/completions` or `/v1/completions`.
    Generation(GenerationRequest),
    /// `/v1/embeddings`.
    Embedding(EmbeddingRequest),
}

impl Parsed {
    /// Model, routing, limits.
    pub fn common(&self) -> &Common {
        match self {
            Parsed::Generation(g) => &g.common,
            Parsed::Embedding(e) => &e.common,
        }
    }

    /// The completion budget of each choice (0 for embeddings).
    pub fn max_tokens(&self) -> u64 {
        match self {
            Parsed::Generation(g) => u64::from(g.job.max_tokens),
            Parsed::Embedding(_) => 0,
        }
    }

    /// Choices (1 for embeddings).
    pub fn n(&self) -> u32 {
        match self {
            Parsed::Generation(g) => g.n,
            Parsed::Embedding(_) => 1,
        }
    }
}

impl GenerationRequest {
    /// The job of choice `i`: its own seed when one was given, so the
    /// choices differ under sampling the way OpenAI's do.
    pub fn choice(&self, i: u32) -> JobRequest {
        let mut job = self.job.clone();
        if let Some(seed) = job.sampling.seed.as_mut() {
            *seed = seed.wrapping_add(u64::from(i));
        }
        JobRequest::Generation(job)
    }

    /// Gives a sampled request without a `seed` one, so that every sampled
    /// stream can be continued on another worker (specs/lifecycle.md, exact
    /// continuation). The seed is derived from the job's idempotency key:
    /// a random one when the client named none (so each admission differs),
    /// the client's own otherwise (so a retry keeps the same payload bytes
    /// and is not refused as an idempotency conflict). Greedy requests and
    /// client seeds are left alone; nothing is echoed to the client.
    pub fn assign_seed(&mut self, idempotency_key: &str) {
        let s = &mut self.job.sampling;
        if s.seed.is_some() || s.temperature <= 0.0 {
            return;
        }
        let h = blake3::derive_key("gcs gateway assigned seed v1", idempotency_key.as_bytes());
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[..8]);
        s.seed = Some(u64::from_le_bytes(b));
    }
}

fn num(body: &Map<String, Value>, k: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match body.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            _ => Err(ApiError::invalid(k, format!("'{k}' must be a number from {lo} to {hi}"))),
        },
    }
}

fn uint(body: &Map<String, Value>, k: &str, lo: u64, hi: u64) -> Result<Option<u64>, ApiError> {
    match body.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            _ => Err(ApiError::invalid(k, format!("'{k}' must be an integer from {lo} to {hi}"))),
        },
    }
}

fn boolean(body: &Map<String, Value>, k: &str) -> Result<bool, ApiError> {
    match body.get(k) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(k, format!("'{k}' must be a boolean"))),
    }
}

fn present(body: &Map<String, Value>, k: &str) -> bool {
    match body.get(k) {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    }
}

/// Parses the body of `POST /v1/chat/completions`, `/v1/completions` or
/// `/v1/embeddings`.
pub fn parse(api_type: ApiType, bytes: &[u8]) -> Result<Parsed, ApiError> {
    let v: Value =
        serde_json::from_slice(bytes).map_err(|e| ApiError::malformed_json(&e.to_string()))?;
    let Value::Object(body) = v else {
        return Err(ApiError::invalid("body", "the request body must be a JSON object"));
    };
    let model = match body.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        None | Some(Value::Null) => return Err(ApiError::missing("model")),
        Some(_) => return Err(ApiError::invalid("model", "'model' must be a non-empty string")),
    };
    let (network, privacy, timeouts, continuation) = gnus_extension(&body)?;
    let ignored = fields::screen(&body, api_type, fields::strict(&body)?)?;
    let common =
        Common { api_type, model, prompt_chars: 0, network, privacy, timeouts, continuation, ignored };
    match api_type {
        ApiType::Embedding => embeddings(&body, common).map(Parsed::Embedding),
        ApiType::ChatCompletion | ApiType::Completion => {
            generation(&body, common).map(Parsed::Generation)
        }
    }
}

fn generation(
    body: &Map<String, Value>,
    mut common: Common,
) -> Result<GenerationRequest, ApiError> {
    let api = common.api_type;
    let (prompt, chars) = if api == ApiType::ChatCompletion {
        let (msgs, chars) = messages(body)?;
        (Prompt::Chat(msgs), chars)
    } else {
        let text = prompt(body)?;
        let chars = text.len();
        (Prompt::Text(text), chars)
    };
    common.prompt_chars = chars;
    let stream = boolean(body, "stream")?;
    let mut include_usage = false;
    match body.get("stream_options") {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::invalid(
                    "stream_options",
                    "'stream_options' is only allowed when 'stream' is true",
                ));
            }
            include_usage = boolean(o, "include_usage").map_err(|_| {
                ApiError::invalid("stream_options.include_usage", "must be a boolean")
            })?;
        }
        Some(_) => return Err(ApiError::invalid("stream_options", "must be an object")),
    }
    let mct = uint(body, "max_completion_tokens", 1, MAX_COMPLETION_TOKENS)?;
    let mt = uint(body, "max_tokens", 1, MAX_COMPLETION_TOKENS)?;
    let max_tokens = mct.or(mt).unwrap_or(DEFAULT_COMPLETION_TOKENS);
    let budget_field = if body.contains_key("max_completion_tokens") {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let mut sampling = sampling(body)?;
    let stop = match body.get("stop") {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a))
            if a.len() <= 4 && a.iter().all(|s| s.as_str().is_some_and(|s| !s.is_empty())) =>
        {
            a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect()
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "'stop' must be a string or an array of up to 4 non-empty strings",
            ))
        }
    };
    sampling.logit_bias = logit_bias(body)?;
    let n = uint(body, "n", 1, MAX_N)?.unwrap_or(1) as u32;
    let top = uint(body, "top_logprobs", 0, 20)?;
    let logprobs = match (api, body.get("logprobs")) {
        (_, None | Some(Value::Null) | Some(Value::Bool(false))) => {
            if top.is_some_and(|t| t > 0) {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "'top_logprobs' needs 'logprobs': true",
                ));
            }
            None
        }
        (ApiType::ChatCompletion, Some(Value::Bool(true))) => Some(top.unwrap_or(0) as u8),
        (ApiType::ChatCompletion, Some(_)) => {
            return Err(ApiError::invalid("logprobs", "'logprobs' must be a boolean"))
        }
        // Legacy completions: `logprobs` is the number of alternatives
        // (OpenAI documents at most 5; the engine gives up to 20, as vLLM).
        (_, Some(_)) => {
            uint(body, "logprobs", 0, crate::validate::MAX_TOP_LOGPROBS.into())?.map(|n| n as u8)
        }
    };
    let constraint = format::response_format(body)?;
    let tools = if api == ApiType::ChatCompletion {
        tools::tools(body, constraint.as_ref())?
    } else {
        None
    };
    if let Some(t) = &tools {
        // The tools are rendered into the prompt.
        common.prompt_chars += t
            .functions
            .iter()
            .map(|f| f.name.len() + f.parameters.len() + f.description.as_ref().map_or(0, String::len))
            .sum::<usize>();
    }
    let job = Generation {
        prompt,
        max_tokens: max_tokens as u32,
        sampling,
        stop,
        logprobs,
        constraint,
        tools,
    };
    Ok(GenerationRequest { common, stream, include_usage, n, budget_field, job })
}

fn sampling(body: &Map<String, Value>) -> Result<Sampling, ApiError> {
    let d = Sampling::default();
    let f = |k: &str, lo: f64, hi: f64, default: f32| -> Result<f32, ApiError> {
        Ok(num(body, k, lo, hi)?.map_or(default, |x| x as f32))
    };
    let temperature = f("temperature", 0.0, 2.0, d.temperature)?;
    let top_p = f("top_p", 0.0, 1.0, d.top_p)?;
    let top_k = uint(body, "top_k", 0, 1_000_000)?.map_or(d.top_k, |k| k as u32);
    let min_p = f("min_p", 0.0, 1.0, d.min_p)?;
    let frequency_penalty = f("frequency_penalty", -2.0, 2.0, d.frequency_penalty)?;
    let presence_penalty = f("presence_penalty", -2.0, 2.0, d.presence_penalty)?;
    let seed = match body.get("seed") {
        None | Some(Value::Null) => None,
        // A negative seed runs as its two's complement.
        Some(v) if v.as_i64().is_some() || v.as_u64().is_some() => {
            v.as_u64().or_else(|| v.as_i64().map(|i| i as u64))
        }
        Some(_) => return Err(ApiError::invalid("seed", "'seed' must be an integer")),
    };
    Ok(Sampling {
        temperature,
        top_p,
        top_k,
        min_p,
        seed,
        frequency_penalty,
        presence_penalty,
        logit_bias: Default::default(),
    })
}

fn logit_bias(body: &Map<String, Value>) -> Result<BTreeMap<u32, f32>, ApiError> {
    match body.get("logit_bias") {
        None | Some(Value::Null) => Ok(BTreeMap::new()),
        Some(Value::Object(o)) => o
            .iter()
            .map(|(k, v)| match (k.parse::<u32>(), v.as_f64()) {
                (Ok(id), Some(x)) if (-100.0..=100.0).contains(&x) => Ok((id, x as f32)),
                _ => Err(ApiError::invalid(
                    "logit_bias",
                    "'logit_bias' maps token ids to numbers from -100 to 100",
                )),
            })
            .collect(),
        Some(_) => Err(ApiError::invalid("logit_bias", "'logit_bias' must be an object")),
    }
}

fn prompt(body: &Map<String, Value>) -> Result<String, ApiError> {
    match body.get("prompt") {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].as_str().is_some_and(|s| !s.is_empty()) => {
            Ok(a[0].as_str().unwrap_or_default().to_string())
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_string) && a.len() > 1 => {
            Err(ApiError::unsupported("prompt", "only one prompt per request is supported"))
        }
        Some(Value::Array(_)) => Err(ApiError::unsupported(
            "prompt",
            "'prompt' must be a non-empty string; token-id prompts are not supported",
        )),
        None | Some(Value::Null) => Err(ApiError::missing("prompt")),
        Some(_) => Err(ApiError::invalid("prompt", "'prompt' must be a non-empty string")),
    }
}

fn embeddings(body: &Map<String, Value>, mut common: Common) -> Result<EmbeddingRequest, ApiError> {
    let inputs: Vec<String> = match body.get("input") {
        Some(Value::String(s)) if !s.is_empty() => vec![s.clone()],
        Some(Value::Array(a))
            if !a.is_empty() && a.iter().all(|s| s.as_str().is_some_and(|s| !s.is_empty())) =>
        {
            if a.len() > MAX_EMBEDDING_INPUTS {
                return Err(ApiError::invalid(
                    "input",
                    format!("at most {MAX_EMBEDDING_INPUTS} inputs per request"),
                ));
            }
            a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect()
        }
        Some(Value::Array(a)) if a.iter().any(|x| x.is_number() || x.is_array()) => {
            return Err(ApiError::unsupported("input", "token-id inputs are not supported"))
        }
        None | Some(Value::Null) => return Err(ApiError::missing("input")),
        Some(_) => {
            return Err(ApiError::invalid(
                "input",
                "'input' must be a non-empty string or an array of non-empty strings",
            ))
        }
    };
    common.prompt_chars = inputs.iter().map(String::len).sum();
    let base64 = match body.get("encoding_format").map(Value::as_str) {
        None | Some(Some("float")) => false,
        Some(Some("base64")) => true,
        _ => {
            return Err(ApiError::invalid(
                "encoding_format",
                "'encoding_format' must be 'float' or 'base64'",
            ))
        }
    };
    Ok(EmbeddingRequest { common, base64, job: Embedding { inputs } })
}

#[cfg(test)]
mod tests;
