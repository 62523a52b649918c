//! OpenAI response JSON, built in this one module: the worker's result
//! body, the gateway's blocking answers and stream chunks, the usage and
//! logprobs objects, and the readers of what a worker's result holds.

use gcs_protocol::{ApiType, FinalResult, Metering, TokenLogprob};
use serde_json::{json, Map, Value};

/// `chat.completion` or `text_completion`.
fn object(api: ApiType) -> &'static str {
    if api == ApiType::ChatCompletion {
        "chat.completion"
    } else {
        "text_completion"
    }
}

/// `chatcmpl-...` / `cmpl-...` from the job id.
pub fn response_id(api: ApiType, job_id: &str) -> String {
    let prefix = if api == ApiType::ChatCompletion { "chatcmpl-" } else { "cmpl-" };
    format!("{prefix}{}", job_id.trim_start_matches(gcs_protocol::ids::JOB))
}

/// The usage object of a generation.
pub fn usage(prompt_tokens: u64, completion_tokens: u64, cached_tokens: u64) -> Value {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens},
           "completion_tokens_details": {"reasoning_tokens": 0}})
}

/// The usage object of a finished request from its metering; a worker that
/// metered no output is billed the tokens the gateway delivered.
pub fn metered_usage(m: Option<&Metering>, completion_fallback: u64) -> Value {
    let m = m.cloned().unwrap_or_default();
    let out = if m.output_tokens == 0 { completion_fallback } else { m.output_tokens };
    usage(m.input_tokens, out, m.cached_tokens)
}

