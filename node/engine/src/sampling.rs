//! Token sampling: greedy, or temperature / top-k / top-p / min-p with a
//! per-sequence seeded RNG, OpenAI-style frequency / presence penalties and
//! logit bias, and optional logprobs.
//!
//! Order of the logit transforms (as in vLLM): logit bias, then penalties
//! over the tokens this sampler has generated, then greedy argmax
//! (temperature 0) or temperature → top-k → top-p → min-p → draw.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::attn_paged::weights::exp_weights;
use crate::error::{EngineError, Result};

/// Basic sampling parameters (kept for existing callers; see
/// [`SamplingOptions`] for the full set). `temperature <= 0` means greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0 }
    }
}

/// The full set of sampling options of an OpenAI-style request.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingOptions {
    /// Below [`MIN_TEMPERATURE`] (0 included) means greedy (argmax after
    /// bias and penalties).
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub top_k: usize,
    /// Drop tokens whose probability is below `min_p` times the best one's; 0 disables.
    pub min_p: f32,
    /// Seed of this sequence's own RNG, so a seed gives the same text
    /// whatever else is in the batch.
    pub seed: u64,
    /// OpenAI semantics: `logit -= frequency_penalty * count(token)`, counted over generated tokens.
    pub frequency_penalty: f32,
    /// OpenAI semantics: `logit -= presence_penalty` if the token was generated at all.
    pub presence_penalty: f32,
    /// Token id → bias added to its logit (OpenAI range -100..=100).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingOptions {
    fn default() -> Self {
        SamplingParams::greedy().into()
    }
}

impl From<SamplingParams> for SamplingOptions {
    fn from(p: SamplingParams) -> Self {
        Self {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            min_p: 0.0,
            seed: p.seed,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingOptions {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Reject values OpenAI would reject, and bias ids outside the vocabulary.
    pub fn validate(&self, vocab: usize) -> Result<()> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!("temperature {} must be >= 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p {} must be in [0, 1]", self.min_p));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} {v} must be in [-2, 2]"));
            }
        }
        for &(id, b) in &self.logit_bias {
            if id as usize >= vocab {
                return bad(format!("logit_bias token {id} out of range"));
            }
            if !(-100.0..=100.0).contains(&b) {
                return bad(format!("logit_bias {b} for token {id} must be in [-100, 100]"));
            }
        }
        Ok(())
    }
}

/// Temperatures below this sample greedily (vLLM's threshold): the draw's
/// `l / t` overflows f32 for a small enough `t` (a temperature of 1e-40
/// made every probability NaN and drew the last id of the vocabulary),
/// and long before that the draw is the argmax in all but exact ties.
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// Most `top_logprobs` a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A token and its log-probability under the model's distribution.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
}

/// Logprobs of one sampled token: the chosen one and the `n` most likely.
/// They are computed from the raw model logits (before bias, penalties and
/// temperature), like vLLM's default. This is the engine's one logprob
/// type: the [`crate::SeqEvent`] stream carries it too, and callers turn the
/// token ids into text (e.g. a wire format) at their boundary.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    pub chosen: TokenLogprob,
    pub top: Vec<TokenLogprob>,
}

