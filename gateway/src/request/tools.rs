//! `tools`, `tool_choice` and `parallel_tool_calls`, validated and bounded
//! at admission: at most [`MAX_TOOLS`] functions named
//! `^[a-zA-Z0-9_-]{1,64}$` (no two alike), each schema an object of at
//! most [`MAX_SCHEMA_BYTES`], all definitions together at most
//! [`MAX_TOOLS_BYTES`]. The whole grammar the worker will compile
//! ([`crate::tools::grammar`]) is compiled here; only if it fails is each
//! schema compiled alone (a `strict` tool whose schema llguidance refuses
//! is a 400 naming it, another is held to any object).

use serde_json::{json, Map, Value};

use super::format::check_grammar;
use crate::error::ApiError;
use crate::payload::{
    Constraint, Tool, ToolChoice, Tools, MAX_PARALLEL_CALLS, MAX_SCHEMA_BYTES, MAX_TOOLS,
    MAX_TOOLS_BYTES,
};
use crate::tools::grammar::{inline_schema, lark};

/// OpenAI's rule for function names.
pub(super) fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The request's tools, or `None` when it has none or `tool_choice` is
/// `none`. `text` is its `response_format` (an `auto` answer's text).
pub(super) fn tools(
    body: &Map<String, Value>,
    text: Option<&Constraint>,
) -> Result<Option<Tools>, ApiError> {
    let defs = match body.get("tools") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(a)) if a.len() <= MAX_TOOLS => a.clone(),
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid("tools", format!("at most {MAX_TOOLS} tools")))
        }
        Some(_) => return Err(ApiError::invalid("tools", "'tools' must be an array")),
    };
    let mut functions: Vec<ToolDef> = Vec::with_capacity(defs.len());
    let mut bytes = 0usize;
    for (i, d) in defs.iter().enumerate() {
        let t = tool(i, d)?;
        let new = &t.tool;
        if functions.iter().any(|f| f.tool.name == new.name) {
            return Err(ApiError::invalid(
                &format!("tools[{i}].function.name"),
                format!("two tools are named '{}'", new.name),
            ));
        }
        bytes +=
            new.name.len() + new.parameters.len() + new.description.as_ref().map_or(0, String::len);
        if bytes > MAX_TOOLS_BYTES {
            return Err(ApiError::invalid(
                "tools",
                format!("the tool definitions must be at most {MAX_TOOLS_BYTES} bytes together"),
            ));
        }
        functions.push(t);
    }
    let choice = match body.get("tool_choice") {
        None | Some(Value::Null) => (!functions.is_empty()).then_some(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => None,
            "auto" => Some(ToolChoice::Auto),
            "required" => Some(ToolChoice::Required),
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "'tool_choice' must be none, auto, required or a named function",
                ))
            }
        },
        Some(Value::Object(o)) => Some(named(o)?),
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "'tool_choice' must be a string or an object",
            ))
        }
    };
    let parallel = match body.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid("parallel_tool_calls", "must be a boolean")),
    };
    let Some(choice) = choice else { return Ok(None) };
    if functions.is_empty() {
        return Err(ApiError::invalid("tool_choice", "'tool_choice' needs 'tools'"));
    }
    if let ToolChoice::Function(n) = &choice {
        if !functions.iter().any(|f| &f.tool.name == n) {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("'tool_choice' names '{n}', which is not one of the tools"),
            ));
        }
    }
    let max_calls = if parallel { MAX_PARALLEL_CALLS } else { 1 };
    let all = |functions: Vec<Tool>| Tools { functions, choice: choice.clone(), max_calls };
    // The whole grammar first: when it compiles, every schema does (the
    // common case, one compile, cached for the next turn of the same agent).
    let first = all(functions.iter().map(|d| d.tool.clone()).collect());
    let g = lark(&first, text).map_err(|e| ApiError::invalid("tools", e.to_string()))?;
    if check_grammar(&g).is_ok() {
        return Ok(Some(first));
    }
    let settled =
        functions.into_iter().enumerate().map(|(i, d)| settle(i, d)).collect::<Result<_, _>>()?;
    let t = all(settled);
    let g = lark(&t, text).map_err(|e| ApiError::invalid("tools", e.to_string()))?;
    check_grammar(&g).map_err(|e| ApiError::unsupported("tools", format!("tools: {e}")))?;
    Ok(Some(t))
}

