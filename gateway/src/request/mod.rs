//! OpenAI request bodies: parsed, validated and normalised before a job is
//! built. Every field we accept is either applied (by the worker) or
//! rejected with an `invalid_request_error` naming it; unknown fields are
//! ignored, as OpenAI clients expect.

use gcs_protocol::{ApiType, PrivacyLevel, RoutingMode};
use serde_json::{Map, Value};

use crate::error::ApiError;

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

/// A validated request.
#[derive(Clone, Debug)]
pub struct Parsed {
    /// API surface.
    pub api_type: ApiType,
    /// Requested model or alias.
    pub model: String,
    /// SSE or one JSON body.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Completion budget (chat and completions).
    pub max_tokens: u64,
    /// Choices to generate (`n`; each is its own job, so they may run on
    /// different workers).
    pub n: u32,
    /// Characters of prompt text, for the admission estimate.
    pub prompt_chars: usize,
    /// Routing mode (`gnus.network`, default public).
    pub network: RoutingMode,
    /// Privacy (`gnus.privacy_mode`, default standard).
    pub privacy: PrivacyLevel,
    /// Timeout overrides.
    pub timeouts: TimeoutOverrides,
    /// Embedding inputs, in order.
    pub inputs: Vec<String>,
    /// `encoding_format: base64`.
    pub base64: bool,
    /// The body as it goes to the worker.
    pub body: Map<String, Value>,
    /// Chat `logprobs: true`: each choice carries `logprobs.content`.
    pub logprobs: bool,
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
    let (network, privacy, timeouts) = gnus_extension(&body)?;
    let mut p = Parsed {
        api_type,
        model,
        stream: false,
        include_usage: false,
        max_tokens: 0,
        n: 1,
        prompt_chars: 0,
        network,
        privacy,
        timeouts,
        inputs: vec![],
        base64: false,
        body: Map::new(),
        logprobs: false,
    };
    match api_type {
        ApiType::Embedding => embeddings(&body, &mut p)?,
        ApiType::ChatCompletion | ApiType::Completion => generation(&body, &mut p)?,
    }
    p.body = body;
    Ok(p)
}

