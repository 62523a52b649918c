//! A sequence's next token from its row of a step: picked on the device
//! (an argmax, a draw, or finished on the host from the row's best
//! candidates), or sampled on the host from the row's logits, which a
//! GPU returns only for the sequences that need them (`backend::Pick`).

use std::sync::atomic::Ordering;

use super::{End, Row, Seq, StepLoop};
use crate::backend::{Pick, StepLogits};
use crate::constraint::{word_allows, SeqGrammar};
use crate::generate::FinishReason;
use crate::sampling::{logprobs, logprobs_with, Logprobs, TopCandidates};

impl Seq {
    /// What picking this sequence's next token needs of a step, with what
    /// its bias and penalties add to its row before the device picks
    /// ([`crate::backend::Adjust`]; its grammar's mask, where ready, is
    /// [`Seq::prepare_mask`]'s): its argmax (greedy), a plain temperature
    /// draw, the top candidates of a top-k / top-p / min-p draw or of a
    /// sequence with logprobs (with its argmax or draw; where a bias or
    /// penalties change its row, the candidates of its row before them
    /// too, since logprobs are of the raw or masked logits:
    /// [`Pick::Scored`]), or else the logits (a grammar without its mask,
    /// a top-k past the candidates).
    pub(super) fn pick(&self, vocab: usize) -> (Pick, Vec<(u32, f32)>) {
        // A grammar's row is masked on the device where its mask is ready.
        if self.grammar.is_some() && self.mask.is_none() {
            return (Pick::Logits, vec![]);
        }
        // (0, 0): the argmax; u >= 0: the device's draw; u < 0: a cut
        // draw the host finishes from the candidates.
        let (temperature, u) = if !self.sampler.draws_rng(vocab) {
            (0.0, 0.0)
        } else if let Some(draw) = self.sampler.next_draw(vocab, true) {
            draw
        } else {
            match self.sampler.next_top(vocab, true) {
                Some(temperature) => (temperature, -1.0),
                None => return (Pick::Logits, vec![]),
            }
        };
        let adds = self.sampler.adjustments();
        let scored = self.logprobs.is_some();
        let pick = if scored && !adds.is_empty() {
            Pick::Scored { temperature, u }
        } else if scored || u < 0.0 {
            Pick::Top { temperature, u }
        } else if temperature > 0.0 {
            Pick::Draw { temperature, u }
        } else {
            Pick::Argmax
        };
        (pick, adds)
    }

    /// Before a step in which this sequence samples: its grammar's mask,
    /// for the device to apply before it picks ([`Seq::pick`]), where it
    /// can (no samples sharing the row). A mask that fails is left for
    /// the host's sampling to report.
    pub(super) fn prepare_mask(&mut self, eos: u32) {
        self.mask = None;
        if !self.samples.is_empty() {
            return;
        }
        let stops = self.stops(eos);
        if let Some(Ok(m)) = self.grammar.as_mut().map(|g| g.mask(eos)) {
            self.mask = Some(m.words(&stops));
        }
    }

    /// The tokens that end a grammar's output (EOS, the stop tokens): each
    /// allowed exactly when the grammar may end.
    fn stops(&self, eos: u32) -> Vec<u32> {
        std::iter::once(eos).chain(self.stop_ids.iter().copied()).collect()
    }
}

/// A sequence whose row must be read after its step (its candidates
/// missed its cut, or its drawn token): all of a step's are read at once
/// ([`StepLoop::sample_read`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Deferred {
    idx: usize,
    /// Its index among the step's sequences.
    at: usize,
    /// Its token, where the device picked it (its logprobs need the row).
    token: Option<u32>,
    /// The row carries the sequence's grammar mask, bias and penalties.
    adjusted: bool,
    /// Its logprobs come from its candidates before its additions
    /// ([`Pick::Scored`]), not from the row.
    scored: bool,
}

/// `tok`'s logprobs from `row`'s logprob candidates, where its logit is
/// known: among them, or (a scored row) among the adjusted row's, since a
/// token no addition touches has the same logit in both (every one they
/// touch is in the scored candidates' `known`).
fn logprobs_of(row: &Row<'_>, tok: u32, n: usize) -> Option<Logprobs> {
    let c = row.lp?;
    let scored = matches!(row.pick, Pick::Scored { .. });
    let logit = c.logit(tok).or_else(|| row.top.filter(|_| scored)?.logit(tok))?;
    logprobs_with(c, tok, logit, n)
}

/// `tok`'s logprobs from `raw`, a scored row's candidates before its
/// additions, beside `row`, the row as it came back (adjusted), where a
/// token no addition touches has its raw logit (those they touch are in
/// `raw.known`); `None` where neither holds it.
fn scored_logprobs(
    raw: &TopCandidates,
    row: &[f32],
    tok: u32,
    n: usize,
    grammar: bool,
) -> Option<Logprobs> {
    let logit = raw.logit(tok).or_else(|| row.get(tok as usize).copied())?;
    logprobs_with(raw, tok, logit, n).map(|lp| allowed_only(lp, grammar))
}

