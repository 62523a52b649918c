//! The dense step's element-wise kernels (`backend::gpu::dense`): its
//! matmuls are cubek's over f16 operands, so each one's input is written
//! in f16 (a norm, SwiGLU, the attention's output), and its output, in
//! f32, joins the residual by an add of its own (the quantized kernels
//! norm their input and add their output themselves).

use cubecl::prelude::*;

use super::ops::{row_scales, silu_mul, ROW_THREADS};

/// For cube `c` (row `r = idx[c]`): `h[c] = E(x[r] · scale_r · w)`, the
/// operations of [`super::ops::rms_norm`] rounded to `E` at the end.
/// Launch with `CubeCount (idx.len())`, `CubeDim (ROW_THREADS)`.
#[cube(launch)]
pub fn norm_to<E: Float>(x: &[f32], w: &[f32], h: &mut [E], idx: &[u32], hidden: usize, eps: f32) {
    let c = CUBE_POS_X as usize;
    let r = idx[c] as usize;
    let tid = UNIT_POS_X as usize;
    let sc = row_scales(x, r, r + 1, hidden, eps, tid, ROW_THREADS, 1usize);
    let scale = sc[0];
    let mut i = tid;
    while i < hidden {
        h[c * hidden + i] = E::cast_from((x[r * hidden + i] * scale) * w[i]);
        i += ROW_THREADS;
    }
}

/// `act[j, i] = E(silu(gu[j, i]) · gu[j, inter + i])` for the first `n`
/// values of `act` (`n / inter` rows `[gate | up]`). Launch over `n` units.
#[cube(launch)]
pub fn swiglu_to<E: Float>(gu: &[f32], act: &mut [E], inter: usize, n: usize) {
    let p = ABSOLUTE_POS;
    if p < n {
        let (j, i) = (p / inter, p % inter);
        act[p] = E::cast_from(silu_mul(gu[j * 2 * inter + i], gu[j * 2 * inter + inter + i]));
    }
}

/// `out[p] = E(x[p])` for `p < n`. Launch over `n` units.
#[cube(launch)]
pub fn cast_to<E: Float>(x: &[f32], out: &mut [E], n: usize) {
    let p = ABSOLUTE_POS;
    if p < n {
        out[p] = E::cast_from(x[p]);
    }
}

/// `x[p] += d[p]` for `p < n` (a projection joining the residual).
/// Launch over `n` units.
#[cube(launch)]
pub fn add_in(x: &mut [f32], d: &[f32], n: usize) {
    let p = ABSOLUTE_POS;
    if p < n {
        x[p] += d[p];
    }
}
