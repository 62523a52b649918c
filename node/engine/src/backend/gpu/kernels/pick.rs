//! A row's grammar mask, bias and penalties (and, for a sequence with
//! logprobs beside them, its candidates before the additions), then its
//! token: its argmax or a temperature draw (or its best candidates,
//! `top.rs`), with the picked token's logit.

use cubecl::prelude::*;

use super::exact::ggml_expf;
use super::top::{select_top, TOP_N, TOP_STRIDE};

/// Units per cube of [`adjust_rows`]: one a candidate, as
/// [`select_top`] needs.
pub const ADJUST_THREADS: usize = TOP_N;

/// Whether token `t` is set in the mask `words[m0..m1]` (bit `t % 32` of
/// word `t / 32`; a token past the mask's words is not).
#[cube]
fn allowed(words: &[u32], m0: usize, m1: usize, t: usize) -> bool {
    let w = m0 + t / 32;
    let mut ok = false;
    if w < m1 {
        ok = ((words[w] >> (t % 32) as u32) & 1) == 1;
    }
    ok
}

/// What the host's sampler does to row `r` of `logits` before a pick
/// ([`pick_rows`]), in its order (`backend::Adjust`): where the row has a
/// grammar mask (`words[moff[r]..moff[r + 1]]`, not empty), each token it
/// does not allow becomes `ninf` (−inf, passed in: WGSL has no infinite
/// literal); then the row's additions `(ids, adds)[off[r]..off[r + 1]]`
/// (a bias and penalties) to the tokens it allows. One token's additions
/// are consecutive: the unit at the first of them adds them all, in
/// order, so a logit ends as the host's additions one after another
/// leave it, bit for bit, and no two units write one logit (the mask
/// writes only the tokens the additions skip). Each addition's token's
/// logit before them goes to `raw` at its index (`ninf` where masked).
/// An id past the vocabulary is skipped (the decoder refuses it before).
///
/// Where the row is scored (`pick[r * PICK_STRIDE + 3]`, a sequence with
/// logprobs: `backend::Pick::Scored`), its candidates and masses between
/// the mask and the additions, in `scored[r * TOP_STRIDE..]` as
/// [`pick_rows`] writes a row's (the mass at a temperature 0; `wide` as
/// there). Launch with `CubeCount (rows)`, `CubeDim (ADJUST_THREADS)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn adjust_rows(
    logits: &mut [f32],
    off: &[u32],
    ids: &[u32],
    adds: &[f32],
    raw: &mut [f32],
    moff: &[u32],
    words: &[u32],
    pick: &[f32],
    scored: &mut [f32],
    ninf: f32,
    vocab: usize,
    #[comptime] wide: bool,
) {
    let row = CUBE_POS_X as usize;
    let tid = UNIT_POS_X as usize;
    let base = row * vocab;
    let (m0, m1) = (moff[row] as usize, moff[row + 1] as usize);
    // The same for every unit of the cube: the branches are uniform.
    let masked = m1 > m0;
    if masked {
        let mut t = tid;
        while t < vocab {
            if !allowed(words, m0, m1, t) {
                logits[base + t] = ninf;
            }
            t += ADJUST_THREADS;
        }
    }
    if pick[PICK_STRIDE * row + 3] > 0.5 {
        // The masked row whole before it is scored, scored before the
        // additions change it.
        sync_cube();
        score_row(&*logits, base, vocab, tid, scored, row * TOP_STRIDE, wide);
        sync_cube();
    }
    let (lo, hi) = (off[row] as usize, off[row + 1] as usize);
    let mut i = lo + tid;
    while i < hi {
        let id = ids[i];
        let mut first = i == lo;
        if !first {
            first = ids[i - 1] != id;
        }
        if first && (id as usize) < vocab {
            let at = base + id as usize;
            // A masked token stays −inf (another unit wrote it).
            let open = !masked || allowed(words, m0, m1, id as usize);
            let before = select(open, logits[at], ninf);
            let mut x = before;
            let mut j = i;
            let mut more = true;
            while more {
                raw[j] = before;
                x += adds[j];
                j += 1;
                more = j < hi;
                if more {
                    more = ids[j] == id;
                }
            }
            if open {
                logits[at] = x;
            }
        }
        i += ADJUST_THREADS;
    }
}

/// Units per cube of [`pick_rows`].
pub const PICK_THREADS: usize = 256;

/// Floats per row of [`pick_rows`]' `pick`: temperature, uniform, whether
/// to select the row's candidates, and whether [`adjust_rows`] scores it.
pub const PICK_STRIDE: usize = 4;

