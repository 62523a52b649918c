//! Tool calling (issue 19): the one text format a call is generated in,
//! the grammar that holds the model to it, the prompt that tells a model
//! whose chat template knows no tools about it ([`render`]), and the
//! reader that turns the generated text back into OpenAI `tool_calls`
//! ([`parse`]).
//!
//! The format is Hermes / Qwen 2.5's, one block per call:
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! (several calls: blocks separated by one `\n`). The worker generates
//! text under [`grammar`]; the gateway reads the calls out of that signed
//! text, so the text stays the one source of truth and a worker cannot
//! sign calls that differ from what it generated.

pub mod grammar;
pub mod parse;
pub mod render;

/// Opens one call.
pub const OPEN: &str = "<tool_call>";
/// Closes one call.
pub const CLOSE: &str = "</tool_call>";
/// Wraps a tool's result in the fallback prompt.
pub const RESPONSE_OPEN: &str = "<tool_response>";
/// Closes a tool's result.
pub const RESPONSE_CLOSE: &str = "</tool_response>";

/// The text of one call, exactly as the grammar has the model write it
/// (also how an earlier turn's calls are shown in the fallback prompt).
pub fn call_text(name: &str, arguments: &str) -> String {
    let name = serde_json::Value::String(name.to_string());
    format!("{OPEN}\n{{\"name\": {name}, \"arguments\": {arguments}}}\n{CLOSE}")
}

/// The `id` of call `k` of choice `choice` in the answer `response_id`
/// (`chatcmpl-…`): the same in a stream and in a blocking answer, and
/// unique across requests because the response id is.
pub fn call_id(response_id: &str, choice: usize, k: usize) -> String {
    let base = response_id.trim_start_matches("chatcmpl-");
    format!("call_{base}_{choice}_{k}")
}