/// Stateful sampler for one sequence: owns its RNG and the counts of the
/// tokens it has generated (for the penalties).
#[derive(Debug, Clone)]
pub struct Sampler {
    opts: SamplingOptions,
    rng: ChaCha8Rng,
    counts: HashMap<u32, u32>,
    draws: u64,
}

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        // Ties go to the lowest id, like llama.cpp's greedy sampler.
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The token plain temperature sampling draws at `u` (uniform in [0, 1)):
/// the first id whose running sum of the weights `exp(l / t - max / t)`
/// (ggml's `expf`: [`exp_weights`]), in id order, passes `u` times the
/// whole sum; the last id when rounding leaves none. The sums are grouped
/// in [`DRAW_RANGES`] ranges of ids. [`Sampler`] draws this way where no
/// top-k, top-p or min-p cuts (after any bias and penalties), and a GPU
/// decoder the same way on the device (`kernels::pick::pick_rows`): the
/// same f32 operations in the same order, so the two draw the same token
/// from the same logits.
pub fn draw_temperature(logits: &[f32], temperature: f32, u: f32) -> u32 {
    let (t, vocab) = (temperature, logits.len());
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let (range, sums) = range_sums(logits, t, max);
    let r = u * sums.iter().fold(0.0f32, |a, &s| a + s);
    let mut before = 0.0f32;
    for (k, &s) in sums.iter().enumerate() {
        let next = before + s;
        if r < next {
            // The range's own sum again, in its order: it passes r by
            // its end at the latest (its last id otherwise).
            let (lo, hi) = (k * range, ((k + 1) * range).min(vocab));
            let mut w = vec![0f32; hi - lo];
            exp_weights(&logits[lo..hi], t, max, &mut w);
            let mut acc = 0.0f32;
            for (i, &x) in w.iter().enumerate() {
                acc += x;
                if r < before + acc {
                    return (lo + i) as u32;
                }
            }
            return (hi - 1) as u32;
        }
        before = next;
    }
    vocab.saturating_sub(1) as u32
}

/// Ranges of ids whose weights [`draw_temperature`] sums apart: the units
/// of a GPU's picking cube (`kernels::pick::PICK_THREADS`), so that both
/// sides round alike.
pub const DRAW_RANGES: usize = 256;

/// The ids a range of [`DRAW_RANGES`] holds, and each range's sum of the
/// weights ([`exp_weights`]) in id order: a row's weights grouped as a
/// GPU groups them (`kernels::pick::range_masses`). One f32 running sum
/// over ~50k ids stops growing by the tail's weights once it is large
/// (each below half its ulp): its draws crossed `u` tens of ids from the
/// grouped sums' on real logits, and its mass left the tail out.
fn range_sums(logits: &[f32], t: f32, max: f32) -> (usize, Vec<f32>) {
    let range = logits.len().div_ceil(DRAW_RANGES).max(1);
    let mut w = vec![0f32; range];
    let sums = logits
        .chunks(range)
        .map(|c| {
            let w = &mut w[..c.len()];
            exp_weights(c, t, max, w);
            w.iter().fold(0.0f32, |a, &x| a + x)
        })
        .collect();
    (range, sums)
}

/// The whole row's sum of the weights ([`range_sums`] added in order): a
/// draw's normaliser at temperature `t`, as a GPU sums it.
fn row_mass(logits: &[f32], t: f32, max: f32) -> f32 {
    range_sums(logits, t, max).1.iter().fold(0.0f32, |a, &s| a + s)
}

/// Index `i` drawn with probability proportional to `probs[i]` at `u`.
fn draw_at(probs: &[f32], u: f32, id: impl Fn(usize) -> u32) -> u32 {
    let total: f32 = probs.iter().sum();
    let r = u * total;
    let mut acc = 0.0;
    for (i, &pr) in probs.iter().enumerate() {
        acc += pr;
        if r < acc {
            return id(i);
        }
    }
    id(probs.len().saturating_sub(1))
}

/// `log_softmax` of `logits` at the requested ids, plus the `n` best.
pub fn logprobs(logits: &[f32], chosen: u32, n: usize) -> Logprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = log_sum_exp(max, unit_mass(logits, max));
    let lp = |id: u32| TokenLogprob {
        token: id,
        logprob: logits.get(id as usize).map_or(f32::NEG_INFINITY, |&l| l - lse),
    };
    let top = top_n(logits, n.min(MAX_TOP_LOGPROBS)).into_iter().map(|(id, _)| lp(id)).collect();
    Logprobs { chosen: lp(chosen), top }
}

/// [`logprobs`] from a row's candidates and `chosen`'s logit in that row
/// (among them, [`TopCandidates::logit`], or known elsewhere); `None`
/// without candidates.
pub fn logprobs_with(top: &TopCandidates, chosen: u32, logit: f32, n: usize) -> Option<Logprobs> {
    let &(_, max) = top.cand.first()?;
    let lse = log_sum_exp(max, top.unit_mass);
    let lp = |(token, l): (u32, f32)| TokenLogprob { token, logprob: l - lse };
    let n = n.min(MAX_TOP_LOGPROBS).min(top.cand.len());
    Some(Logprobs {
        chosen: lp((chosen, logit)),
        top: top.cand[..n].iter().copied().map(lp).collect(),
    })
}

