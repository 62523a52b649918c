//! Constrained decoding (structured outputs) with `llguidance`: a grammar
//! (JSON: any object or one JSON Schema; or a lark grammar, which tool
//! calling builds around its tools' schemas) turns into a per-sequence
//! matcher that gives the set of tokens allowed next. The batch scheduler
//! masks the logits with it before sampling and commits each sampled token.
//!
//! The token trie is built from the engine's own GGUF tokenizer (token id →
//! bytes; control tokens as llguidance's `\xFF<name>` specials), never from
//! a hub download, so the mask lines up with the logits row by row.
//!
//! Compilation is bounded by llguidance's fuel limits ([`GrammarLimits`]):
//! a hostile schema fails to compile instead of stalling the engine, and
//! each step's mask is bounded the same way.

use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};

use crate::error::{EngineError, Result};
use crate::tokenizer::GgufTokenizer;

/// Longest grammar source (JSON Schema text) the engine compiles.
pub const MAX_GRAMMAR_BYTES: usize = 64 * 1024;
/// Longest lark grammar (a tools request's: every tool's schema inlined).
pub const MAX_LARK_BYTES: usize = 512 * 1024;

/// What a sequence's output must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grammar {
    /// Any JSON object (OpenAI `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value valid against this JSON Schema (its text).
    JsonSchema(String),
    /// An llguidance lark grammar (tool calling builds one from the
    /// request's tools, `gcs_gateway::tools::grammar`).
    Lark(String),
}

/// The JSON layout the model is held to: `json.dumps` style separators and
/// no free whitespace, so a small model cannot pad its answer with blanks
/// until `max_tokens` runs out.
fn json_options() -> JsonCompileOptions {
    JsonCompileOptions {
        item_separator: ", ".into(),
        key_separator: ": ".into(),
        whitespace_flexible: false,
        ..JsonCompileOptions::default()
    }
}

/// The llguidance grammar of `g`. A schema's own `x-guidance` options are
/// replaced by ours (layout and leniency are the engine's choice).
pub fn top_level(g: &Grammar) -> Result<TopLevelGrammar> {
    let mut schema = match g {
        Grammar::Lark(text) => {
            if text.len() > MAX_LARK_BYTES {
                return Err(EngineError::InvalidRequest(format!(
                    "grammar of {} bytes exceeds {MAX_LARK_BYTES}",
                    text.len()
                )));
            }
            return Ok(TopLevelGrammar::from_lark(text.clone()));
        }
        Grammar::JsonObject => serde_json::json!({"type": "object"}),
        Grammar::JsonSchema(text) => {
            if text.len() > MAX_GRAMMAR_BYTES {
                return Err(EngineError::InvalidRequest(format!(
                    "json schema of {} bytes exceeds {MAX_GRAMMAR_BYTES}",
                    text.len()
                )));
            }
            serde_json::from_str::<serde_json::Value>(text)
                .map_err(|e| EngineError::InvalidRequest(format!("json schema: {e}")))?
        }
    };
    let Some(obj) = schema.as_object_mut() else {
        return Err(EngineError::InvalidRequest("json schema must be an object".into()));
    };
    obj.remove("x-guidance");
    json_options().apply_to(&mut schema);
    Ok(TopLevelGrammar::from_json_schema(schema))
}

/// Compile-cost bounds. llguidance's defaults allow a few hundred ms of
/// lexer construction; these are lower, as a worker compiles per request.
pub fn limits() -> ParserLimits {
    ParserLimits {
        initial_lexer_fuel: 200_000,
        max_grammar_size: 100_000,
        max_lexer_states: 50_000,
        // Errors go back to the client: the reason, not the grammar dump.
        verbose_errors: false,
        // Per-step mask work: the defaults (~15 ms worst case) stay.
        ..ParserLimits::default()
    }
}

/// Compiles grammars against one tokenizer. Cheap to share (`Arc` inside).
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    vocab: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").field("vocab", &self.vocab).finish()
    }
}