/// Logprobs under a grammar list only tokens it allows (as
/// [`crate::sampling::Sampler::sample_masked`]'s).
fn allowed_only(mut lp: Logprobs, grammar: bool) -> Logprobs {
    if grammar {
        lp.top.retain(|t| t.logprob > f32::NEG_INFINITY);
    }
    lp
}

impl StepLoop {
    /// Sample the next token of `running[idx]` from `row`, stream it, and
    /// note whether the sequence is done or needs a KV slot; or, where it
    /// needs its row read after the step, note that in `deferred`.
    pub(super) fn sample_into(
        &mut self,
        idx: usize,
        row: &Row<'_>,
        done: &mut Vec<(usize, End)>,
        need_slot: &mut Vec<u64>,
        deferred: &mut Vec<Deferred>,
    ) {
        let vocab = self.dec.vocab();
        let seq = &mut self.running[idx];
        // A device pick outside a grammar's mask (every allowed logit
        // −inf, or a draw's rounding past the last allowed token) is not
        // taken: the row is sampled on the host.
        let words = seq.mask.as_deref().filter(|_| row.adjusted);
        let refused = row.picked.filter(|&t| words.is_some_and(|w| !word_allows(w, t)));
        let on_device = |t: f32, u: f32| t <= 0.0 || u >= 0.0;
        let picked = match (row.pick, row.picked.filter(|_| refused.is_none()), row.top) {
            // The device's argmax or draw: the token `sample` would pick
            // from these logits at the same uniform, counted and drawn
            // the same way. (A row asked for its logits is sampled here.)
            (Pick::Argmax | Pick::Draw { .. }, Some(tok), _) => {
                seq.sampler.replay(tok, vocab);
                Some(tok)
            }
            (Pick::Top { temperature, u } | Pick::Scored { temperature, u }, Some(tok), _)
                if on_device(temperature, u) && row.lp.is_some() =>
            {
                seq.sampler.replay(tok, vocab);
                Some(tok)
            }
            // A top-k / top-p / min-p draw from the device's candidates,
            // as `sample` draws it from the logits; unless its cut lies
            // past them (a wide nucleus): then from the logits below.
            (Pick::Top { .. } | Pick::Scored { .. }, _, Some(top)) => {
                seq.sampler.sample_top(top, vocab, row.adjusted)
            }
            _ => None,
        };
        // Without its logits, a row with candidates, or whose pick was
        // refused, is read after the step.
        let read_later =
            row.logits.is_none() && (row.top.is_some() || row.lp.is_some() || refused.is_some());
        let no_logits = "the step returned no logits for a sequence that needs them";
        let (at, adjusted) = (row.at, row.adjusted);
        let scored = matches!(row.pick, Pick::Scored { .. }) && row.lp.is_some();
        if let Some(tok) = picked {
            // Logprobs from the candidates, or the row where they do not
            // hold the token's logit.
            let lp = match seq.logprobs {
                None => None,
                Some(n) => match logprobs_of(row, tok, n) {
                    Some(lp) => Some(allowed_only(lp, seq.grammar.is_some())),
                    None => match row.logits {
                        Some(l) => Some(logprobs(l, tok, n)),
                        None if read_later => {
                            let token = Some(tok);
                            return deferred.push(Deferred { idx, at, token, adjusted, scored });
                        }
                        None => return done.push((idx, Err(no_logits.into()))),
                    },
                },
            };
            return self.take_token(idx, tok, lp, done, need_slot);
        }
        match row.logits {
            Some(l) => self.sample_logits(idx, l, false, None, done, need_slot),
            None if read_later => {
                deferred.push(Deferred { idx, at, token: None, adjusted, scored })
            }
            None => done.push((idx, Err(no_logits.into()))),
        }
    }

    /// Finish the `deferred` sequences of a step from their rows, read in
    /// one read (`out`: the step's output, for scored candidates).
    pub(super) fn sample_read(
        &mut self,
        deferred: &[Deferred],
        out: &StepLogits,
        done: &mut Vec<(usize, End)>,
        need_slot: &mut Vec<u64>,
    ) {
        if deferred.is_empty() {
            return;
        }
        let vocab = self.dec.vocab();
        let ats: Vec<usize> = deferred.iter().map(|d| d.at).collect();
        self.shared.rows_read_after.fetch_add(ats.len() as u64, Ordering::Relaxed);
        let rows = match self.dec.last_logits(&ats) {
            Ok(l) if l.len() == ats.len() * vocab => l,
            other => {
                let msg = match other {
                    Ok(l) => format!("the step's logits came back with {} values", l.len()),
                    Err(e) => e.to_string(),
                };
                return deferred.iter().for_each(|d| done.push((d.idx, Err(msg.clone()))));
            }
        };
        for (d, l) in deferred.iter().zip(rows.chunks_exact(vocab)) {
            let raw = out.scored(d.at).filter(|_| d.scored);
            let seq = &self.running[d.idx];
            let grammar = seq.grammar.is_some();
            match (d.token, seq.logprobs) {
                (Some(tok), Some(n)) => {
                    let lp = match raw {
                        Some(c) => scored_logprobs(c, l, tok, n, grammar),
                        None => Some(allowed_only(logprobs(l, tok, n), grammar)),
                    };
                    self.take_token(d.idx, tok, lp, done, need_slot)
                }
                (Some(tok), None) => self.take_token(d.idx, tok, None, done, need_slot),
                (None, _) => self.sample_logits(d.idx, l, d.adjusted, raw, done, need_slot),
            }
        }
    }