fn generation(body: &Map<String, Value>, p: &mut Parsed) -> Result<(), ApiError> {
    if p.api_type == ApiType::ChatCompletion {
        p.prompt_chars = messages(body)?;
    } else {
        p.prompt_chars = prompt(body)?;
    }
    p.stream = boolean(body, "stream")?;
    match body.get("stream_options") {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => {
            if !p.stream {
                return Err(ApiError::invalid(
                    "stream_options",
                    "'stream_options' is only allowed when 'stream' is true",
                ));
            }
            p.include_usage = boolean(o, "include_usage").map_err(|_| {
                ApiError::invalid("stream_options.include_usage", "must be a boolean")
            })?;
        }
        Some(_) => return Err(ApiError::invalid("stream_options", "must be an object")),
    }
    let mct = uint(body, "max_completion_tokens", 1, MAX_COMPLETION_TOKENS)?;
    let mt = uint(body, "max_tokens", 1, MAX_COMPLETION_TOKENS)?;
    p.max_tokens = mct.or(mt).unwrap_or(DEFAULT_COMPLETION_TOKENS);
    num(body, "temperature", 0.0, 2.0)?;
    num(body, "top_p", 0.0, 1.0)?;
    uint(body, "top_k", 0, 1_000_000)?;
    num(body, "min_p", 0.0, 1.0)?;
    num(body, "frequency_penalty", -2.0, 2.0)?;
    num(body, "presence_penalty", -2.0, 2.0)?;
    match body.get("seed") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_i64().is_some() || v.as_u64().is_some() => {}
        Some(_) => return Err(ApiError::invalid("seed", "'seed' must be an integer")),
    }
    match body.get("stop") {
        None | Some(Value::Null) => {}
        Some(Value::String(_)) => {}
        Some(Value::Array(a))
            if a.len() <= 4 && a.iter().all(|s| s.as_str().is_some_and(|s| !s.is_empty())) => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "'stop' must be a string or an array of up to 4 non-empty strings",
            ))
        }
    }
    match body.get("logit_bias") {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => {
            for (k, v) in o {
                if k.parse::<u32>().is_err()
                    || !v.as_f64().is_some_and(|x| (-100.0..=100.0).contains(&x))
                {
                    return Err(ApiError::invalid(
                        "logit_bias",
                        "'logit_bias' maps token ids to numbers from -100 to 100",
                    ));
                }
            }
        }
        Some(_) => return Err(ApiError::invalid("logit_bias", "'logit_bias' must be an object")),
    }
    p.n = uint(body, "n", 1, MAX_N)?.unwrap_or(1) as u32;
    let top = uint(body, "top_logprobs", 0, 20)?;
    match (p.api_type, body.get("logprobs")) {
        (_, None | Some(Value::Null) | Some(Value::Bool(false))) => {
            if top.is_some_and(|t| t > 0) {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "'top_logprobs' needs 'logprobs': true",
                ));
            }
        }
        (ApiType::ChatCompletion, Some(Value::Bool(true))) => p.logprobs = true,
        (ApiType::ChatCompletion, Some(_)) => {
            return Err(ApiError::invalid("logprobs", "'logprobs' must be a boolean"))
        }
        // The legacy shape (token_logprobs, text_offset) is not produced.
        (_, Some(_)) => {
            return Err(ApiError::unsupported(
                "logprobs",
                "log probabilities are served on /v1/chat/completions only",
            ))
        }
    }
    for k in ["tools", "functions", "audio", "prediction", "web_search_options"] {
        if present(body, k) {
            return Err(ApiError::unsupported(k, format!("'{k}' is not supported by any node")));
        }
    }
    if let Some(tc) = body.get("tool_choice") {
        if !matches!(tc.as_str(), Some("none") | Some("auto") | None) || tc.is_object() {
            return Err(ApiError::unsupported("tool_choice", "no tools are available"));
        }
    }
    if let Some(rf) = body.get("response_format").filter(|v| !v.is_null()) {
        if rf.get("type").and_then(Value::as_str) != Some("text") {
            return Err(ApiError::unsupported(
                "response_format",
                "only response_format {\"type\": \"text\"} is supported",
            ));
        }
    }
    if let Some(m) = body.get("modalities").and_then(Value::as_array) {
        if m.iter().any(|x| x.as_str() != Some("text")) {
            return Err(ApiError::unsupported("modalities", "only text output is supported"));
        }
    }
    if p.api_type == ApiType::Completion {
        if boolean(body, "echo")? {
            return Err(ApiError::unsupported("echo", "'echo' is not supported"));
        }
        if uint(body, "best_of", 1, 20)?.is_some_and(|b| b != 1) {
            return Err(ApiError::unsupported("best_of", "only best_of = 1 is supported"));
        }
        if body.get("suffix").and_then(Value::as_str).is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::unsupported("suffix", "'suffix' is not supported"));
        }
    }
    Ok(())
}

/// Validates `messages`; returns the characters of text they hold.
fn messages(body: &Map<String, Value>) -> Result<usize, ApiError> {
    let msgs = match body.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        None | Some(Value::Null) => return Err(ApiError::missing("messages")),
        Some(_) => {
            return Err(ApiError::invalid("messages", "'messages' must be a non-empty array"))
        }
    };
    let mut chars = 0;
    for (i, m) in msgs.iter().enumerate() {
        let at = |s: &str| format!("messages[{i}]{s}");
        let Some(o) = m.as_object() else {
            return Err(ApiError::invalid(&at(""), "each message must be an object"));
        };
        match o.get("role").and_then(Value::as_str) {
            Some("system" | "developer" | "user") => {}
            Some("assistant") => {
                if present(o, "tool_calls") || present(o, "function_call") || present(o, "audio") {
                    return Err(ApiError::unsupported(
                        &at(".tool_calls"),
                        "tool calls are not supported by any node",
                    ));
                }
            }
            Some(r @ ("tool" | "function")) => {
                return Err(ApiError::unsupported(
                    &at(".role"),
                    format!("role '{r}' needs tool support, which no node has"),
                ))
            }
            Some(r) => {
                return Err(ApiError::invalid(
                    &at(".role"),
                    format!("unknown role '{r}': use system, developer, user or assistant"),
                ))
            }
            None => return Err(ApiError::missing(&at(".role"))),
        }
        match o.get("content") {
            Some(Value::String(s)) => chars += s.len(),
            // An assistant turn may have no content (OpenAI allows null).
            None | Some(Value::Null)
                if o.get("role").and_then(Value::as_str) == Some("assistant") => {}
            Some(Value::Array(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    let pat = at(&format!(".content[{j}]"));
                    match (part.get("type").and_then(Value::as_str), part.get("text")) {
                        (Some("text"), Some(Value::String(t))) => chars += t.len(),
                        (Some("text"), _) => {
                            return Err(ApiError::invalid(
                                &pat,
                                "a text part needs a 'text' string",
                            ))
                        }
                        (Some(t), _) => {
                            return Err(ApiError::unsupported(
                                &format!("{pat}.type"),
                                format!("content parts of type '{t}' are not supported; only text"),
                            ))
                        }
                        (None, _) => return Err(ApiError::missing(&format!("{pat}.type"))),
                    }
                }
            }
            None | Some(Value::Null) => return Err(ApiError::missing(&at(".content"))),
            Some(_) => {
                return Err(ApiError::invalid(
                    &at(".content"),
                    "content must be a string or an array of text parts",
                ))
            }
        }
    }
    Ok(chars)
}

