//! The llguidance grammar (lark) a tool request is generated under,
//! built from the payload's [`Tools`] the same way by the gateway (which
//! compiles it at admission) and by the worker (which compiles it against
//! its tokenizer).
//!
//! - `required`: one to `max_calls` calls of any tool;
//! - a named function: one to `max_calls` calls of that tool;
//! - `auto`: those calls, or text that does not begin with `<tool_call>`
//!   (or, with a `response_format`, a document of that format).
//!
//! Each call's `arguments` follow its tool's JSON Schema (any object for a
//! `loose` tool), in the same layout as `response_format` documents.

use llguidance::JsonCompileOptions;
use serde_json::{json, Value};

use super::{CLOSE, OPEN};
use crate::payload::{Constraint, Tool, ToolChoice, Tools};

/// The JSON layout every constrained document is held to: `json.dumps`
/// separators and no free whitespace, so a small model cannot pad its
/// answer with blanks until `max_tokens` runs out (the engine's own
/// `response_format` layout, `gcs_engine::constraint`).
pub fn json_options() -> JsonCompileOptions {
    JsonCompileOptions {
        item_separator: ", ".into(),
        key_separator: ": ".into(),
        whitespace_flexible: false,
        ..JsonCompileOptions::default()
    }
}

/// Why a payload's tools cannot become a grammar (a worker reading a
/// payload no honest gateway writes).
#[derive(Debug, thiserror::Error)]
#[error("tools grammar: {0}")]
pub struct GrammarError(pub String);

/// A schema as the grammar inlines it: our layout options in place of the
/// client's `x-guidance`.
pub fn inline_schema(schema: &Value) -> Result<String, GrammarError> {
    let mut s = schema.clone();
    let Some(o) = s.as_object_mut() else {
        return Err(GrammarError("a schema must be a JSON object".into()));
    };
    o.remove("x-guidance");
    json_options().apply_to(&mut s);
    serde_json::to_string(&s).map_err(|e| GrammarError(e.to_string()))
}

/// The arguments' schema of `t`: its parameters, or any object when loose.
fn arguments_schema(t: &Tool) -> Result<Value, GrammarError> {
    if t.loose {
        return Ok(json!({"type": "object"}));
    }
    serde_json::from_str(&t.parameters)
        .map_err(|e| GrammarError(format!("tool {}: parameters: {e}", t.name)))
}

/// A lark string literal (lark literals are JSON strings).
fn lit(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// The grammar of `tools`; `text` is the `response_format` an `auto`
/// answer's text must follow, if any.
pub fn lark(tools: &Tools, text: Option<&Constraint>) -> Result<String, GrammarError> {
    let chosen: Vec<&Tool> = match &tools.choice {
        ToolChoice::Function(name) => {
            let t = tools.functions.iter().find(|t| &t.name == name);
            vec![t.ok_or_else(|| GrammarError(format!("tool_choice names no tool {name:?}")))?]
        }
        ToolChoice::Auto | ToolChoice::Required => tools.functions.iter().collect(),
    };
    if chosen.is_empty() {
        return Err(GrammarError("no tools".into()));
    }
    let mut g = String::from("%llguidance {}\n");
    g.push_str(match tools.choice {
        ToolChoice::Auto => "start: calls | text\n",
        _ => "start: calls\n",
    });
    let more = tools.max_calls.max(1) - 1;
    if more == 0 {
        g.push_str("calls: call\n");
    } else {
        g.push_str(&format!("calls: call (\"\\n\" call){{0,{more}}}\n"));
    }
    g.push_str(&format!(
        "call: {} func {}\n",
        lit(&format!("{OPEN}\n{{\"name\": ")),
        lit(&format!("}}\n{CLOSE}"))
    ));
    let alts: Vec<String> = (0..chosen.len()).map(|i| format!("func_{i}")).collect();
    g.push_str(&format!("func: {}\n", alts.join(" | ")));
    for (i, t) in chosen.iter().enumerate() {
        let head = format!("{}, \"arguments\": ", Value::String(t.name.clone()));
        g.push_str(&format!(
            "func_{i}: {} %json {}\n",
            lit(&head),
            inline_schema(&arguments_schema(t)?)?
        ));
    }
    if tools.choice == ToolChoice::Auto {
        match text {
            None => {
                // Any text (or none) that does not open a call: once the
                // answer begins with `<tool_call>` it is calls, so the
                // gateway reads it the way it was generated.
                g.push_str("text: TEXT?\n");
                g.push_str(&format!("TEXT: /(?s:.+)/ & ~/{}(?s:.*)/\n", regex_escape(OPEN)));
            }
            Some(Constraint::JsonObject) => {
                g.push_str(&format!(
                    "text: %json {}\n",
                    inline_schema(&json!({"type": "object"}))?
                ));
            }
            Some(Constraint::JsonSchema { schema, .. }) => {
                let v: Value = serde_json::from_str(schema)
                    .map_err(|e| GrammarError(format!("response_format: {e}")))?;
                g.push_str(&format!("text: %json {}\n", inline_schema(&v)?));
            }
        }
    }
    Ok(g)
}

/// `s` as a literal inside a lark `/…/` regex.
fn regex_escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~/".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
#[path = "grammar_tests.rs"]
mod tests;