/// `Σ exp(l - max)` over `logits` (the logprobs' normaliser), with ggml's
/// `expf` and summed as a GPU sums it ([`row_mass`] at temperature 1), so
/// that a device's logprobs are the host's. (Until session 34 the host
/// summed libm's `exp` in f64; the f32 sums' rounding, about 1e-6
/// relative, moves a logprob by a few of its ulps at most.)
fn unit_mass(logits: &[f32], max: f32) -> f64 {
    f64::from(row_mass(logits, 1.0, max))
}

/// `log Σ exp(l)` from the best logit `max` and [`unit_mass`].
fn log_sum_exp(max: f32, unit_mass: f64) -> f32 {
    max + unit_mass.ln() as f32
}

/// The `n` largest `(id, value)` pairs, best first; ties go to the lower id
/// so the result does not depend on the selection algorithm.
fn top_n(v: &[f32], n: usize) -> Vec<(u32, f32)> {
    let cmp = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let mut all: Vec<(u32, f32)> = v.iter().enumerate().map(|(i, &x)| (i as u32, x)).collect();
    let n = n.min(all.len());
    if n == 0 {
        return Vec::new();
    }
    if n < all.len() {
        all.select_nth_unstable_by(n - 1, cmp);
        all.truncate(n);
    }
    all.sort_unstable_by(cmp);
    all
}

/// Candidates a row's top-k / top-p / min-p draw is finished from
/// ([`Sampler::sample_top`]) when another side (a GPU) computes the
/// logits: the row's best [`TOP_CANDIDATES`] ids with their logits, best
/// first and ties to the lower id, and `mass`, the sum of
/// `exp(l / t - max / t)` over the whole vocabulary at the draw's
/// temperature `t` (`max` the best logit), and `unit_mass`, the sum of
/// `exp(l - max)` (the logprobs' normaliser: [`logprobs_with`]).
/// [`top_candidates`] is the host's computation of the same. `known`:
/// logits of the same row outside `cand` that came back beside them (the
/// picked token's; for the candidates of a row before its bias and
/// penalties, those of the tokens they add to: `backend::Pick::Scored`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopCandidates {
    pub cand: Vec<(u32, f32)>,
    pub mass: f32,
    pub unit_mass: f64,
    pub known: Vec<(u32, f32)>,
}

impl TopCandidates {
    /// Token `id`'s logit, where the candidates or `known` hold it.
    pub fn logit(&self, id: u32) -> Option<f32> {
        self.cand.iter().chain(&self.known).find(|c| c.0 == id).map(|c| c.1)
    }
}

/// How many candidates [`TopCandidates`] holds (fewer when the vocabulary
/// is smaller). A nucleus wider than this is drawn from the row's logits.
pub const TOP_CANDIDATES: usize = 256;

/// A row's [`TopCandidates`] at `temperature` (a `mass` of 0 at 0),
/// computed on the host.
pub fn top_candidates(logits: &[f32], temperature: f32) -> TopCandidates {
    let cand = top_n(logits, TOP_CANDIDATES);
    let t = temperature;
    let best = cand.first().map_or(0.0, |c| c.1);
    let total = if t > 0.0 { row_mass(logits, t, best) } else { 0.0 };
    TopCandidates { cand, mass: total, unit_mass: unit_mass(logits, best), known: vec![] }
}

/// `Σ exp(l / t - max)` over `logits`, in their order: the normaliser of
/// a draw at temperature `t` (`max` the best logit over `t`).
fn mass(logits: impl Iterator<Item = f32>, t: f32, max: f32) -> f32 {
    logits.map(|l| (l / t - max).exp()).sum()
}

impl Sampler {
    pub fn new(opts: impl Into<SamplingOptions>) -> Self {
        let opts = opts.into();
        let rng = ChaCha8Rng::seed_from_u64(opts.seed);
        Self { opts, rng, counts: HashMap::new(), draws: 0 }
    }