/// `out[r]` = row `r`'s token, with `[t, u, sel, _] = pick[4r..]`: with
/// the temperature `t <= 0` the index of its largest logit, the lowest
/// index on ties (as the host's `sampling::argmax`, so a greedy token is
/// the same whichever side picks it); with `t > 0` and the uniform
/// `u >= 0`, the token plain temperature sampling draws at `u`, as the
/// host's `sampling::draw_temperature`: the first id whose running sum of
/// `exp(l / t - max / t)` passes `u` times the whole sum, the last id
/// when rounding leaves none. The running sum is grouped by ranges of ids
/// (unit `k` sums range `k` in order, unit 0 adds the ranges in order and
/// scans the range the draw falls in) as the host's groups it, so the two
/// round alike, and the weights are the host's bits ([`weight`]): from
/// the same logits the two draw the same token. With `t > 0`
/// and `u < 0` (a draw the host finishes) the argmax. `chosen[r]` = the
/// logit of `out[r]` (a token's logprob without its row). `wide` where
/// `fma` may round twice (wgpu: [`super::q8::fused`]).
///
/// With `sel = 1` (a top-k / top-p / min-p draw, or logprobs), also the
/// row's best candidates ([`select_top`]) in `top[r * TOP_STRIDE..]`,
/// then the whole sum of the draw's weights above (0 without a draw) and
/// the sum of `exp(l - max)` (temperature 1), both grouped as above.
///
/// For the argmax each unit scans a stride of the row, keeping its first
/// best; the units' bests meet in a shared-memory tree that prefers the
/// lower index on equal values. Launch with `CubeCount (rows)`,
/// `CubeDim (PICK_THREADS)`.
#[cube(launch)]
pub fn pick_rows(
    logits: &[f32],
    pick: &[f32],
    out: &mut [u32],
    chosen: &mut [f32],
    top: &mut [f32],
    vocab: usize,
    #[comptime] wide: bool,
) {
    let row = CUBE_POS_X as usize;
    let tid = UNIT_POS_X as usize;
    let base = row * vocab;
    let best = row_argmax(logits, base, vocab, tid);
    // The same values for every unit of the cube: the branches are uniform.
    let t = pick[PICK_STRIDE * row];
    let u = pick[PICK_STRIDE * row + 1];
    let sel = pick[PICK_STRIDE * row + 2] > 0.5;
    let at = row * TOP_STRIDE;
    if t > 0.0 || sel {
        let max = logits[base + best as usize];
        let sums = range_masses(logits, base, vocab, tid, t, max, sel, wide);
        if tid == 0 {
            let (mut total, mut total1) = (0.0f32.runtime(), 0.0f32.runtime());
            for k in 0..PICK_THREADS {
                total += sums[k];
                total1 += sums[PICK_THREADS + k];
            }
            if sel {
                top[at + 2 * TOP_N] = total;
                top[at + 2 * TOP_N + 1] = total1;
            }
            let range = (vocab + PICK_THREADS - 1) / PICK_THREADS;
            let mut tok = best;
            if t > 0.0 && u >= 0.0 {
                tok = draw_in_ranges(logits, base, vocab, &sums, range, t, max, u * total, wide);
            }
            out[row] = tok;
            chosen[row] = logits[base + tok as usize];
        }
        if sel {
            select_top(logits, base, vocab, tid, top, at);
        }
    } else if tid == 0 {
        out[row] = best;
        chosen[row] = logits[base + best as usize];
    }
}

/// The candidates of `logits[base..base + vocab]` and the sum of
/// `exp(l - max)`, as [`pick_rows`] selects and sums a row's at `sel = 1`,
/// in `top[at..]` (the mass at a temperature 0). Every unit of a
/// `PICK_THREADS`-unit cube calls it.
#[cube]
fn score_row(
    logits: &[f32],
    base: usize,
    vocab: usize,
    tid: usize,
    top: &mut [f32],
    at: usize,
    #[comptime] wide: bool,
) {
    let best = row_argmax(logits, base, vocab, tid);
    let max = logits[base + best as usize];
    let sums = range_masses(logits, base, vocab, tid, 0.0, max, true, wide);
    if tid == 0 {
        let mut total1 = 0.0f32.runtime();
        for k in 0..PICK_THREADS {
            total1 += sums[PICK_THREADS + k];
        }
        top[at + 2 * TOP_N] = 0.0;
        top[at + 2 * TOP_N + 1] = total1;
    }
    select_top(logits, base, vocab, tid, top, at);
}

