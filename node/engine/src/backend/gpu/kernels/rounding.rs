//! f16 rounding in f32 arithmetic: a leaf shared by the exact kernels
//! (`q8`, which re-exports it, `attention`, `exact`) and gemma3's GeGLU.

use cubecl::prelude::*;

/// `v` rounded to f16 precision (round half to even, subnormals included),
/// as f32: `half::f16::from_f32(v).to_f32()` for the finite values the
/// scales take. The quantum of `v`'s binade (2^(E − 10), at least the
/// subnormal 2^−24) scales `v` to an integer's precision exactly; one
/// `roundeven` rounds; scaling back is exact.
#[cube]
pub fn round_f16(v: f32) -> f32 {
    let e = i32::cast_from((u32::reinterpret(v) >> 23) & 255) - 127;
    let qe = select(e > -14, e, -14i32) - 10;
    let up = f32::reinterpret(u32::cast_from(127 - qe) << 23);
    let down = f32::reinterpret(u32::cast_from(127 + qe) << 23);
    f32::round(v * up) * down
}
