//! The up-front check of a batch's input file (specs/batch.md,
//! "Validation"): every line is a JSON object with a unique `custom_id`,
//! `method` POST, the batch's `url`, and a `body` that the endpoint's own
//! request parser accepts; a batch with any bad line fails as a whole with
//! the errors of its lines (at most [`MAX_ERRORS`]), as OpenAI's does.

use std::collections::HashSet;

use gcs_protocol::ApiType;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Most line errors kept on a failed batch.
pub const MAX_ERRORS: usize = 100;
/// Longest `custom_id`.
pub const MAX_CUSTOM_ID: usize = 512;

/// One problem of the input (OpenAI's `errors.data[]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineError {
    /// Machine-readable code.
    pub code: String,
    /// Human-readable message.
    pub message: String,
    /// The offending field, if any.
    pub param: Option<String>,
    /// 1-based line number, if the error is about one line.
    pub line: Option<u64>,
}

impl LineError {
    /// An error not about one line.
    pub fn whole(code: &str, message: impl Into<String>) -> Self {
        Self { code: code.into(), message: message.into(), param: None, line: None }
    }
}

/// One request of the batch, ready to run.
#[derive(Clone, Debug, PartialEq)]
pub struct Line {
    /// 1-based line of the input file.
    pub line: u64,
    /// The client's id of the request, copied to its output line.
    pub custom_id: String,
    /// The request body (JSON).
    pub body: Vec<u8>,
    /// Its `model`.
    pub model: String,
}

/// The API of an endpoint a batch may name.
pub fn endpoint_api(endpoint: &str) -> Option<ApiType> {
    match endpoint {
        "/v1/chat/completions" => Some(ApiType::ChatCompletion),
        "/v1/completions" => Some(ApiType::Completion),
        "/v1/embeddings" => Some(ApiType::Embedding),
        _ => None,
    }
}

fn line_error(line: u64, code: &str, param: Option<&str>, message: impl Into<String>) -> LineError {
    LineError {
        code: code.into(),
        message: message.into(),
        param: param.map(str::to_string),
        line: Some(line),
    }
}

fn check_line(no: u64, raw: &[u8], endpoint: &str, api: ApiType) -> Result<Line, LineError> {
    let v: Value = serde_json::from_slice(raw).map_err(|e| {
        line_error(no, "invalid_json_line", None, format!("line {no} is not valid JSON: {e}"))
    })?;
    let Value::Object(o) = v else {
        return Err(line_error(no, "invalid_json_line", None, "each line must be a JSON object"));
    };
    let custom_id = match o.get("custom_id") {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_CUSTOM_ID => s.clone(),
        Some(Value::String(_)) => {
            return Err(line_error(
                no,
                "invalid_custom_id",
                Some("custom_id"),
                format!("'custom_id' must be 1 to {MAX_CUSTOM_ID} bytes"),
            ))
        }
        _ => {
            return Err(line_error(
                no,
                "missing_required_parameter",
                Some("custom_id"),
                "each line needs a string 'custom_id'",
            ))
        }
    };
    if o.get("method").and_then(Value::as_str) != Some("POST") {
        return Err(line_error(no, "invalid_method", Some("method"), "'method' must be \"POST\""));
    }
    let url = o.get("url").and_then(Value::as_str).unwrap_or_default();
    if url != endpoint {
        return Err(line_error(
            no,
            "mismatched_endpoint",
            Some("url"),
            format!("the line's url '{url}' is not the batch's endpoint '{endpoint}'"),
        ));
    }
    let Some(body @ Value::Object(b)) = o.get("body") else {
        return Err(line_error(no, "invalid_body", Some("body"), "'body' must be a JSON object"));
    };
    if b.get("stream").and_then(Value::as_bool) == Some(true) {
        return Err(line_error(
            no,
            "unsupported_parameter",
            Some("body.stream"),
            "a batch request cannot stream",
        ));
    }
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let parsed = crate::request::parse(api, &bytes).map_err(|e| {
        let param = e.param.map(|p| format!("body.{p}"));
        line_error(no, "invalid_request", param.as_deref(), e.message)
    })?;
    let model = parsed.common().model.clone();
    Ok(Line { line: no, custom_id, body: bytes, model })
}

