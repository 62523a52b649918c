//! The one validation of a generation request against a model, applied by
//! the gateway at admission (with the model's limits from the catalogue)
//! and by the worker before it runs the job (with its engine's own limits),
//! so a request the engine would refuse is refused at the edge with a 400
//! instead of failing on a worker. The rules are the engine's
//! (`SamplingOptions::validate`, the scheduler's prompt check) plus caps on
//! what a client may make the worker hold or scan per token.
//!
//! The gateway does not tokenise: it knows a lower bound on the prompt's
//! tokens (its bytes over [`MAX_BYTES_PER_TOKEN`]); the worker knows the
//! exact count, and its refusal comes back as a client error (400, never
//! requeued, never held against the worker).

use crate::payload::Generation;

/// Most `logit_bias` entries (each is applied to every sampled token).
pub const MAX_LOGIT_BIAS: usize = 300;
/// Most stop strings (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// Longest stop string in bytes (each is matched against every delta).
pub const MAX_STOP_BYTES: usize = 256;
/// Most `top_logprobs` (OpenAI's limit; the engine's `MAX_TOP_LOGPROBS`).
pub const MAX_TOP_LOGPROBS: u8 = 20;
/// No token of a served vocabulary is longer than this many bytes, so a
/// prompt of `b` bytes has at least `b / MAX_BYTES_PER_TOKEN` tokens.
pub const MAX_BYTES_PER_TOKEN: usize = 128;

/// What a model allows; `None` where it is not known (then the worker's
/// check is the only one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelLimits {
    /// Context length in tokens.
    pub context_tokens: Option<u32>,
    /// Vocabulary size: valid token ids are `0..vocab_size`.
    pub vocab_size: Option<u32>,
}

/// How many tokens the prompt is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptTokens {
    /// Counted by the model's tokenizer (the worker).
    Exact(u64),
    /// Not tokenised: the bound from the prompt's bytes (the gateway).
    FromBytes,
}

/// A refused request: the parameter and why (becomes a 400 at the gateway,
/// `ExecError::Invalid` at the worker).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{param}: {message}")]
pub struct Invalid {
    /// The request parameter at fault.
    pub param: &'static str,
    /// What is wrong with it.
    pub message: String,
}

fn bad(param: &'static str, message: impl Into<String>) -> Result<(), Invalid> {
    Err(Invalid { param, message: message.into() })
}

fn prompt_bytes(g: &Generation) -> usize {
    match &g.prompt {
        crate::payload::Prompt::Text(t) => t.len(),
        crate::payload::Prompt::Chat(ms) => ms.iter().map(|m| m.content.len()).sum(),
    }
}

