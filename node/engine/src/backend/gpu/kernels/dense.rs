//! The dense step's element-wise kernels (`backend::gpu::dense`): its
//! matmuls are cubek's over f16 operands, so each one's input is written
//! in f16 (the attention's output; a norm and SwiGLU: `ops::rms_norm`
//! and `ops::swiglu` in f16), and its output, in f32, joins the residual
//! by an add of its own (the quantized kernels norm their input and add
//! their output themselves).

use cubecl::prelude::*;
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
