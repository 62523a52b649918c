//! Element-wise and per-row kernels of a decoder layer: RMSNorm (and the
//! order of its sum every kernel that norms a row follows), SwiGLU, and
//! a row's grammar mask, bias and penalties, and its token: its argmax or
//! a temperature draw (or its best candidates, `top.rs`).

use cubecl::prelude::*;

use super::rounding::round_f16;
use super::top::{select_top, TOP_N, TOP_STRIDE};

/// Units per cube of [`rms_norm`].
pub const ROW_THREADS: usize = 128;

/// Lanes of the float RMSNorm's sum of squares. Lane `l` sums `x[l]²`,
/// `x[l + 32]²`, … in order, and the lanes meet in a tree: `P_l + P_{l+16}`,
/// then strides 8, 4, 2, 1 (the matmul lanes' order, `quant.rs`). One
/// order for every kernel that norms a row ([`rms_norm`], and each matmul
/// that reads normed rows, whatever its cube), so a row's norm does not
/// depend on the batch it ran in.
pub const NORM_LANES: usize = 32;

/// `1 / sqrt(mean(x[j]²) + eps)` of the `rows` rows `j = j0 ..`
/// (`x[j, cols]`; rows from `n` on give `1 / sqrt(eps)`, never used), in
/// a shared slice indexed from 0. Every unit of the cube calls it:
/// `units` units, this one `tid`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn row_scales(
    x: &[f32],
    j0: usize,
    n: usize,
    cols: usize,
    eps: f32,
    tid: usize,
    units: usize,
    #[comptime] rows: usize,
) -> Shared<[f32]> {
    let mut part = Shared::new_slice(comptime!(rows * NORM_LANES));
    let mut sc = Shared::new_slice(rows);
    let mut p = tid;
    while p < comptime!(rows * NORM_LANES) {
        let (j, l) = (p / NORM_LANES, p % NORM_LANES);
        let mut ss = 0.0f32;
        if j0 + j < n {
            let base = (j0 + j) * cols;
            // Eight loads issued before their squares are added (in order).
            let mut xv = Array::<f32>::new(8usize);
            let mut i = l;
            while i + 7 * NORM_LANES < cols {
                #[unroll]
                for u in 0..8usize {
                    xv[u] = x[base + i + u * NORM_LANES];
                }
                #[unroll]
                for u in 0..8usize {
                    ss += xv[u] * xv[u];
                }
                i += 8 * NORM_LANES;
            }
            while i < cols {
                let v = x[base + i];
                ss += v * v;
                i += NORM_LANES;
            }
        }
        part[p] = ss;
        p += units;
    }
    sync_cube();
    let mut stride = (NORM_LANES / 2).runtime();
    while stride > 0 {
        let mut p = tid;
        while p < rows * stride {
            let k = (p / stride) * NORM_LANES + p % stride;
            part[k] = part[k] + part[k + stride];
            p += units;
        }
        sync_cube();
        stride /= 2;
    }
    let mut p = tid;
    while p < rows {
        sc[p] = 1.0f32 / f32::sqrt(part[p * NORM_LANES] / f32::cast_from(cols as u32) + eps);
        p += units;
    }
    sync_cube();
    sc
}

/// For cube `c` (row `r = idx[c]`): `h[c] = x[r] / sqrt(mean(x[r]²) + eps)
/// · w` (llama.cpp's RMSNorm; the CPU path sums the squares in f64, here
/// [`row_scales`]'s f32 order). With each sequence's last row for `idx`
/// this is the output norm before the LM head (a layer's norms are read
/// inside its matmuls, `quant::InputKind::Norm`, with the same
/// operations). `h` in f32, or rounded to f16 at the end (the dense
/// step's matmul input, `super::dense`). Launch with `CubeCount
/// (idx.len())`, `CubeDim (ROW_THREADS)`.
#[cube(launch)]
pub fn rms_norm<E: Float>(x: &[f32], w: &[f32], h: &mut [E], idx: &[u32], hidden: usize, eps: f32) {
    let c = CUBE_POS_X as usize;
    norm_row(x, w, h, c, idx[c] as usize, hidden, eps);
}