/// The lines of `input` for `endpoint`, or every error found (at most
/// [`MAX_ERRORS`]). Blank lines are skipped (line numbers still count them).
pub fn lines(input: &[u8], endpoint: &str) -> Result<Vec<Line>, Vec<LineError>> {
    let Some(api) = endpoint_api(endpoint) else {
        return Err(vec![LineError::whole(
            "invalid_endpoint",
            format!("unknown endpoint '{endpoint}'"),
        )]);
    };
    let (mut out, mut errors, mut ids) = (vec![], vec![], HashSet::new());
    for (i, raw) in input.split(|&b| b == b'\n').enumerate() {
        if raw.trim_ascii().is_empty() {
            continue;
        }
        let no = i as u64 + 1;
        match check_line(no, raw, endpoint, api) {
            Ok(l) if !ids.insert(l.custom_id.clone()) => errors.push(line_error(
                no,
                "duplicate_custom_id",
                Some("custom_id"),
                format!("the custom_id '{}' is used by an earlier line", l.custom_id),
            )),
            Ok(l) => out.push(l),
            Err(e) => errors.push(e),
        }
        if errors.len() >= MAX_ERRORS {
            break;
        }
    }
    if out.is_empty() && errors.is_empty() {
        errors.push(LineError::whole("empty_file", "the input file holds no requests"));
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

/// Errors for the lines whose model `known` does not know.
pub fn models(lines: &[Line], known: impl Fn(&str) -> bool) -> Vec<LineError> {
    lines
        .iter()
        .filter(|l| !known(&l.model))
        .take(MAX_ERRORS)
        .map(|l| LineError {
            code: "model_not_found".into(),
            message: format!("The model '{}' does not exist or no node serves it.", l.model),
            param: Some("body.model".into()),
            line: Some(l.line),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn chat(id: &str) -> String {
        serde_json::json!({"custom_id": id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gnus-auto", "max_tokens": 4,
                     "messages": [{"role": "user", "content": "hi"}]}})
        .to_string()
    }

    #[test]
    fn good_lines_are_read_in_order() {
        let input = format!("{}\n\n{}\n", chat("a"), chat("b"));
        let l = lines(input.as_bytes(), "/v1/chat/completions").unwrap();
        assert_eq!(l.iter().map(|l| l.custom_id.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(l[0].model, "gnus-auto");
        let body: Value = serde_json::from_slice(&l[0].body).unwrap();
        assert_eq!(body["max_tokens"], 4);
    }

    #[test]
    fn every_bad_line_is_named() {
        let wrong_url = chat("c").replace("/v1/chat/completions", "/v1/embeddings");
        let streaming = chat("d").replace("\"max_tokens\":4", "\"max_tokens\":4,\"stream\":true");
        let no_model = chat("e").replace("\"model\":\"gnus-auto\",", "");
        let get = chat("f").replace("POST", "GET");
        let input = [
            chat("a"),
            "{not json".into(),
            chat("a"),
            wrong_url,
            streaming,
            no_model,
            get,
            r#"{"method":"POST"}"#.into(),
        ]
        .join("\n");
        let e = lines(input.as_bytes(), "/v1/chat/completions").unwrap_err();
        let got: Vec<(&str, u64)> = e.iter().map(|e| (e.code.as_str(), e.line.unwrap())).collect();
        assert_eq!(
            got,
            [
                ("invalid_json_line", 2),
                ("duplicate_custom_id", 3),
                ("mismatched_endpoint", 4),
                ("unsupported_parameter", 5),
                ("invalid_request", 6),
                ("invalid_method", 7),
                ("missing_required_parameter", 8),
            ]
        );
        assert_eq!(e[4].param.as_deref(), Some("body.model"));
    }

    #[test]
    fn errors_are_bounded_and_empty_files_fail() {
        let input = "x\n".repeat(MAX_ERRORS * 3);
        assert_eq!(lines(input.as_bytes(), "/v1/embeddings").unwrap_err().len(), MAX_ERRORS);
        assert_eq!(lines(b"\n \n", "/v1/embeddings").unwrap_err()[0].code, "empty_file");
        assert_eq!(lines(b"", "/v1/files").unwrap_err()[0].code, "invalid_endpoint");
    }

    #[test]
    fn unknown_models_are_errors_of_their_request() {
        let input = format!("{}\n\n{}", chat("a"), chat("b").replace("gnus-auto", "nope"));
        let l = lines(input.as_bytes(), "/v1/chat/completions").unwrap();
        let e = models(&l, |m| m == "gnus-auto");
        assert_eq!(e.len(), 1);
        assert_eq!((e[0].code.as_str(), e[0].line), ("model_not_found", Some(3)));
    }
}