    /// Sample the next token of `running[idx]` from its `logits` on the
    /// host: with logprobs, or among a grammar's allowed tokens; from
    /// logits the device `adjusted` (a row read after its step), without
    /// adding the bias and penalties again, its logprobs from `raw`, its
    /// candidates before them, where it has them ([`Pick::Scored`]).
    fn sample_logits(
        &mut self,
        idx: usize,
        logits: &[f32],
        adjusted: bool,
        raw: Option<&TopCandidates>,
        done: &mut Vec<(usize, End)>,
        need_slot: &mut Vec<u64>,
    ) {
        let (eos, seq) = (self.tok.eos_id, &mut self.running[idx]);
        // The row's own logprobs, unless they come from `raw`.
        let own = seq.logprobs.filter(|_| raw.is_none());
        let (tok, lp) = match seq.grammar.as_mut() {
            None => match (own, adjusted) {
                (Some(n), false) => {
                    let (t, lp) = seq.sampler.sample_with_logprobs(logits, n);
                    (t, Some(lp))
                }
                (Some(n), true) => {
                    let t = seq.sampler.sample_adjusted(logits);
                    (t, Some(logprobs(logits, t, n)))
                }
                (None, true) => (seq.sampler.sample_adjusted(logits), None),
                (None, false) => (seq.sampler.sample(logits), None),
            },
            Some(_) => {
                // Every stop token (EOS, end of turn) ends the grammar's
                // output, so each is allowed exactly when the grammar may
                // end (`TokenMask::words`); the mask the step was given,
                // or the grammar's now.
                let stops = seq.stops(eos);
                let words = match (seq.mask.take(), seq.grammar.as_mut().map(|g| g.mask(eos))) {
                    (Some(w), _) => w,
                    (None, Some(Ok(m))) => m.words(&stops),
                    (None, Some(Err(e))) => return done.push((idx, Err(e.to_string()))),
                    (None, None) => return done.push((idx, Err("grammar: no state".into()))),
                };
                let allowed = |id: u32| word_allows(&words, id);
                match seq.sampler.sample_masked(logits, allowed, own, adjusted) {
                    Some(t) => t,
                    None => {
                        let msg = "grammar: no token is allowed".to_string();
                        return done.push((idx, Err(msg)));
                    }
                }
            }
        };
        let lp = match (raw, seq.logprobs) {
            (Some(c), Some(n)) => scored_logprobs(c, logits, tok, n, seq.grammar.is_some()),
            _ => lp,
        };
        self.take_token(idx, tok, lp, done, need_slot);
    }

    /// `tok` is `running[idx]`'s next token: stream it, and note whether
    /// the sequence is done or needs a KV slot.
    pub(super) fn take_token(
        &mut self,
        idx: usize,
        tok: u32,
        lp: Option<Logprobs>,
        done: &mut Vec<(usize, End)>,
        need_slot: &mut Vec<u64>,
    ) {
        let context = self.dec.config().context_length;
        let eos = self.tok.eos_id;
        let seq = &mut self.running[idx];
        if seq.stop_ids.contains(&tok) || (seq.grammar.is_some() && tok == eos) {
            done.push((idx, Ok(FinishReason::Stop)));
            return;
        }
        // The mask was the state's before this token.
        seq.mask = None;
        if let Some(g) = seq.grammar.as_mut() {
            if let Err(e) = g.commit(tok) {
                return done.push((idx, Err(e.to_string())));
            }
        }
        seq.tokens.push(tok);
        let st = seq.stop.push(self.tok.token_bytes(tok));
        seq.emit(st.text, Some(tok), lp);
        // A complete grammar (nothing may follow) ends the sequence now
        // rather than after one more forward pass that can only give EOS.
        let complete = seq.grammar.as_ref().is_some_and(SeqGrammar::is_stopped);
        if st.stopped || complete {
            done.push((idx, Ok(FinishReason::Stop)));
        } else if seq.generated() >= seq.max_tokens || seq.tokens.len() >= context {
            done.push((idx, Ok(FinishReason::Length)));
        } else {
            need_slot.push(seq.id);
        }
    }
}
