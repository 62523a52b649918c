//! `response_format`: text (no constraint), `json_object`, or `json_schema`
//! (the strict-mode subset OpenAI documents, and what else llguidance
//! compiles). A schema is compiled here, at admission, against a byte-level
//! vocabulary with the worker's own limits, so an unsupported feature or a
//! schema too costly to compile is a 400 naming `response_format` instead
//! of a failed job; the job then carries the schema text, not the compiled
//! state (the worker compiles it against its own tokenizer).

use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::ApproximateTokEnv;
use llguidance::{JsonCompileOptions, ParserFactory};
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::payload::{Constraint, MAX_SCHEMA_BYTES};

const PARAM: &str = "response_format";

/// The worker's layout options (`gcs_engine::constraint`): checking with
/// the same ones means the worker compiles what the gateway accepted.
fn options() -> JsonCompileOptions {
    crate::tools::grammar::json_options()
}

/// The worker's compile limits (`gcs_engine::constraint::limits`).
fn limits() -> ParserLimits {
    ParserLimits {
        initial_lexer_fuel: 200_000,
        max_grammar_size: 100_000,
        max_lexer_states: 50_000,
        // Errors go back to the client: the reason, not the grammar dump.
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

fn factory() -> Option<&'static ParserFactory> {
    static F: OnceLock<Option<ParserFactory>> = OnceLock::new();
    F.get_or_init(|| {
        let env = Arc::new(ApproximateTokEnv::single_byte());
        let mut f = ParserFactory::new_simple(&(env as llguidance::toktrie::TokEnv))
            .map_err(|e| tracing::error!(error = %e, "no json schema compiler"))
            .ok()?;
        f.quiet();
        *f.limits_mut() = limits();
        Some(f)
    })
    .as_ref()
}

/// Compiles `schema`; the error says what llguidance refused.
fn check(schema: &Value) -> Result<(), ApiError> {
    let mut s = schema.clone();
    if let Some(o) = s.as_object_mut() {
        o.remove("x-guidance");
    }
    options().apply_to(&mut s);
    let f = factory()
        .ok_or_else(|| ApiError::unsupported(PARAM, "json schemas cannot be compiled here"))?;
    f.create_parser(TopLevelGrammar::from_json_schema(s))
        .map(drop)
        .map_err(|e| ApiError::unsupported(PARAM, format!("unsupported json schema: {e}")))
}

/// Compiles a lark grammar (a tools request's) with the worker's limits;
/// the error is llguidance's reason.
/// Grammars that compiled lately: an agent sends the same tools every
/// turn, and a compile costs about 2 ms per tool (128 tools: ~0.3 s of
/// CPU), so a repeat is not compiled again. Keyed by a hash under a key
/// random per process, so a client cannot forge a hit; bounded FIFO.
const CHECKED_CAPACITY: usize = 512;

struct Checked {
    keys: std::collections::HashSet<u64>,
    order: std::collections::VecDeque<u64>,
}

fn checked() -> &'static (std::hash::RandomState, Mutex<Checked>) {
    static C: OnceLock<(std::hash::RandomState, Mutex<Checked>)> = OnceLock::new();
    C.get_or_init(|| {
        let c = Checked { keys: Default::default(), order: Default::default() };
        (std::hash::RandomState::new(), Mutex::new(c))
    })
}

#[cfg(test)]
thread_local! {
    /// Lark compiles on this thread (tests run in parallel threads, so a
    /// per-thread count is one test's own).
    pub(super) static LARK_COMPILES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

pub(super) fn check_grammar(lark: &str) -> Result<(), String> {
    use std::hash::BuildHasher;
    let (state, cache) = checked();
    let key = state.hash_one(lark);
    if cache.lock().map(|c| c.keys.contains(&key)).unwrap_or(false) {
        return Ok(());
    }
    let f = factory().ok_or_else(|| "grammars cannot be compiled here".to_string())?;
    #[cfg(test)]
    LARK_COMPILES.with(|n| n.set(n.get() + 1));
    f.create_parser(TopLevelGrammar::from_lark(lark.to_string())).map_err(|e| e.to_string())?;
    if let Ok(mut c) = cache.lock() {
        if c.keys.insert(key) {
            c.order.push_back(key);
        }
        while c.order.len() > CHECKED_CAPACITY {
            if let Some(old) = c.order.pop_front() {
                c.keys.remove(&old);
            }
        }
    }
    Ok(())
}

/// The constraint `response_format` asks for; `None` for text or absent.
pub fn response_format(body: &Map<String, Value>) -> Result<Option<Constraint>, ApiError> {
    let rf = match body.get(PARAM) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(ApiError::invalid(PARAM, "'response_format' must be an object")),
    };
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => json_schema(rf).map(Some),
        Some(t) => Err(ApiError::invalid(
            "response_format.type",
            format!("unknown response_format type '{t}': use text, json_object or json_schema"),
        )),
        None => Err(ApiError::missing("response_format.type")),
    }
}

fn json_schema(rf: &Map<String, Value>) -> Result<Constraint, ApiError> {
    let js = match rf.get("json_schema") {
        Some(Value::Object(o)) => o,
        None | Some(Value::Null) => return Err(ApiError::missing("response_format.json_schema")),
        Some(_) => {
            return Err(ApiError::invalid("response_format.json_schema", "must be an object"))
        }
    };
    // OpenAI's rule for the name: a-z, A-Z, 0-9, _ and -, at most 64.
    let name = match js.get("name") {
        Some(Value::String(n))
            if !n.is_empty()
                && n.len() <= 64
                && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') =>
        {
            n.clone()
        }
        None | Some(Value::Null) => {
            return Err(ApiError::missing("response_format.json_schema.name"))
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "response_format.json_schema.name",
                "the name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -",
            ))
        }
    };
    if !matches!(js.get("strict"), None | Some(Value::Null | Value::Bool(_))) {
        return Err(ApiError::invalid("response_format.json_schema.strict", "must be a boolean"));
    }
    // No schema: any JSON value would do; OpenAI treats it as an object.
    let schema = match js.get("schema") {
        None | Some(Value::Null) => {
            Value::Object(Map::from_iter([("type".into(), "object".into())]))
        }
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                "response_format.json_schema.schema",
                "must be an object",
            ))
        }
    };
    let text = serde_json::to_string(&schema)
        .map_err(|e| ApiError::invalid("response_format.json_schema.schema", e.to_string()))?;
    if text.len() > MAX_SCHEMA_BYTES {
        return Err(ApiError::invalid(
            "response_format.json_schema.schema",
            format!("the schema must be at most {MAX_SCHEMA_BYTES} bytes"),
        ));
    }
    check(&schema)?;
    Ok(Constraint::JsonSchema { name, schema: text })
}