/// [`rms_norm`]'s work for cube `c`: row `r` of `x` normed into row `c`
/// of `h`, by the cube's `ROW_THREADS` units.
#[cube]
pub fn norm_row<E: Float>(
    x: &[f32],
    w: &[f32],
    h: &mut [E],
    c: usize,
    r: usize,
    hidden: usize,
    eps: f32,
) {
    let tid = UNIT_POS_X as usize;
    let sc = row_scales(x, r, r + 1, hidden, eps, tid, ROW_THREADS, 1usize);
    let scale = sc[0];
    let mut i = tid;
    while i < hidden {
        h[c * hidden + i] = E::cast_from((x[r * hidden + i] * scale) * w[i]);
        i += ROW_THREADS;
    }
}

/// `silu(g) · u`.
#[cube]
pub fn silu_mul(g: f32, u: f32) -> f32 {
    g / (1.0f32 + f32::exp(-g)) * u
}

/// `gelu(g) · u` as `gemma3::geglu_rows` computes it: 0 from `g <= −10`,
/// `g · u` from `g >= 10`, else ggml's tanh GELU of `g` rounded to f16,
/// rounded to f16 (its table), times `u`. `0.5 · (1 + tanh z)` is taken
/// as `1 / (1 + exp(−2z))`, which does not cancel where `tanh z` nears −1
/// (the CPU's own f32 sum does, by up to 3e-7; a device `tanh` more).
#[cube]
pub fn gelu_mul(g: f32, u: f32) -> f32 {
    let x = round_f16(g);
    let z = 0.797_884_6f32 * x * (0.044715f32 * x * x + 1.0f32);
    let gl = round_f16(x / (1.0f32 + f32::exp(-2.0f32 * z)));
    let v = select(g >= 10.0f32, g, gl) * u;
    select(g <= -10.0f32, 0.0f32, v)
}

/// `act[j, i] = silu(gu[j, i]) · gu[j, inter + i]` for rows `gu = [gate | up]`
/// (with `gelu`: gemma3's GeGLU, [`gelu_mul`]), the first `n` values
/// of `act`, in f32 or rounded to f16 at the end (the dense step's matmul
/// input, `super::dense`). Launch over `n` units. (The quantized step
/// computes this as its down projection reads its input, `quant::input`;
/// the kernel stays as the reference the fused matmuls are tested
/// against.)
#[cube(launch)]
pub fn glu<E: Float>(gu: &[f32], act: &mut [E], inter: usize, n: usize, #[comptime] gelu: bool) {
    let p = ABSOLUTE_POS;
    if p < n {
        let (j, i) = (p / inter, p % inter);
        let (g, u) = (gu[j * 2 * inter + i], gu[j * 2 * inter + inter + i]);
        let v = if comptime!(gelu) { gelu_mul(g, u) } else { silu_mul(g, u) };
        act[p] = E::cast_from(v);
    }
}

/// Units per cube of [`adjust_rows`].
pub const ADJUST_THREADS: usize = 256;

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
/// writes only the tokens the additions skip). An id past the vocabulary
/// is skipped (the decoder refuses it before). Launch with
/// `CubeCount (rows)`, `CubeDim (ADJUST_THREADS)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn adjust_rows(
    logits: &mut [f32],
    off: &[u32],
    ids: &[u32],
    adds: &[f32],
    moff: &[u32],
    words: &[u32],
    ninf: f32,
    vocab: usize,
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
    let (lo, hi) = (off[row] as usize, off[row + 1] as usize);
    let mut i = lo + tid;
    while i < hi {
        let id = ids[i];
        let mut first = i == lo;
        if !first {
            first = ids[i - 1] != id;
        }
        let mut apply = first && (id as usize) < vocab;
        if apply && masked {
            apply = allowed(words, m0, m1, id as usize);
        }
        if apply {
            let at = base + id as usize;
            let mut x = logits[at];
            let mut j = i;
            let mut more = true;
            while more {
                x += adds[j];
                j += 1;
                more = j < hi;
                if more {
                    more = ids[j] == id;
                }
            }
            logits[at] = x;
        }
        i += ADJUST_THREADS;
    }
}

/// Units per cube of [`pick_rows`].
pub const PICK_THREADS: usize = 256;

/// Floats per row of [`pick_rows`]' `pick`: temperature, uniform, and
/// whether to select the row's candidates.
pub const PICK_STRIDE: usize = 3;

