//! Element-wise and per-row kernels of a decoder layer: residual add fused
//! with RMSNorm, and SwiGLU.

use cubecl::prelude::*;

/// Units per cube of the row kernels.
pub const ROW_THREADS: usize = 128;

/// For cube `c` (row `r = idx[c]`): `x[r] += delta[r]` when `add`, then
/// `h[c] = x[r] / sqrt(mean(x[r]²) + eps) · w` (llama.cpp's RMSNorm; the
/// CPU path sums the squares in f64, here a tree of f32 partial sums).
/// With `idx` the identity this is every row of a layer; with each
/// sequence's last row it is the output norm before the LM head.
/// Launch with `CubeCount (idx.len())`, `CubeDim (ROW_THREADS)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm(
    x: &mut [f32],
    delta: &[f32],
    w: &[f32],
    h: &mut [f32],
    idx: &[u32],
    hidden: usize,
    eps: f32,
    #[comptime] add: bool,
) {
    let c = CUBE_POS_X as usize;
    let r = idx[c] as usize;
    let tid = UNIT_POS_X as usize;
    let mut ss = 0.0f32;
    let mut i = tid;
    while i < hidden {
        let mut v = x[r * hidden + i];
        if comptime!(add) {
            v += delta[r * hidden + i];
            x[r * hidden + i] = v;
        }
        ss += v * v;
        i += ROW_THREADS;
    }
    let mut sh = Shared::new_slice(ROW_THREADS);
    sh[tid] = ss;
    sync_cube();
    let mut stride = (ROW_THREADS / 2).runtime();
    while stride > 0 {
        if tid < stride {
            sh[tid] = sh[tid] + sh[tid + stride];
        }
        sync_cube();
        stride /= 2;
    }
    let scale = 1.0f32 / f32::sqrt(sh[0] / f32::cast_from(hidden as u32) + eps);
    let mut i = tid;
    while i < hidden {
        // Each unit reads back only what it wrote itself above.
        h[c * hidden + i] = (x[r * hidden + i] * scale) * w[i];
        i += ROW_THREADS;
    }
}

/// `silu(g) · u`.
#[cube]
pub fn silu_mul(g: f32, u: f32) -> f32 {
    g / (1.0f32 + f32::exp(-g)) * u
}

/// `act[j, i] = silu(gu[j, i]) · gu[j, inter + i]` for rows `gu = [gate | up]`.
/// Launch over `n · inter` units. (The decoder's down projection computes
/// this as it reads its input, `quant::input`; the kernel stays as the
/// reference the fused matmuls are tested against.)
#[cube(launch)]
pub fn swiglu(gu: &[f32], act: &mut [f32], inter: usize) {
    let p = ABSOLUTE_POS;
    if p < act.len() {
        let (j, i) = (p / inter, p % inter);
        act[p] = silu_mul(gu[j * 2 * inter + i], gu[j * 2 * inter + inter + i]);
    }
}

/// Units per cube of [`argmax_rows`].
pub const ARGMAX_THREADS: usize = 256;

/// `out[r]` = the index of row `r`'s largest logit, the lowest index on
/// ties (as the host's `sampling::argmax`, so a greedy token is the same
/// whichever side picks it). Each unit scans a stride of the row, keeping
/// its first best; the units' bests meet in a shared-memory tree that
/// prefers the lower index on equal values. Launch with
/// `CubeCount (rows)`, `CubeDim (ARGMAX_THREADS)`.
#[cube(launch)]
pub fn argmax_rows(logits: &[f32], out: &mut [u32], vocab: usize) {
    let row = CUBE_POS_X as usize;
    let tid = UNIT_POS_X as usize;
    let base = row * vocab;
    let mut best = (-3.0e38f32).runtime();
    let mut at = u32::MAX.runtime();
    let mut i = tid;
    while i < vocab {
        let v = logits[base + i];
        if v > best || at == u32::MAX {
            best = v;
            at = i as u32;
        }
        i += ARGMAX_THREADS;
    }
    let mut sv = Shared::new_slice(ARGMAX_THREADS);
    let mut si = Shared::new_slice(ARGMAX_THREADS);
    sv[tid] = best;
    si[tid] = at;
    sync_cube();
    let mut stride = (ARGMAX_THREADS / 2).runtime();
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
    if tid == 0 {
        out[row] = si[0];
    }
}
