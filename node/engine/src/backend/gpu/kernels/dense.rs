//! The dense step's element-wise kernels (`backend::gpu::dense`): its
//! matmuls are cubek's over f16 operands, so each one's input is written
//! in f16 (the attention's output, a norm, SwiGLU: `attention`,
//! `ops::rms_norm` and `ops::glu` in f16), and its output, in f32,
//! joins the residual in the next norm's launch ([`add_rms_norm`]; the
//! quantized kernels norm their input and add their output themselves).

use cubecl::prelude::*;

use super::ops::{norm_row, ROW_THREADS};

/// For cube `c` (row `r = idx[c]`): `x[r] += d[r]`, then [`ops::rms_norm`]
/// of the sum into row `c` of `h` (the same operations as an add, then
/// that norm: the same bits). A projection joins the residual in the
/// launch that norms the next matmul's input. Launch with
/// `CubeCount (idx.len())`, `CubeDim (ROW_THREADS)`.
///
/// [`ops::rms_norm`]: super::ops::rms_norm
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm<E: Float>(
    x: &mut [f32],
    d: &[f32],
    w: &[f32],
    h: &mut [E],
    idx: &[u32],
    hidden: usize,
    eps: f32,
) {
    let c = CUBE_POS_X as usize;
    let r = idx[c] as usize;
    let mut i = UNIT_POS_X as usize;
    while i < hidden {
        x[r * hidden + i] += d[r * hidden + i];
        i += ROW_THREADS;
    }
    // The norm's lanes read elements other units wrote.
    sync_storage();
    sync_cube();
    norm_row(x.slice(0, x.len()), w, h, c, r, hidden, eps);
}

/// `out[i, r0 + j] = part[i, j]` for the `n` values of `part` (`[·, rows]`
/// into `[·, width]`): a matrix part's product into its columns
/// (`dense::matmul`). Launch over `n` units.
#[cube(launch)]
pub fn copy_cols(part: &[f32], out: &mut [f32], rows: usize, width: usize, r0: usize, n: usize) {
    let p = ABSOLUTE_POS;
    if p < n {
        out[(p / rows) * width + r0 + p % rows] = part[p];
    }
}