    pub fn options(&self) -> &SamplingOptions {
        &self.opts
    }

    /// Whether picking a token over a vocabulary of `vocab` draws from the
    /// RNG. Every stochastic path of [`Sampler::sample`] (and of
    /// [`Sampler::sample_masked`]) draws exactly once per token, greedy
    /// never, so the RNG's position after `n` tokens is `n` or 0 draws.
    pub fn draws_rng(&self, vocab: usize) -> bool {
        let p = &self.opts;
        !(p.temperature < MIN_TEMPERATURE || p.top_k == 1 || vocab <= 1)
    }

    /// Whether the next token is the raw logits' argmax, whatever came
    /// before: greedy, with no bias or penalty to adjust them. Such a
    /// sequence needs a step's argmax alone, not its logits.
    pub fn plain_greedy(&self, vocab: usize) -> bool {
        let p = &self.opts;
        !self.draws_rng(vocab)
            && p.logit_bias.is_empty()
            && p.frequency_penalty == 0.0
            && p.presence_penalty == 0.0
    }

    /// The next token's draw when it is plain temperature sampling (no
    /// top-k, top-p or min-p) from logits with no bias or penalty to
    /// apply, or (`adjusted`) from logits that already carry them
    /// ([`Sampler::adjustments`]): its temperature and the uniform it
    /// draws at, so that another side (a GPU) can draw it with
    /// [`draw_temperature`]. Peeks: the RNG moves when the drawn token is
    /// [`Sampler::replay`]ed, so a step that does not happen draws nothing.
    pub fn next_draw(&self, vocab: usize, adjusted: bool) -> Option<(f32, f32)> {
        let p = &self.opts;
        let plain = self.draws_rng(vocab)
            && (p.top_k == 0 || p.top_k >= vocab)
            && p.top_p >= 1.0
            && p.min_p <= 0.0
            && (adjusted || !self.adjusts());
        plain.then(|| (p.temperature, self.rng.clone().random::<f32>()))
    }

    /// The temperature of the next token's draw when it cuts the
    /// distribution (top-k of at most [`TOP_CANDIDATES`], top-p, min-p)
    /// and no bias or penalty applies, or (`adjusted`) the logits already
    /// carry them: a step may then return the row's [`TopCandidates`]
    /// instead of its logits, and [`Sampler::sample_top`] finishes the
    /// draw.
    pub fn next_top(&self, vocab: usize, adjusted: bool) -> Option<f32> {
        let p = &self.opts;
        let k = self.top_k(vocab);
        let cuts = k < vocab || p.top_p < 1.0 || p.min_p > 0.0;
        let fits = k == vocab || k <= TOP_CANDIDATES;
        let raw = adjusted || !self.adjusts();
        (self.draws_rng(vocab) && raw && cuts && fits).then_some(p.temperature)
    }

    /// The next token drawn from a row's `top` candidates (of logits that
    /// carry the bias and penalties, with `adjusted`), counted and drawn
    /// as [`Sampler::sample`] would from the row's raw logits; `None`,
    /// nothing drawn, when the candidates do not reach the cut (a nucleus
    /// wider than they are) or the draw is not one [`Sampler::next_top`]
    /// names: then sample from the logits.
    pub fn sample_top(&mut self, top: &TopCandidates, vocab: usize, adjusted: bool) -> Option<u32> {
        let t = self.next_top(vocab, adjusted)?;
        let k = self.top_k(vocab);
        let cand = &top.cand[..top.cand.len().min(k)];
        let complete = cand.len() == k;
        let z = match cand.first() {
            None => return None,
            Some(&(_, best)) if complete => mass(cand.iter().map(|c| c.1), t, best / t),
            // `mass` is the whole vocabulary's, the normaliser only
            // without a top-k.
            Some(_) if k == vocab => top.mass,
            Some(_) => return None,
        };
        let probs = self.cut(cand, complete, z)?;
        let tok = self.draw(&probs, |i| cand[i].0);
        *self.counts.entry(tok).or_insert(0) += 1;
        Some(tok)
    }

