//! `messages`: roles, text content, and the tool turns (assistant
//! `tool_calls`, `tool` results naming their `tool_call_id`).

use serde_json::{Map, Value};

use super::present;
use super::tools::valid_name;
use crate::error::ApiError;
use crate::payload::{Message, Role, ToolCall, MAX_PARALLEL_CALLS};

/// Longest `tool_call_id` (ours are far shorter; a client's may be its own).
const MAX_CALL_ID: usize = 256;

/// Validates `messages`; returns them typed, and the characters of text
/// they hold (calls' names and arguments included: they are prompt too).
pub(super) fn messages(body: &Map<String, Value>) -> Result<(Vec<Message>, usize), ApiError> {
    let msgs = match body.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        None | Some(Value::Null) => return Err(ApiError::missing("messages")),
        Some(_) => {
            return Err(ApiError::invalid("messages", "'messages' must be a non-empty array"))
        }
    };
    let mut chars = 0;
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let at = |s: &str| format!("messages[{i}]{s}");
        let Some(o) = m.as_object() else {
            return Err(ApiError::invalid(&at(""), "each message must be an object"));
        };
        let role = match o.get("role").and_then(Value::as_str) {
            Some("system" | "developer") => Role::System,
            Some("user") => Role::User,
            Some("assistant") => {
                if present(o, "function_call") || present(o, "audio") {
                    let k = if present(o, "audio") { ".audio" } else { ".function_call" };
                    return Err(ApiError::unsupported(
                        &at(k),
                        "use tool_calls; legacy function_call and audio turns are not supported",
                    ));
                }
                Role::Assistant
            }
            Some("tool") => Role::Tool,
            Some("function") => {
                return Err(ApiError::unsupported(
                    &at(".role"),
                    "the legacy 'function' role is not supported; use 'tool'",
                ))
            }
            Some(r) => {
                return Err(ApiError::invalid(
                    &at(".role"),
                    format!("unknown role '{r}': use system, developer, user, assistant or tool"),
                ))
            }
            None => return Err(ApiError::missing(&at(".role"))),
        };
        let tool_calls =
            if role == Role::Assistant { calls(o, &at(".tool_calls"))? } else { vec![] };
        let content = match o.get("content") {
            Some(Value::String(s)) => s.clone(),
            // An assistant turn may have no content (OpenAI allows null).
            None | Some(Value::Null) if role == Role::Assistant => String::new(),
            Some(Value::Array(parts)) => text_parts(parts, &at)?,
            None | Some(Value::Null) => return Err(ApiError::missing(&at(".content"))),
            Some(_) => {
                return Err(ApiError::invalid(
                    &at(".content"),
                    "content must be a string or an array of text parts",
                ))
            }
        };
        let tool_call_id = if role == Role::Tool {
            match o.get("tool_call_id") {
                Some(Value::String(id)) if !id.is_empty() && id.len() <= MAX_CALL_ID => {
                    Some(id.clone())
                }
                None | Some(Value::Null) => return Err(ApiError::missing(&at(".tool_call_id"))),
                Some(_) => {
                    return Err(ApiError::invalid(
                        &at(".tool_call_id"),
                        format!("must be a string of 1 to {MAX_CALL_ID} bytes"),
                    ))
                }
            }
        } else {
            None
        };
        chars += content.len()
            + tool_calls.iter().map(|c| c.name.len() + c.arguments.len()).sum::<usize>();
        out.push(Message { role, content, tool_calls, tool_call_id });
    }
    Ok((out, chars))
}

fn text_parts(parts: &[Value], at: &dyn Fn(&str) -> String) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let pat = at(&format!(".content[{j}]"));
        match (part.get("type").and_then(Value::as_str), part.get("text")) {
            (Some("text"), Some(Value::String(t))) => text.push_str(t),
            (Some("text"), _) => {
                return Err(ApiError::invalid(&pat, "a text part needs a 'text' string"))
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
    Ok(text)
}

/// An assistant turn's `tool_calls`.
fn calls(o: &Map<String, Value>, pat: &str) -> Result<Vec<ToolCall>, ApiError> {
    let a = match o.get("tool_calls") {
        None | Some(Value::Null) => return Ok(vec![]),
        // More calls than one answer of ours can make is still a client's
        // history; bounded like `tools`.
        Some(Value::Array(a)) if a.len() <= 16 * usize::from(MAX_PARALLEL_CALLS) => a,
        Some(_) => {
            return Err(ApiError::invalid(
                pat,
                "'tool_calls' must be an array of at most 128 calls",
            ))
        }
    };
    a.iter()
        .enumerate()
        .map(|(j, c)| {
            let at = |s: &str| format!("{pat}[{j}]{s}");
            if c.get("type").and_then(Value::as_str).is_some_and(|t| t != "function") {
                return Err(ApiError::unsupported(&at(".type"), "only function calls"));
            }
            let id = match c.get("id") {
                Some(Value::String(id)) if !id.is_empty() && id.len() <= MAX_CALL_ID => id.clone(),
                None | Some(Value::Null) => return Err(ApiError::missing(&at(".id"))),
                Some(_) => return Err(ApiError::invalid(&at(".id"), "must be a non-empty string")),
            };
            let f = c.get("function").and_then(Value::as_object);
            let name = match f.and_then(|f| f.get("name")) {
                Some(Value::String(n)) if valid_name(n) => n.clone(),
                None | Some(Value::Null) => return Err(ApiError::missing(&at(".function.name"))),
                Some(_) => {
                    return Err(ApiError::invalid(
                        &at(".function.name"),
                        "not a valid function name",
                    ))
                }
            };
            // The client's text as it is: shown to the model as written.
            let arguments = match f.and_then(|f| f.get("arguments")) {
                Some(Value::String(s)) => s.clone(),
                None | Some(Value::Null) => "{}".to_string(),
                Some(_) => {
                    return Err(ApiError::invalid(
                        &at(".function.arguments"),
                        "arguments must be a JSON string",
                    ))
                }
            };
            Ok(ToolCall { id, name, arguments })
        })
        .collect()
}