/// Checks a generation request against a model.
pub fn generation(g: &Generation, model: ModelLimits, prompt: PromptTokens) -> Result<(), Invalid> {
    let s = &g.sampling;
    if !s.temperature.is_finite() || !(0.0..=2.0).contains(&s.temperature) {
        return bad("temperature", format!("temperature {} must be in [0, 2]", s.temperature));
    }
    // The engine's nucleus needs some mass: 0 would keep no token.
    if !(s.top_p > 0.0 && s.top_p <= 1.0) {
        return bad("top_p", format!("top_p {} must be in (0, 1]", s.top_p));
    }
    if !(0.0..=1.0).contains(&s.min_p) {
        return bad("min_p", format!("min_p {} must be in [0, 1]", s.min_p));
    }
    for (param, v) in
        [("frequency_penalty", s.frequency_penalty), ("presence_penalty", s.presence_penalty)]
    {
        if !(-2.0..=2.0).contains(&v) {
            return bad(param, format!("{param} {v} must be in [-2, 2]"));
        }
    }
    if s.logit_bias.len() > MAX_LOGIT_BIAS {
        return bad("logit_bias", format!("at most {MAX_LOGIT_BIAS} logit_bias entries"));
    }
    for (&id, &b) in &s.logit_bias {
        if model.vocab_size.is_some_and(|v| id >= v) {
            let v = model.vocab_size.unwrap_or_default();
            return bad(
                "logit_bias",
                format!("logit_bias token {id} is beyond the model's vocabulary of {v} tokens"),
            );
        }
        if !(-100.0..=100.0).contains(&b) {
            return bad(
                "logit_bias",
                format!("logit_bias {b} for token {id} must be in [-100, 100]"),
            );
        }
    }
    if g.stop.len() > MAX_STOP {
        return bad("stop", format!("at most {MAX_STOP} stop strings"));
    }
    if g.stop.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        return bad("stop", format!("stop strings must be 1 to {MAX_STOP_BYTES} bytes"));
    }
    if g.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        return bad("top_logprobs", format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}"));
    }
    if let Some(crate::payload::Constraint::JsonSchema { schema, .. }) = &g.constraint {
        if schema.len() > crate::payload::MAX_SCHEMA_BYTES {
            let max = crate::payload::MAX_SCHEMA_BYTES;
            return bad("response_format", format!("the json schema must be at most {max} bytes"));
        }
    }
    if g.max_tokens == 0 {
        return bad("max_tokens", "max_tokens must be at least 1");
    }
    if let Some(ctx) = model.context_tokens.filter(|&c| c > 0) {
        let tokens = match prompt {
            PromptTokens::Exact(n) => n,
            PromptTokens::FromBytes => (prompt_bytes(g) / MAX_BYTES_PER_TOKEN) as u64,
        };
        // The engine needs room for one generated token after the prompt.
        if tokens >= u64::from(ctx) {
            let what = match prompt {
                PromptTokens::Exact(n) => format!("the prompt is {n} tokens"),
                PromptTokens::FromBytes => format!("the prompt is at least {tokens} tokens"),
            };
            return bad(
                if matches!(g.prompt, crate::payload::Prompt::Chat(_)) {
                    "messages"
                } else {
                    "prompt"
                },
                format!("{what}; the model's context is {ctx} tokens"),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::payload::{Message, Prompt, Role, Sampling};

    fn g() -> Generation {
        Generation {
            prompt: Prompt::Chat(vec![Message::text(Role::User, "hi")]),
            max_tokens: 16,
            sampling: Sampling::default(),
            stop: vec![],
            logprobs: None,
            constraint: None,
            tools: None,
        }
    }
    const M: ModelLimits = ModelLimits { context_tokens: Some(100), vocab_size: Some(1000) };

    fn refused(g: &Generation) -> &'static str {
        generation(g, M, PromptTokens::FromBytes).unwrap_err().param
    }

    #[test]
    fn a_plain_request_passes() {
        generation(&g(), M, PromptTokens::FromBytes).unwrap();
        generation(&g(), ModelLimits::default(), PromptTokens::FromBytes).unwrap();
    }

    #[test]
    fn sampling_ranges_are_the_engines() {
        for (set, param) in [
            (Sampling { top_p: 0.0, ..Sampling::default() }, "top_p"),
            (Sampling { top_p: 1.01, ..Sampling::default() }, "top_p"),
            (Sampling { temperature: f32::NAN, ..Sampling::default() }, "temperature"),
            (Sampling { temperature: -0.1, ..Sampling::default() }, "temperature"),
            (Sampling { min_p: 1.5, ..Sampling::default() }, "min_p"),
            (Sampling { presence_penalty: 2.5, ..Sampling::default() }, "presence_penalty"),
        ] {
            assert_eq!(refused(&Generation { sampling: set, ..g() }), param);
        }
        let ok = Sampling { top_p: f32::MIN_POSITIVE, temperature: 0.0, ..Sampling::default() };
        generation(&Generation { sampling: ok, ..g() }, M, PromptTokens::FromBytes).unwrap();
    }

    #[test]
    fn logit_bias_ids_are_within_the_vocabulary_and_entries_capped() {
        let with = |bias: Vec<(u32, f32)>| Generation {
            sampling: Sampling { logit_bias: bias.into_iter().collect(), ..Sampling::default() },
            ..g()
        };
        generation(&with(vec![(999, 5.0)]), M, PromptTokens::FromBytes).unwrap();
        assert_eq!(refused(&with(vec![(1000, 5.0)])), "logit_bias");
        assert_eq!(refused(&with(vec![(1, 101.0)])), "logit_bias");
        // Unknown vocabulary: only the worker can tell.
        let unknown = ModelLimits { vocab_size: None, ..M };
        generation(&with(vec![(1_000_000, 1.0)]), unknown, PromptTokens::FromBytes).unwrap();
        let many: Vec<(u32, f32)> = (0..=MAX_LOGIT_BIAS as u32).map(|i| (i, 1.0)).collect();
        assert_eq!(refused(&with(many)), "logit_bias");
    }

    #[test]
    fn stop_strings_are_capped_in_count_and_length() {
        let with = |stop: Vec<String>| Generation { stop, ..g() };
        generation(&with(vec!["x".repeat(MAX_STOP_BYTES); 4]), M, PromptTokens::FromBytes).unwrap();
        assert_eq!(refused(&with(vec!["x".into(); 5])), "stop");
        assert_eq!(refused(&with(vec!["x".repeat(MAX_STOP_BYTES + 1)])), "stop");
        assert_eq!(refused(&with(vec![String::new()])), "stop");
    }

    #[test]
    fn the_prompt_must_leave_room_in_the_context() {
        let exact = |n| generation(&g(), M, PromptTokens::Exact(n));
        exact(99).unwrap();
        assert_eq!(exact(100).unwrap_err().param, "messages");
        let long =
            Generation { prompt: Prompt::Text("a".repeat(100 * MAX_BYTES_PER_TOKEN)), ..g() };
        assert_eq!(refused(&long), "prompt");
        let fits = Generation { prompt: Prompt::Text("a".repeat(99 * MAX_BYTES_PER_TOKEN)), ..g() };
        generation(&fits, M, PromptTokens::FromBytes).unwrap();
    }

    #[test]
    fn other_caps() {
        assert_eq!(refused(&Generation { logprobs: Some(21), ..g() }), "top_logprobs");
        assert_eq!(refused(&Generation { max_tokens: 0, ..g() }), "max_tokens");
    }
}