fn prompt(body: &Map<String, Value>) -> Result<usize, ApiError> {
    match body.get("prompt") {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.len()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].as_str().is_some_and(|s| !s.is_empty()) => {
            Ok(a[0].as_str().map_or(0, str::len))
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

fn embeddings(body: &Map<String, Value>, p: &mut Parsed) -> Result<(), ApiError> {
    p.inputs = match body.get("input") {
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
    p.prompt_chars = p.inputs.iter().map(String::len).sum();
    p.base64 = match body.get("encoding_format").map(Value::as_str) {
        None | Some(Some("float")) => false,
        Some(Some("base64")) => true,
        _ => {
            return Err(ApiError::invalid(
                "encoding_format",
                "'encoding_format' must be 'float' or 'base64'",
            ))
        }
    };
    if present(body, "dimensions") {
        return Err(ApiError::unsupported("dimensions", "'dimensions' is not supported"));
    }
    Ok(())
}

fn parse_enum<T: Copy + std::fmt::Display>(all: &[T], s: &str) -> Option<T> {
    all.iter().copied().find(|v| v.to_string() == s)
}

type Extension = (RoutingMode, PrivacyLevel, TimeoutOverrides);

/// The `gnus` extension object (26.15.4).
fn gnus_extension(body: &Map<String, Value>) -> Result<Extension, ApiError> {
    let mut out = (RoutingMode::Public, PrivacyLevel::Standard, TimeoutOverrides::default());
    let g = match body.get("gnus") {
        None | Some(Value::Null) => return Ok(out),
        Some(Value::Object(g)) => g,
        Some(_) => return Err(ApiError::invalid("gnus", "'gnus' must be an object")),
    };
    if let Some(n) = g.get("network").filter(|v| !v.is_null()) {
        let s = n.as_str().unwrap_or_default();
        out.0 = match s {
            "public" => RoutingMode::Public,
            "private" => RoutingMode::Private,
            "hybrid" => RoutingMode::Hybrid,
            "local" | "local_only" => RoutingMode::LocalOnly,
            _ => {
                return Err(ApiError::invalid(
                    "gnus.network",
                    "'gnus.network' must be public, private, hybrid or local_only",
                ))
            }
        };
    }
    if let Some(pm) = g.get("privacy_mode").filter(|v| !v.is_null()) {
        let s = pm.as_str().unwrap_or_default();
        out.1 = match s {
            // The spec's example calls the private-pool level "enterprise".
            "enterprise" => PrivacyLevel::PrivatePool,
            _ => parse_enum(PrivacyLevel::ALL, s).ok_or_else(|| {
                ApiError::invalid("gnus.privacy_mode", format!("unknown privacy mode '{s}'"))
            })?,
        };
        if matches!(out.1, PrivacyLevel::EncryptedPayload | PrivacyLevel::MetadataMinimized) {
            return Err(ApiError::unsupported(
                "gnus.privacy_mode",
                format!("privacy mode '{s}' is not supported yet"),
            ));
        }
    }
    if let Some(r) = g.get("routing").and_then(Value::as_object) {
        if r.get("claim_policy").and_then(Value::as_str).is_some_and(|c| c != "first_valid_claim") {
            return Err(ApiError::unsupported(
                "gnus.routing.claim_policy",
                "only first_valid_claim is supported",
            ));
        }
        if r.get("replication_factor").is_some_and(|x| x.as_u64() != Some(1)) {
            return Err(ApiError::unsupported(
                "gnus.routing.replication_factor",
                "only replication_factor 1 is supported",
            ));
        }
        if r.get("verification_mode").and_then(Value::as_str).is_some_and(|c| c != "none") {
            return Err(ApiError::unsupported(
                "gnus.routing.verification_mode",
                "only verification_mode none is supported",
            ));
        }
    }
    if present(g, "retrieval") {
        return Err(ApiError::unsupported("gnus.retrieval", "no retrieval nodes are available"));
    }
    if let Some(l) = g.get("limits").and_then(Value::as_object) {
        let ms = |k: &str| {
            uint(l, k, 100, 3_600_000).map_err(|_| {
                ApiError::invalid(
                    &format!("gnus.limits.{k}"),
                    "must be milliseconds from 100 to 3600000",
                )
            })
        };
        out.2 = TimeoutOverrides {
            first_token_ms: ms("first_token_timeout_ms")?,
            idle_ms: ms("idle_stream_timeout_ms")?,
            wall_ms: ms("wall_timeout_ms")?,
        };
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn chat(v: Value) -> Result<Parsed, ApiError> {
        parse(ApiType::ChatCompletion, &serde_json::to_vec(&v).unwrap())
    }

    #[test]
    fn a_plain_chat_request_parses() {
        let p = chat(json!({"model": "gnus-auto", "messages": [{"role": "user", "content": "hi"}],
                            "stream": true, "stream_options": {"include_usage": true},
                            "max_tokens": 7, "some_future_field": 1}))
        .unwrap();
        assert!(p.stream && p.include_usage);
        assert_eq!((p.max_tokens, p.prompt_chars), (7, 2));
    }

    #[test]
    fn max_completion_tokens_wins_over_max_tokens() {
        let p = chat(json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                            "max_tokens": 7, "max_completion_tokens": 9}))
        .unwrap();
        assert_eq!(p.max_tokens, 9);
    }

    #[test]
    fn what_cannot_be_honoured_is_rejected_naming_the_param() {
        let m = json!([{"role": "user", "content": "x"}]);
        let cases = [
            (json!({"messages": m}), "model"),
            (json!({"model": "m"}), "messages"),
            (json!({"model": "m", "messages": []}), "messages"),
            (json!({"model": "m", "messages": m, "temperature": 3}), "temperature"),
            (json!({"model": "m", "messages": m, "n": 9}), "n"),
            (json!({"model": "m", "messages": m, "stop": [1]}), "stop"),
            (json!({"model": "m", "messages": m, "logit_bias": {"x": 1}}), "logit_bias"),
            (json!({"model": "m", "messages": m, "tools": [{"type": "function"}]}), "tools"),
            (
                json!({"model": "m", "messages": m, "stream_options": {"include_usage": true}}),
                "stream_options",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"model": "m", "messages": [{"role": "tool", "content": "x"}]}),
                "messages[0].role",
            ),
            (json!({"model": "m", "messages": m, "gnus": {"network": "moon"}}), "gnus.network"),
            (
                json!({"model": "m", "messages": m, "response_format": {"type": "json_object"}}),
                "response_format",
            ),
        ];
        for (body, param) in cases {
            let e = chat(body.clone()).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
        }
    }

    #[test]
    fn malformed_json_is_a_400() {
        let e = parse(ApiType::ChatCompletion, b"{\"model\":").unwrap_err();
        assert_eq!((e.status.as_u16(), e.code.as_str()), (400, "invalid_json"));
    }

    #[test]
    fn embeddings_take_strings_or_arrays_of_strings() {
        let p = parse(ApiType::Embedding, br#"{"model":"e","input":["a","bc"]}"#).unwrap();
        assert_eq!(p.inputs, vec!["a", "bc"]);
        let e = parse(ApiType::Embedding, br#"{"model":"e","input":[[1,2]]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input"));
        let p =
            parse(ApiType::Embedding, br#"{"model":"e","input":"x","encoding_format":"base64"}"#)
                .unwrap();
        assert!(p.base64);
    }

    #[test]
    fn the_gnus_extension_sets_routing_and_timeouts() {
        let p = chat(json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
            "gnus": {"network": "hybrid", "privacy_mode": "enterprise",
                     "routing": {"claim_policy": "first_valid_claim", "replication_factor": 1},
                     "limits": {"max_cost_gnus": "auto", "wall_timeout_ms": 5000}}}))
        .unwrap();
        assert_eq!(p.network, RoutingMode::Hybrid);
        assert_eq!(p.privacy, PrivacyLevel::PrivatePool);
        assert_eq!(p.timeouts.wall_ms, Some(5000));
    }
}