/// The index of the largest of `logits[base..base + vocab]`, the lowest
/// on ties, for every unit of a `PICK_THREADS`-unit cube: each unit scans
/// a stride of the row keeping its first best, and the units' bests meet
/// in a shared-memory tree that prefers the lower index on equal values.
#[cube]
fn row_argmax(logits: &[f32], base: usize, vocab: usize, tid: usize) -> u32 {
    let mut best = (-3.0e38f32).runtime();
    let mut at = u32::MAX.runtime();
    // Eight loads issued before they are compared (in order): a unit
    // does not wait a load latency per logit.
    let mut lv = Array::<f32>::new(8usize);
    let mut i = tid;
    while i + 7 * PICK_THREADS < vocab {
        #[unroll]
        for u in 0..8usize {
            lv[u] = logits[base + i + u * PICK_THREADS];
        }
        #[unroll]
        for u in 0..8usize {
            if lv[u] > best || at == u32::MAX {
                best = lv[u];
                at = (i + u * PICK_THREADS) as u32;
            }
        }
        i += 8 * PICK_THREADS;
    }
    while i < vocab {
        let v = logits[base + i];
        if v > best || at == u32::MAX {
            best = v;
            at = i as u32;
        }
        i += PICK_THREADS;
    }
    let mut sv = Shared::new_slice(PICK_THREADS);
    let mut si = Shared::new_slice(PICK_THREADS);
    sv[tid] = best;
    si[tid] = at;
    sync_cube();
    let mut stride = (PICK_THREADS / 2).runtime();
    while stride > 0 {
        if tid < stride {
            let (v, j) = (sv[tid + stride], si[tid + stride]);
            let (w, k) = (sv[tid], si[tid]);
            // An empty slot (index u32::MAX) never wins over a filled one.
            let take = k == u32::MAX || (j != u32::MAX && (v > w || (v == w && j < k)));
            if take {
                sv[tid] = v;
                si[tid] = j;
            }
        }
        sync_cube();
        stride /= 2;
    }
    si[0]
}

/// Each unit's range of ids' sums of the weights at temperature `t`
/// (where `t > 0`, else 0) at `[k]` and, with `unit`, at temperature 1
/// (the logprobs' normaliser) at `[PICK_THREADS + k]`: unit `k` sums range
/// `k` in order. Every unit of a `PICK_THREADS`-unit cube calls it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn range_masses(
    logits: &[f32],
    base: usize,
    vocab: usize,
    tid: usize,
    t: f32,
    max: f32,
    unit: bool,
    #[comptime] wide: bool,
) -> Shared<[f32]> {
    let range = (vocab + PICK_THREADS - 1) / PICK_THREADS;
    let lo = select(tid * range < vocab, tid * range, vocab);
    let hi = select(lo + range < vocab, lo + range, vocab);
    let mut sums = Shared::new_slice(comptime!(2 * PICK_THREADS));
    let (mut s, mut s1) = (0.0f32.runtime(), 0.0f32.runtime());
    let mut i = lo;
    while i < hi {
        let l = logits[base + i];
        if t > 0.0 {
            s += weight(l, t, max, wide);
        }
        if unit {
            s1 += weight(l, 1.0, max, wide);
        }
        i += 1;
    }
    sums[tid] = s;
    sums[PICK_THREADS + tid] = s1;
    sync_cube();
    sums
}

/// The token whose running sum of weights (at temperature `t`) first
/// passes `r`: the range `sums` says it falls in, rescanned in order; the
/// last id when rounding leaves none.
#[cube]
#[allow(clippy::too_many_arguments)]
fn draw_in_ranges(
    logits: &[f32],
    base: usize,
    vocab: usize,
    sums: &[f32],
    range: usize,
    t: f32,
    max: f32,
    r: f32,
    #[comptime] wide: bool,
) -> u32 {
    // The first range whose end passes r, and the sum before it.
    let (mut hit, mut before, mut sum) =
        (PICK_THREADS.runtime(), 0.0f32.runtime(), 0.0f32.runtime());
    for k in 0..PICK_THREADS {
        let next = sum + sums[k];
        if hit == PICK_THREADS && r < next {
            hit = k;
            before = sum;
        }
        sum = next;
    }
    let mut tok = (vocab - 1) as u32;
    if hit < PICK_THREADS {
        // The range's own sum again, in its order: it passes r by its
        // end at the latest (its last id otherwise).
        let lo = hit * range;
        let hi = select(lo + range < vocab, lo + range, vocab);
        let (mut acc, mut found) = (0.0f32.runtime(), false.runtime());
        tok = (hi - 1) as u32;
        let mut i = lo;
        while i < hi {
            acc += weight(logits[base + i], t, max, wide);
            if !found && r < before + acc {
                tok = i as u32;
                found = true;
            }
            i += 1;
        }
    }
    tok
}

/// A logit's unnormalised probability at temperature `t`,
/// `exp(l / t - max / t)` by ggml's `expf` as the host's
/// `attn_paged::weights::exp_weight`: IEEE operations only, so the two
/// give the same bits (the platform's `exp` may not: CUDA's `expf` is
/// within 2 ulp). One function, so both passes over a range compute the
/// same bits. `wide` where `fma` may round twice (wgpu).
#[cube]
fn weight(l: f32, t: f32, max: f32, #[comptime] wide: bool) -> f32 {
    ggml_expf(l / t - max / t, wide)
}