/// OpenAI's chat `logprobs` object for these tokens.
pub fn logprobs(lp: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lp
        .iter()
        .map(|t| {
            let top: Vec<Value> = t
                .top
                .iter()
                .map(|a| json!({"token": a.token, "logprob": a.logprob, "bytes": a.bytes}))
                .collect();
            json!({"token": t.token, "logprob": t.logprob, "bytes": t.bytes, "top_logprobs": top})
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// The legacy completions `logprobs` object for these tokens: parallel
/// `tokens`, `token_logprobs`, `top_logprobs` (token → logprob: the
/// alternatives, and the chosen token, which OpenAI always includes) and
/// `text_offset`. An offset counts the characters of the completion before
/// the token, from `chars` (carried from chunk to chunk of a stream): the
/// UTF-8 lead bytes before it, so a token holding part of a character does
/// not shift the offsets after it.
pub fn legacy_logprobs(lp: &[TokenLogprob], chars: &mut usize) -> Value {
    let (mut tokens, mut values, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for t in lp {
        tokens.push(json!(t.token));
        values.push(json!(t.logprob));
        let mut top = Map::new();
        for a in &t.top {
            top.entry(a.token.clone()).or_insert(json!(a.logprob));
        }
        top.entry(t.token.clone()).or_insert(json!(t.logprob));
        tops.push(Value::Object(top));
        offsets.push(json!(*chars));
        *chars += t.bytes.iter().filter(|&&b| b & 0xC0 != 0x80).count();
    }
    json!({"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
           "text_offset": offsets})
}

/// The `logprobs` object of `api` for these tokens: chat's or the legacy
/// completions' ([`legacy_logprobs`], whose offsets continue from `chars`).
pub fn logprobs_of(api: ApiType, lp: &[TokenLogprob], chars: &mut usize) -> Value {
    if api == ApiType::ChatCompletion {
        logprobs(lp)
    } else {
        legacy_logprobs(lp, chars)
    }
}

/// One choice of a blocking answer; `logprobs` is `null` unless asked for.
pub fn choice(api: ApiType, index: usize, text: &str, logprobs: Value, finish: &str) -> Value {
    if api == ApiType::ChatCompletion {
        json!({"index": index, "message": {"role": "assistant", "content": text, "refusal": null},
               "logprobs": logprobs, "finish_reason": finish})
    } else {
        json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
    }
}

/// One call of an answer, as OpenAI's `message.tool_calls[k]`.
pub fn tool_call(id: &str, name: &str, arguments: &str) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

/// The finish reason of an answer that made calls: `tool_calls` when the
/// model ended it, else what cut it (`length`).
pub fn calls_finish(finish: &str, calls: usize) -> &str {
    if calls > 0 && finish == "stop" {
        "tool_calls"
    } else {
        finish
    }
}

/// One choice of a blocking chat answer to a request with tools: its text
/// read for calls ([`crate::tools::parse`]); without calls, a plain choice.
pub fn tools_choice(
    index: usize,
    text: &str,
    logprobs: Value,
    finish: &str,
    max_calls: usize,
    response_id: &str,
) -> Value {
    let a = crate::tools::parse::answer(text, max_calls);
    if a.calls.is_empty() {
        return choice(ApiType::ChatCompletion, index, &a.content, logprobs, finish);
    }
    let calls: Vec<Value> = a
        .calls
        .iter()
        .enumerate()
        .map(|(k, (name, args))| {
            tool_call(&crate::tools::call_id(response_id, index, k), name, args)
        })
        .collect();
    let content = if a.content.is_empty() { Value::Null } else { json!(a.content) };
    json!({"index": index,
           "message": {"role": "assistant", "content": content, "refusal": null, "tool_calls": calls},
           "logprobs": logprobs, "finish_reason": calls_finish(finish, calls.len())})
}

/// The gateway's blocking answer.
pub fn completion(
    api: ApiType,
    id: &str,
    created_s: u64,
    model: &str,
    choices: Vec<Value>,
    usage: Value,
) -> Value {
    json!({"id": id, "object": object(api), "created": created_s, "model": model,
           "system_fingerprint": null, "choices": choices, "usage": usage})
}

/// The body a worker's result carries for one generated choice: the
/// answer without the gateway's id and timestamps.
pub fn result_body(api: ApiType, model: &str, choice: Value, usage: Value) -> Value {
    json!({"object": object(api), "model": model, "choices": [choice], "usage": usage})
}

/// One entry of an embeddings list (`embedding`: floats or base64).
pub fn embedding(index: usize, embedding: Value) -> Value {
    json!({"object": "embedding", "index": index, "embedding": embedding})
}

/// An embeddings answer (the worker's and the gateway's).
pub fn embedding_list(model: &str, data: Vec<Value>, tokens: u64) -> Value {
    json!({"object": "list", "data": data, "model": model,
           "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
}

/// The finish reason a worker's result states, or `stop`.
pub fn result_finish(r: &FinalResult) -> String {
    r.response
        .as_ref()
        .and_then(|b| b.body.pointer("/choices/0/finish_reason"))
        .and_then(Value::as_str)
        .unwrap_or("stop")
        .to_string()
}

/// The generated text a worker's result holds.
pub fn result_text(r: &FinalResult) -> Option<&str> {
    let b = &r.response.as_ref()?.body;
    b.pointer("/choices/0/message/content").or_else(|| b.pointer("/choices/0/text"))?.as_str()
}

/// The vectors (`data[].embedding`) a worker's result holds, in order.
pub fn result_embeddings(r: &FinalResult) -> Vec<Value> {
    let data = r.response.as_ref().and_then(|b| b.body.get("data")).and_then(Value::as_array);
    data.into_iter().flatten().map(|v| v.get("embedding").cloned().unwrap_or(Value::Null)).collect()
}

/// What every chunk of one stream shares.
#[derive(Clone, Debug)]
pub(crate) struct StreamShape {
    pub api: ApiType,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub include_usage: bool,
    /// Chat `logprobs: true` or a completion's `logprobs: N`: text chunks
    /// carry them.
    pub logprobs: bool,
    /// A request with tools: the text is read for calls, at most this many.
    pub tools: Option<usize>,
}

impl StreamShape {
    /// A chunk of choice `index`: its text (if any), the role on the
    /// first chat chunk, the finish reason on the last.
    pub fn chunk(
        &self,
        index: usize,
        content: Option<&str>,
        role: bool,
        finish: Option<&str>,
        logprobs: Value,
    ) -> Value {
        let choice = if self.api == ApiType::ChatCompletion {
            let mut delta = Map::new();
            if role {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(c) = content {
                delta.insert("content".into(), json!(c));
            }
            json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        } else {
            json!({"index": index, "text": content.unwrap_or(""), "logprobs": logprobs,
                   "finish_reason": finish})
        };
        self.wrap(vec![choice])
    }

    /// A chunk of choice `index` with one tool-call delta (the role on the
    /// first chat chunk): the call's opening (`index`, `id`, `type`, the
    /// name and empty arguments), then its arguments piece by piece.
    pub fn tool_chunk(&self, index: usize, role: bool, call: Value) -> Value {
        let mut delta = Map::new();
        if role {
            delta.insert("role".into(), json!("assistant"));
            delta.insert("content".into(), Value::Null);
        }
        delta.insert("tool_calls".into(), json!([call]));
        self.wrap(vec![json!({"index": index, "delta": delta, "logprobs": null,
                              "finish_reason": null})])
    }

    /// The final usage chunk (no choices), sent when asked for.
    pub fn usage_chunk(&self, usage: Value) -> Value {
        let mut v = self.wrap(vec![]);
        v["usage"] = usage;
        v
    }

    fn wrap(&self, choices: Vec<Value>) -> Value {
        let object = if self.api == ApiType::ChatCompletion {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let mut v = json!({"id": self.id, "object": object, "created": self.created,
                           "model": self.model, "system_fingerprint": null, "choices": choices});
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_totals_and_falls_back_to_delivered_tokens() {
        let m =
            Metering { input_tokens: 5, output_tokens: 0, cached_tokens: 2, ..Default::default() };
        let u = metered_usage(Some(&m), 3);
        assert_eq!(
            (u["completion_tokens"].as_u64(), u["total_tokens"].as_u64()),
            (Some(3), Some(8))
        );
        assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 2);
    }

    #[test]
    fn legacy_logprobs_are_parallel_lists_with_character_offsets() {
        use gcs_protocol::TopLogprob;
        let tok = |s: &str, b: &[u8], lp: f32, top: &[(&str, f32)]| TokenLogprob {
            token: s.into(),
            logprob: lp,
            bytes: b.to_vec(),
            top: top
                .iter()
                .map(|&(t, l)| TopLogprob { token: t.into(), logprob: l, bytes: t.into() })
                .collect(),
        };
        // "é" split over two tokens (each lossy on its own), then " ok".
        let lp = [
            tok("Caf", b"Caf", -0.5, &[("Caf", -0.5), ("The", -1.5)]),
            tok("\u{FFFD}", &[0xC3], -0.25, &[]),
            tok("\u{FFFD}", &[0xA9], -0.125, &[]),
            tok(" ok", b" ok", -2.0, &[("!", -0.375), (".", -1.0)]),
        ];
        let mut chars = 0;
        let v = legacy_logprobs(&lp[..2], &mut chars);
        let w = legacy_logprobs(&lp[2..], &mut chars);
        assert_eq!(v["tokens"], json!(["Caf", "\u{FFFD}"]));
        assert_eq!(v["token_logprobs"], json!([-0.5, -0.25]));
        // "Café ok": the continuation byte adds no character.
        assert_eq!(
            (v["text_offset"].clone(), w["text_offset"].clone()),
            (json!([0, 3]), json!([4, 4]))
        );
        assert_eq!(chars, 7);
        // The chosen token is always among the top ones, once.
        assert_eq!(v["top_logprobs"][0], json!({"Caf": -0.5, "The": -1.5}));
        assert_eq!(w["top_logprobs"][1], json!({"!": -0.375, ".": -1.0, " ok": -2.0}));
        assert_eq!(v["top_logprobs"][1], json!({"\u{FFFD}": -0.25}));
        // Chat keeps its own shape.
        assert!(logprobs_of(ApiType::ChatCompletion, &lp, &mut 0)["content"].is_array());
        let c = choice(ApiType::Completion, 0, "x", w.clone(), "stop");
        assert_eq!(c["logprobs"], w);
    }

    #[test]
    fn chunks_carry_usage_null_only_when_usage_was_asked_for() {
        let mut s = StreamShape {
            api: ApiType::ChatCompletion,
            id: "chatcmpl-1".into(),
            created: 1,
            model: "m".into(),
            include_usage: false,
            logprobs: false,
            tools: None,
        };
        let c = s.chunk(0, Some(""), true, None, Value::Null);
        assert_eq!(c["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
        assert!(c.get("usage").is_none());
        s.include_usage = true;
        assert!(s.chunk(0, None, false, Some("stop"), Value::Null)["usage"].is_null());
        assert_eq!(s.usage_chunk(usage(1, 2, 0))["usage"]["total_tokens"], 3);
    }

    #[test]
    fn an_answer_that_calls_has_null_content_ids_and_finish_tool_calls() {
        let text = crate::tools::call_text("get_weather", r#"{"city": "Paris"}"#);
        let c = tools_choice(1, &text, Value::Null, "stop", 8, "chatcmpl-abc");
        let m = &c["message"];
        assert_eq!(m["content"], Value::Null);
        assert_eq!(c["finish_reason"], "tool_calls");
        let call = &m["tool_calls"][0];
        assert_eq!(call["id"], "call_abc_1_0");
        assert_eq!(call["type"], "function");
        assert_eq!(call["function"]["name"], "get_weather");
        assert_eq!(call["function"]["arguments"], r#"{"city": "Paris"}"#, "a JSON string");
        // Cut by max_tokens: still the call so far, finish length.
        let cut =
            tools_choice(0, &text[..text.len() - 20], Value::Null, "length", 8, "chatcmpl-abc");
        assert_eq!(cut["finish_reason"], "length");
        // No call: a plain text answer.
        let t = tools_choice(0, "Sunny.", Value::Null, "stop", 8, "chatcmpl-abc");
        assert_eq!(
            (t["message"]["content"].as_str(), t["finish_reason"].as_str()),
            (Some("Sunny."), Some("stop"))
        );
        assert!(t["message"].get("tool_calls").is_none());
    }
}