/// `out[r]` = row `r`'s token, with `[t, u, sel] = pick[3r..]`: with the
/// temperature `t <= 0` the index of its largest logit, the lowest index
/// on ties (as the host's `sampling::argmax`, so a greedy token is the
/// same whichever side picks it); with `t > 0` and the uniform `u >= 0`,
/// the token plain temperature sampling draws at `u`, as the host's
/// `sampling::draw_temperature`: the first id whose running sum of
/// `exp(l / t - max / t)` passes `u` times the whole sum, the last id when
/// rounding leaves none. The running sum is grouped by ranges of ids (unit
/// `k` sums range `k` in order, unit 0 adds the ranges in order and scans
/// the range the draw falls in), so it may round differently from the
/// host's one sum: a draw right at a boundary between two tokens can
/// differ, as a greedy token can where float logits differ. With `t > 0`
/// and `u < 0` (a draw the host finishes) the argmax.
///
/// With `sel = 1` (a top-k / top-p / min-p draw, or logprobs), also the
/// row's best candidates ([`top::select_top`]) in `top[r * TOP_STRIDE..]`,
/// then the whole sum of the draw's weights above (0 without a draw) and
/// the sum of `exp(l - max)` (temperature 1), both grouped as above.
///
/// For the argmax each unit scans a stride of the row, keeping its first
/// best; the units' bests meet in a shared-memory tree that prefers the
/// lower index on equal values. Launch with `CubeCount (rows)`,
/// `CubeDim (PICK_THREADS)`.
#[cube(launch)]
pub fn pick_rows(logits: &[f32], pick: &[f32], out: &mut [u32], top: &mut [f32], vocab: usize) {
    let row = CUBE_POS_X as usize;
    let tid = UNIT_POS_X as usize;
    let base = row * vocab;
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
    // The same values for every unit of the cube: the branches are uniform.
    let t = pick[PICK_STRIDE * row];
    let u = pick[PICK_STRIDE * row + 1];
    let sel = pick[PICK_STRIDE * row + 2] > 0.5;
    let at = row * TOP_STRIDE;
    if t > 0.0 || sel {
        let max = sv[0];
        // Every unit has read the max before the sums overwrite it.
        sync_cube();
        let range = (vocab + PICK_THREADS - 1) / PICK_THREADS;
        let lo = select(tid * range < vocab, tid * range, vocab);
        let hi = select(lo + range < vocab, lo + range, vocab);
        // The draw's weights, and (for the candidates) those at
        // temperature 1, whose sum gives the logprobs' normaliser.
        let mut su = Shared::new_slice(PICK_THREADS);
        let (mut s, mut s1) = (0.0f32.runtime(), 0.0f32.runtime());
        let mut i = lo;
        while i < hi {
            let l = logits[base + i];
            if t > 0.0 {
                s += weight(l, t, max);
            }
            if sel {
                s1 += weight(l, 1.0, max);
            }
            i += 1;
        }
        sv[tid] = s;
        su[tid] = s1;
        sync_cube();
        if tid == 0 {
            let (mut total, mut total1) = (0.0f32.runtime(), 0.0f32.runtime());
            for k in 0..PICK_THREADS {
                total += sv[k];
                total1 += su[k];
            }
            if sel {
                top[at + 2 * TOP_N] = total;
                top[at + 2 * TOP_N + 1] = total1;
            }
            if t > 0.0 && u >= 0.0 {
                out[row] = draw_in_ranges(logits, base, vocab, &sv, range, t, max, u * total);
            } else {
                out[row] = si[0];
            }
        }
        if sel {
            select_top(logits, base, vocab, tid, top, at);
        }
    } else if tid == 0 {
        out[row] = si[0];
    }
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
            acc += weight(logits[base + i], t, max);
            if !found && r < before + acc {
                tok = i as u32;
                found = true;
            }
            i += 1;
        }
    }
    tok
}

/// A logit's unnormalised probability at temperature `t` (the host's
/// `exp(l / t - max / t)`); one function, so both passes over a range
/// compute the same bits.
#[cube]
fn weight(l: f32, t: f32, max: f32) -> f32 {
    f32::exp(l / t - max / t)
}
