//! Which OpenAI fields GCS honours, ignores or refuses (26.15.2: "tolerate
//! unsupported OpenAI fields by ignoring them unless strict compatibility
//! mode is enabled"). A field listed as ignored, and any field this table
//! does not know, is dropped with a debug log — unless the request sets
//! `gnus.strict: true`, when it is a 400 `unsupported_parameter` naming
//! it. Fields whose loss would change what the client reads as input
//! (image parts, token-id prompts) or weaken a guarantee it asked GCS for
//! (`gnus.routing`, `gnus.privacy_mode`) are refused either way, by the
//! parser that reads them. The table is specs/gateway.md "Field table".

use gcs_protocol::ApiType;
use serde_json::{Map, Value};

use super::present;
use crate::error::ApiError;

/// Chat fields the worker applies (or that need nothing: `user`).
const CHAT: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "n",
    "stream",
    "stream_options",
    "user",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "gnus",
];
/// Legacy completion fields applied.
const COMPLETION: &[&str] = &[
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "n",
    "stream",
    "stream_options",
    "user",
    "logprobs",
    "response_format",
    "gnus",
];
/// Embeddings fields applied.
const EMBEDDING: &[&str] = &["model", "input", "encoding_format", "user", "gnus"];

/// Fields that are applied only with their no-op value; another value is
/// one GCS cannot honour (ignored, or refused under `gnus.strict`).
fn honoured_as_default(api: ApiType, k: &str, v: &Value) -> bool {
    match (api, k) {
        (_, "modalities") => v.as_array().is_some_and(|m| m.iter().all(|x| x == "text")),
        (ApiType::Completion, "echo") => v == &Value::Bool(false),
        (ApiType::Completion, "best_of") => v.as_u64() == Some(1),
        (ApiType::Completion, "suffix") => v.as_str().is_some_and(str::is_empty),
        _ => false,
    }
}

/// Whether the body asks for strict compatibility (`gnus.strict`).
pub(super) fn strict(body: &Map<String, Value>) -> Result<bool, ApiError> {
    match body.get("gnus").and_then(|g| g.get("strict")) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid("gnus.strict", "'gnus.strict' must be a boolean")),
    }
}

/// The fields of `body` GCS will not honour, in body order; under `strict`
/// the first is a 400 naming it.
pub(super) fn screen(
    body: &Map<String, Value>,
    api: ApiType,
    strict: bool,
) -> Result<Vec<String>, ApiError> {
    let known = match api {
        ApiType::ChatCompletion => CHAT,
        ApiType::Completion => COMPLETION,
        ApiType::Embedding => EMBEDDING,
    };
    let mut ignored = vec![];
    for (k, v) in body {
        if known.contains(&k.as_str()) || v.is_null() || honoured_as_default(api, k, v) {
            continue;
        }
        // An empty list or object asks for nothing.
        if !present(body, k) && (v.is_array() || v.is_object()) {
            continue;
        }
        if strict {
            return Err(ApiError::unsupported(
                k,
                format!(
                    "'{k}' is not supported (gnus.strict is set, so it is refused, not ignored)"
                ),
            ));
        }
        ignored.push(k.clone());
    }
    if !ignored.is_empty() {
        tracing::debug!(?ignored, "request fields ignored");
    }
    Ok(ignored)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn what_cannot_be_honoured_is_ignored_or_under_strict_refused_by_name() {
        let b = body(json!({"model": "m", "messages": [], "audio": {"voice": "x"},
            "prediction": {"type": "content"}, "store": true, "metadata": {},
            "modalities": ["text", "audio"], "some_future_field": 1}));
        let mut ig = screen(&b, ApiType::ChatCompletion, false).unwrap();
        ig.sort();
        // `metadata: {}` asks for nothing.
        assert_eq!(ig, ["audio", "modalities", "prediction", "some_future_field", "store"]);
        let e = screen(&b, ApiType::ChatCompletion, true).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        assert!(ig.contains(&e.param.clone().unwrap()), "{e}");
        assert_eq!(e.code, "unsupported_parameter");
    }

    #[test]
    fn the_no_op_value_of_a_field_is_honoured_even_under_strict() {
        let b = body(json!({"model": "m", "prompt": "x", "echo": false, "best_of": 1,
            "suffix": "", "logprobs": false, "modalities": ["text"], "user": "u"}));
        assert!(screen(&b, ApiType::Completion, true).unwrap().is_empty());
        let b = body(json!({"model": "m", "prompt": "x", "echo": true}));
        assert_eq!(
            screen(&b, ApiType::Completion, true).unwrap_err().param.as_deref(),
            Some("echo")
        );
        let b = body(json!({"model": "e", "input": "x", "dimensions": 64}));
        assert_eq!(screen(&b, ApiType::Embedding, false).unwrap(), ["dimensions"]);
        // Chat honours tools and response_format; embeddings do not have them.
        let b =
            body(json!({"model": "m", "messages": [], "tools": [1], "parallel_tool_calls": true}));
        assert!(screen(&b, ApiType::ChatCompletion, true).unwrap().is_empty());
    }

    #[test]
    fn gnus_strict_must_be_a_boolean() {
        assert!(strict(&body(json!({"gnus": {"strict": true}}))).unwrap());
        assert!(!strict(&body(json!({}))).unwrap());
        let e = strict(&body(json!({"gnus": {"strict": "yes"}}))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("gnus.strict"));
    }
}