/// `{"type": "function", "function": {"name": …}}`.
fn named(o: &Map<String, Value>) -> Result<ToolChoice, ApiError> {
    if o.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ApiError::unsupported(
            "tool_choice.type",
            "only a 'function' tool_choice object is supported",
        ));
    }
    match o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
        Some(n) if valid_name(n) => Ok(ToolChoice::Function(n.to_string())),
        Some(_) => Err(ApiError::invalid("tool_choice.function.name", "not a valid function name")),
        None => Err(ApiError::missing("tool_choice.function.name")),
    }
}

/// `tools[i]`.
fn tool(i: usize, d: &Value) -> Result<ToolDef, ApiError> {
    let at = |s: &str| format!("tools[{i}]{s}");
    let Some(d) = d.as_object() else {
        return Err(ApiError::invalid(&at(""), "each tool must be an object"));
    };
    match d.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(t) => {
            return Err(ApiError::unsupported(
                &at(".type"),
                format!("tools of type '{t}' are not supported; only function"),
            ))
        }
        None => return Err(ApiError::missing(&at(".type"))),
    }
    let Some(f) = d.get("function").and_then(Value::as_object) else {
        return Err(ApiError::missing(&at(".function")));
    };
    let name = match f.get("name") {
        Some(Value::String(n)) if valid_name(n) => n.clone(),
        None | Some(Value::Null) => return Err(ApiError::missing(&at(".function.name"))),
        Some(_) => {
            return Err(ApiError::invalid(
                &at(".function.name"),
                "the name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -",
            ))
        }
    };
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ApiError::invalid(&at(".function.description"), "must be a string")),
    };
    let strict = match f.get("strict") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid(&at(".function.strict"), "must be a boolean")),
    };
    let pat = at(".function.parameters");
    // No parameters: a function of none (OpenAI's reading), so `{}`.
    let mut schema = match f.get("parameters") {
        None | Some(Value::Null) => {
            json!({"type": "object", "properties": {}, "additionalProperties": false})
        }
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return Err(ApiError::invalid(&pat, "must be a JSON Schema object")),
    };
    // Arguments are an object: a schema that says nothing of the type
    // gets it; one that says another type is refused.
    if let Some(o) = schema.as_object_mut() {
        match o.get("type") {
            None if !["anyOf", "oneOf", "allOf", "$ref"].iter().any(|k| o.contains_key(*k)) => {
                o.insert("type".into(), json!("object"));
            }
            None => {}
            Some(t) if t == "object" => {}
            Some(_) => return Err(ApiError::invalid(&pat, "the arguments must be an object")),
        }
    }
    let parameters =
        serde_json::to_string(&schema).map_err(|e| ApiError::invalid(&pat, e.to_string()))?;
    if parameters.len() > MAX_SCHEMA_BYTES {
        return Err(ApiError::invalid(
            &pat,
            format!("the schema must be at most {MAX_SCHEMA_BYTES} bytes"),
        ));
    }
    // Compiled alone (the reason of a refusal names this tool) only when
    // the whole grammar does not compile: see `tools`.
    Ok(ToolDef { tool: Tool { name, description, parameters, loose: false }, strict, schema })
}

/// A tool as parsed, before its schema is known to compile.
struct ToolDef {
    tool: Tool,
    strict: bool,
    schema: Value,
}

/// Compiles `d`'s schema alone: a strict tool whose schema does not compile
/// is a 400 on its parameters, another is held to any object.
fn settle(i: usize, d: ToolDef) -> Result<Tool, ApiError> {
    let alone = inline_schema(&d.schema)
        .map_err(|e| e.to_string())
        .and_then(|s| check_grammar(&format!("start: %json {s}\n")));
    let mut t = d.tool;
    match alone {
        Ok(()) => {}
        Err(e) if d.strict => {
            return Err(ApiError::unsupported(
                &format!("tools[{i}].function.parameters"),
                format!("unsupported json schema: {e}"),
            ))
        }
        Err(e) => {
            tracing::debug!(tool = %t.name, error = %e, "schema not compiled: any object");
            t.loose = true;
        }
    }
    Ok(t)
}

#[cfg(test)]
#[path = "tools_tests.rs"]
mod tests;