impl GrammarCompiler {
    /// The trie of `tok`'s vocabulary: each token's output bytes, control
    /// tokens as specials (they can only be produced as EOS).
    pub fn new(tok: &GgufTokenizer) -> Result<Self> {
        let vocab = tok.vocab_size();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match (tok.is_control(id), tok.token_name(id)) {
                (true, Some(name)) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(name.as_bytes());
                    w
                }
                _ => tok.token_bytes(id).to_vec(),
            })
            .collect();
        let info = TokRxInfo::new(vocab as u32, tok.eos_id);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        Self::with_env(&env)
    }

    /// A compiler over any token environment (the gateway checks schemas
    /// with a byte-level one).
    pub fn with_env(env: &TokEnv) -> Result<Self> {
        let mut factory = ParserFactory::new_simple(env)
            .map_err(|e| EngineError::Tokenizer(format!("grammar trie: {e}")))?;
        factory.quiet();
        *factory.limits_mut() = limits();
        let vocab = env.tok_trie().vocab_size();
        Ok(Self { factory: Arc::new(factory), vocab })
    }

    /// A fresh matcher for one sequence; the error names what is wrong
    /// with the grammar (an unsupported schema feature, a limit hit).
    pub fn compile(&self, g: &Grammar) -> Result<SeqGrammar> {
        let parser = self.factory.create_parser(top_level(g)?).map_err(|e| {
            let what = if matches!(g, Grammar::Lark(_)) { "tools" } else { "response_format" };
            EngineError::InvalidRequest(format!("{what}: {e}"))
        })?;
        let matcher = Matcher::new(Ok(parser));
        Ok(SeqGrammar { matcher, vocab: self.vocab })
    }
}

/// One sequence's grammar state.
pub struct SeqGrammar {
    matcher: Matcher,
    vocab: usize,
}

impl std::fmt::Debug for SeqGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqGrammar").field("stopped", &self.matcher.is_stopped()).finish()
    }
}

/// The tokens a grammar allows next.
#[derive(Debug, Clone)]
pub struct TokenMask {
    vob: SimpleVob,
    /// Whether the grammar may end here (EOS / stop tokens allowed).
    pub accepting: bool,
}

impl TokenMask {
    /// Whether token `id` may come next. Ids past the tokenizer's
    /// vocabulary (padding rows of the logits) never may.
    pub fn allows(&self, id: u32) -> bool {
        (id as usize) < self.vob.len() && self.vob.is_allowed(id)
    }

    /// Number of allowed tokens.
    pub fn count(&self) -> usize {
        self.vob.num_set()
    }

    /// The tokens that may come next as bits (token `t` at bit `t % 32`
    /// of word `t / 32`, [`word_allows`]), each of `stops` (EOS, the end
    /// of a turn) allowed exactly when the grammar may end: what the host
    /// samples among, and what a device masks a row with
    /// ([`crate::backend::Adjust`]).
    pub fn words(&self, stops: &[u32]) -> Vec<u32> {
        let len = self.vob.len();
        let top = stops.iter().map(|&s| s as usize + 1).fold(len, usize::max);
        let mut w = vec![0u32; top.div_ceil(32)];
        let n = len.div_ceil(32);
        w[..n].copy_from_slice(&self.vob.as_slice()[..n]);
        if !len.is_multiple_of(32) {
            // The vector's bits past its length are not tokens.
            w[len / 32] &= (1u32 << (len % 32)) - 1;
        }
        for &s in stops {
            let (at, bit) = (s as usize / 32, 1u32 << (s % 32));
            w[at] = if self.accepting { w[at] | bit } else { w[at] & !bit };
        }
        w
    }
}

/// Whether `words` ([`TokenMask::words`]) allow token `t`.
pub fn word_allows(words: &[u32], t: u32) -> bool {
    words.get(t as usize / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}

impl SeqGrammar {
    /// The next token's mask (EOS included when the grammar may end); a
    /// finished grammar allows only EOS.
    pub fn mask(&mut self, eos: u32) -> Result<TokenMask> {
        let vob = self.matcher.compute_mask_or_eos().map_err(grammar_err)?;
        let accepting = (eos as usize) < self.vocab && vob.is_allowed(eos);
        Ok(TokenMask { vob, accepting })
    }

    /// Advance past a sampled token (one the last mask allowed).
    pub fn commit(&mut self, token: u32) -> Result<()> {
        self.matcher.consume_token(token).map_err(grammar_err)
    }

    /// Whether the grammar is complete (only EOS can follow).
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// An independent copy (another sample of an n > 1 request).
    pub fn fork(&self) -> Self {
        Self { matcher: self.matcher.deep_clone(), vocab: self.vocab }
    }
}

fn grammar_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::InvalidRequest(format!("grammar: {e}"))
}

#[cfg(test)]
#[path = "constraint_tests.rs"]
mod tests;
