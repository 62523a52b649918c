//! The chat a worker renders with its model's template when tools are in
//! play. A template that renders tools itself (it reads a `tools`
//! variable, as Qwen 2.5's does) gets OpenAI-shaped messages and the tool
//! list; one that does not (SmolLM2's) gets the fallback: a system-prompt
//! section listing the tools as JSON and asking for `<tool_call>` blocks,
//! earlier calls shown as those blocks in the assistant's turn, and tool
//! results as a user turn of `<tool_response>` blocks (Hermes style).

use serde_json::{json, Value};

use super::{call_text, RESPONSE_CLOSE, RESPONSE_OPEN};
use crate::payload::{Message, Role, Tool, Tools};

/// The instructions of the fallback section; the tool list follows.
const FALLBACK_HEAD: &str = "# Tools\n\nYou can call functions to help answer the user. \
The functions you can call are listed as JSON between <tools></tools> tags:\n<tools>";
/// After the list: the call format.
const FALLBACK_TAIL: &str = "</tools>\n\nTo call a function, answer with a JSON object of its \
name and arguments between <tool_call></tool_call> tags, one block per call:\n<tool_call>\n\
{\"name\": <function-name>, \"arguments\": <arguments-object>}\n</tool_call>";

/// What the template is given.
#[derive(Clone, Debug, PartialEq)]
pub struct TemplateInput {
    /// `messages`: objects with `role` and `content` (and, for a native
    /// template, `tool_calls` and `tool_call_id`).
    pub messages: Vec<Value>,
    /// `tools` for a native template (OpenAI's `tools` array), else none.
    pub tools: Option<Vec<Value>>,
}

/// One tool as OpenAI's `tools[i]` (parameters as a JSON value).
pub fn tool_json(t: &Tool) -> Value {
    let params: Value = serde_json::from_str(&t.parameters).unwrap_or_else(|_| json!({}));
    let mut f = json!({"name": t.name, "parameters": params});
    if let Some(d) = &t.description {
        f["description"] = json!(d);
    }
    json!({"type": "function", "function": f})
}

/// The fallback's system-prompt section for `tools`.
pub fn fallback_section(tools: &Tools) -> String {
    let mut s = String::from(FALLBACK_HEAD);
    for t in &tools.functions {
        s.push('\n');
        s.push_str(&tool_json(t).to_string());
    }
    s.push('\n');
    s.push_str(FALLBACK_TAIL);
    s
}

/// The template's input for `msgs` with `tools` (`None`: `tool_choice`
/// none, or no tools); `native` when the template renders tools itself.
pub fn template_input(msgs: &[Message], tools: Option<&Tools>, native: bool) -> TemplateInput {
    if native {
        let messages = msgs.iter().map(native_message).collect();
        let tools = tools.map(|t| t.functions.iter().map(tool_json).collect());
        return TemplateInput { messages, tools };
    }
    let mut out: Vec<Value> = Vec::with_capacity(msgs.len() + 1);
    if let Some(t) = tools {
        let section = fallback_section(t);
        match msgs.first() {
            Some(m) if m.role == Role::System => {
                out.push(turn("system", format!("{}\n\n{section}", m.content)));
            }
            _ => out.push(turn("system", section)),
        }
    }
    let skip = usize::from(tools.is_some() && msgs.first().is_some_and(|m| m.role == Role::System));
    for m in &msgs[skip..] {
        match m.role {
            Role::Tool => {
                let block = format!("{RESPONSE_OPEN}\n{}\n{RESPONSE_CLOSE}", m.content);
                // Results of one round of calls share one user turn.
                let prev =
                    out.last_mut().filter(|p| p["role"] == "user" && p["tool_results"] == true);
                match prev {
                    Some(p) => {
                        let c = format!("{}\n{block}", p["content"].as_str().unwrap_or_default());
                        p["content"] = json!(c);
                    }
                    None => {
                        out.push(json!({"role": "user", "content": block, "tool_results": true}))
                    }
                }
            }
            Role::Assistant if !m.tool_calls.is_empty() => {
                let calls: Vec<String> =
                    m.tool_calls.iter().map(|c| call_text(&c.name, &c.arguments)).collect();
                let content = if m.content.is_empty() {
                    calls.join("\n")
                } else {
                    format!("{}\n{}", m.content, calls.join("\n"))
                };
                out.push(turn("assistant", content));
            }
            r => out.push(turn(r.as_str(), m.content.clone())),
        }
    }
    for m in &mut out {
        if let Some(o) = m.as_object_mut() {
            o.remove("tool_results");
        }
    }
    TemplateInput { messages: out, tools: None }
}

fn turn(role: &str, content: String) -> Value {
    json!({"role": role, "content": content})
}

/// One message as OpenAI sends it, for a template that knows tools: the
/// calls' arguments as objects (Qwen's and Llama's templates `tojson`
/// them), as text when they are not JSON.
fn native_message(m: &Message) -> Value {
    let mut v = json!({"role": m.role.as_str(), "content": m.content});
    if !m.tool_calls.is_empty() {
        let calls: Vec<Value> = m
            .tool_calls
            .iter()
            .map(|c| {
                let args = serde_json::from_str::<Value>(&c.arguments)
                    .unwrap_or_else(|_| json!(c.arguments));
                json!({"id": c.id, "type": "function",
                       "function": {"name": c.name, "arguments": args}})
            })
            .collect();
        v["tool_calls"] = json!(calls);
    }
    if let Some(id) = &m.tool_call_id {
        v["tool_call_id"] = json!(id);
    }
    v
}

#[cfg(test)]
#[path = "render_tests.rs"]
mod tests;
