//! Exact continuation: a sequence resumed from the tokens another engine
//! (of the same build and model file) already generated for the same
//! request, so that it samples the next token exactly as the uninterrupted
//! sequence would have.
//!
//! Everything a sequence carries from one token to the next is a function
//! of the request and the tokens generated so far, so nothing else needs
//! to travel:
//! - K/V: the prompt's positions in prefill order, the generated ones in
//!   decode order, whatever the batching ([`crate::attn::PagedSeqRef::decode_from`]);
//!   the step loop recomputes them in as few forward passes as it likes.
//! - the sampler: seeded per sequence; one RNG draw per stochastic token,
//!   none when greedy; penalty counts over the generated tokens
//!   ([`Sampler::replay`]).
//! - the stop-string hold-back and any partial UTF-8 character: the
//!   generated tokens' bytes pushed through a fresh [`StopMatcher`].
//! - the grammar of a constrained request: each token checked against the
//!   mask and committed, as when it was sampled.
//!
//! Replay refuses what the uninterrupted sequence could never have
//! delivered (a stop token, a completed stop string or grammar, as many
//! tokens as `max_tokens`): the caller's state is then not a prefix of a
//! run of this request on this engine.

use crate::constraint::SeqGrammar;
use crate::error::{EngineError, Result};
use crate::sampling::Sampler;
use crate::stop::StopMatcher;
use crate::tokenizer::GgufTokenizer;

use super::SeqRequest;

/// The state of a sequence after its already generated tokens.
#[derive(Debug)]
pub(super) struct Resumed {
    pub(super) generated: Vec<u32>,
    pub(super) sampler: Sampler,
    pub(super) stop: StopMatcher,
    /// The text the generated tokens have released so far (the rest is
    /// held back in `stop`).
    pub(super) text: String,
}

/// What replay needs to know of the engine.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub(super) vocab: usize,
    pub(super) context: usize,
}

/// Advance a fresh sequence state of `req` (prompt of `prompt_len` tokens)
/// through `generated`; `grammar` is the request's compiled grammar, if
/// any, and is advanced in place.
pub(super) fn replay(
    tok: &GgufTokenizer,
    req: &SeqRequest,
    prompt_len: usize,
    lim: Limits,
    mut grammar: Option<&mut SeqGrammar>,
    generated: &[u32],
) -> Result<Resumed> {
    let bad = |m: String| Err(EngineError::InvalidRequest(format!("resume: {m}")));
    let max_tokens = req.max_tokens.min(lim.context.saturating_sub(prompt_len)).max(1);
    if generated.len() >= max_tokens {
        return bad(format!(
            "{} tokens already generated, max_tokens is {max_tokens}",
            generated.len()
        ));
    }
    let mut stop_ids = req.stop_token_ids.clone();
    if !req.ignore_eos {
        stop_ids.extend(tok.stop_ids.iter().copied());
    }
    let mut sampler = Sampler::new(req.sampling.clone());
    let mut stop = StopMatcher::new(&req.stop);
    let mut text = String::new();
    for (i, &t) in generated.iter().enumerate() {
        if t as usize >= lim.vocab {
            return bad(format!("token {i} ({t}) out of range"));
        }
        if stop_ids.contains(&t) || (grammar.is_some() && t == tok.eos_id) {
            return bad(format!("token {i} ({t}) is a stop token"));
        }
        if let Some(g) = grammar.as_deref_mut() {
            // As when it was sampled: the mask first, then the commit.
            if !g.mask(tok.eos_id)?.allows(t) {
                return bad(format!("token {i} ({t}) is not allowed by the grammar"));
            }
            g.commit(t)?;
            if g.is_stopped() {
                return bad(format!("the grammar is complete after token {i}"));
            }
        }
        sampler.replay(t, lim.vocab);
        let st = stop.push(tok.token_bytes(t));
        text.push_str(&st.text);
        if st.stopped {
            return bad(format!("a stop string ends at token {i}"));
        }
    }
    Ok(Resumed { generated: generated.to_vec(), sampler, stop, text })
}