    /// The top-k set's size over a vocabulary of `vocab` (all of it
    /// without a top-k).
    fn top_k(&self, vocab: usize) -> usize {
        let k = self.opts.top_k;
        if k > 0 {
            k.min(vocab)
        } else {
            vocab
        }
    }

    /// RNG draws made so far.
    pub fn draws(&self) -> u64 {
        self.draws
    }

    /// Put this sampler in the state it would be in had it sampled `token`
    /// (over a vocabulary of `vocab`): the token counted for the
    /// penalties, the RNG advanced by the same draws. A sequence resumed
    /// from its delivered tokens then samples the next one exactly as the
    /// uninterrupted sequence would.
    pub fn replay(&mut self, token: u32, vocab: usize) {
        if self.draws_rng(vocab) {
            let _: f32 = self.rng.random();
            self.draws += 1;
        }
        *self.counts.entry(token).or_insert(0) += 1;
    }

    /// Sample the next token and count it as generated.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let adjusted = self.adjusted(logits);
        self.sample_adjusted(adjusted.as_deref().unwrap_or(logits))
    }

    /// [`Sampler::sample`] from logits that already carry this sampler's
    /// [`Sampler::adjustments`] (a device added them before it picked).
    pub fn sample_adjusted(&mut self, logits: &[f32]) -> u32 {
        let tok = self.pick(logits);
        *self.counts.entry(tok).or_insert(0) += 1;
        tok
    }

    /// Like [`Sampler::sample`], also returning logprobs with `top_n` alternatives.
    pub fn sample_with_logprobs(&mut self, logits: &[f32], top_n: usize) -> (u32, Logprobs) {
        let tok = self.sample(logits);
        (tok, logprobs(logits, tok, top_n))
    }

    /// Sample among the tokens `allowed` says may come next (a grammar's
    /// mask), with logprobs of `top_n` alternatives when asked. Masked
    /// tokens get a logit of -inf before bias and penalties (so neither can
    /// revive them), and the logprobs are those of the masked distribution:
    /// the raw logits renormalised over the allowed tokens, alternatives
    /// limited to allowed ones. `None` when no token is allowed. With
    /// `adjusted`, the logits already carry the mask, bias and penalties (a
    /// device applied them: [`Sampler::sample_adjusted`]; no logprobs).
    pub fn sample_masked(
        &mut self,
        raw: &[f32],
        allowed: impl Fn(u32) -> bool,
        top_n: Option<usize>,
        adjusted: bool,
    ) -> Option<(u32, Option<Logprobs>)> {
        let masked: Vec<f32> = raw
            .iter()
            .enumerate()
            .map(|(i, &l)| if allowed(i as u32) { l } else { f32::NEG_INFINITY })
            .collect();
        if !masked.iter().any(|l| *l > f32::NEG_INFINITY) {
            return None;
        }
        let tok = match adjusted {
            true => self.sample_adjusted(&masked),
            false => self.sample(&masked),
        };
        let lp = top_n.map(|n| {
            let mut lp = logprobs(&masked, tok, n);
            lp.top.retain(|t| t.logprob > f32::NEG_INFINITY);
            lp
        });
        Some((tok, lp))
    }

    /// Whether a bias or a penalty changes the logits of the next pick.
    fn adjusts(&self) -> bool {
        let o = &self.opts;
        let penalties =
            (o.frequency_penalty != 0.0 || o.presence_penalty != 0.0) && !self.counts.is_empty();
        !o.logit_bias.is_empty() || penalties
    }

    /// What the bias and penalties add to the next pick's logits: each
    /// bias, then each counted token's penalty as the addition of
    /// `−(frequency · count + presence)` (the same float as subtracting
    /// it), ordered by token id and, on one id, biases in their order
    /// before its penalty. Two additions to different ids commute, so
    /// applying these in order, or each id's run in order and the runs in
    /// any order (a device, a run a unit), gives the logits
    /// [`Sampler::sample`] picks from bit for bit. Empty when none apply.
    pub fn adjustments(&self) -> Vec<(u32, f32)> {
        let o = &self.opts;
        if !self.adjusts() {
            return vec![];
        }
        let mut adds = o.logit_bias.clone();
        if o.frequency_penalty != 0.0 || o.presence_penalty != 0.0 {
            adds.extend(
                self.counts
                    .iter()
                    .map(|(&id, &c)| (id, -(o.frequency_penalty * c as f32 + o.presence_penalty))),
            );
        }
        // Stable: an id's biases keep their order, its penalty (pushed
        // after every bias) stays last.
        adds.sort_by_key(|a| a.0);
        adds
    }

    /// Bias and penalties applied, or `None` when there are none (the common
    /// case: no copy of the logits).
    fn adjusted(&self, logits: &[f32]) -> Option<Vec<f32>> {
        let adds = self.adjustments();
        if adds.is_empty() {
            return None;
        }
        let mut l = logits.to_vec();
        for (id, a) in adds {
            if let Some(x) = l.get_mut(id as usize) {
                *x += a;
            }
        }
        Some(l)
    }

    /// The next token of `logits` (bias and penalties applied).
    fn pick(&mut self, logits: &[f32]) -> u32 {
        if !self.draws_rng(logits.len()) {
            return argmax(logits);
        }
        let p = &self.opts;
        let t = p.temperature;
        let k = self.top_k(logits.len());
        if k == logits.len() && p.top_p >= 1.0 && p.min_p <= 0.0 {
            // Plain temperature sampling needs no sort: draw in id order.
            let u = self.uniform();
            return draw_temperature(logits, t, u);
        }
        // Candidates best first. The top-p / min-p cut usually lies in the
        // first few dozen tokens: try growing prefixes before sorting all
        // ~50k of the vocabulary.
        let mut n = k.min(64);
        let (cand, probs) = loop {
            let cand = top_n(logits, n);
            if let Some(probs) = self.kept_probs(logits, &cand, k) {
                break (cand, probs);
            }
            n = (n * 8).min(k);
        };
        self.draw(&probs, |i| cand[i].0)
    }

    /// The uniform of this token's draw, counted.
    fn uniform(&mut self) -> f32 {
        self.draws += 1;
        self.rng.random::<f32>()
    }

    /// Draw index `i` with probability proportional to `probs[i]`.
    fn draw(&mut self, probs: &[f32], id: impl Fn(usize) -> u32) -> u32 {
        let u = self.uniform();
        draw_at(probs, u, id)
    }

    /// Probabilities of the best-first candidates `cand` kept by top-p and
    /// min-p, normalised over the top-`k` set. `None` when neither cut
    /// falls inside `cand` and `cand` is not the whole top-k set yet.
    fn kept_probs(&self, logits: &[f32], cand: &[(u32, f32)], k: usize) -> Option<Vec<f32>> {
        let t = self.opts.temperature;
        let max = cand[0].1 / t;
        let complete = cand.len() == k;
        let z = if complete {
            mass(cand.iter().map(|c| c.1), t, max)
        } else if k == logits.len() {
            row_mass(logits, t, cand[0].1)
        } else {
            mass(top_n(logits, k).iter().map(|c| c.1), t, max)
        };
        self.cut(cand, complete, z)
    }

    /// [`Sampler::kept_probs`] given `z`, the mass of the top-`k` set
    /// (`complete`: `cand` is that whole set).
    fn cut(&self, cand: &[(u32, f32)], complete: bool, z: f32) -> Option<Vec<f32>> {
        let p = &self.opts;
        let t = p.temperature;
        let max = cand[0].1 / t;
        let probs: Vec<f32> = cand.iter().map(|&(_, l)| (l / t - max).exp() / z).collect();
        let mut keep = probs.len();
        let mut cut = complete;
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            if let Some(i) = probs.iter().position(|&pr| {
                acc += pr;
                acc >= p.top_p
            }) {
                keep = i + 1;
                cut = true;
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p;
            let above = probs.iter().take_while(|&&x| x >= floor).count().max(1);
            if above < probs.len() {
                cut = true;
            }
            keep = keep.min(above);
        }
        cut.then(|| probs[..keep].to_vec())
    }
}

#[cfg(test)]
#[path = "sampling_tests.rs"]
mod tests;
