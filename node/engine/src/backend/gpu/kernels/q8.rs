//! The CPU decoder's matmul arithmetic on the GPU, bit for bit: inputs
//! quantized to 8 bits per 32-element block (`quant::QActs::quantize`:
//! llama.cpp's block_q8_1 with its AVX2 rounding), integer block dot
//! products (exact in any order), and per output the CPU's float chain,
//! sequential over blocks: `acc = fma(isum, d_w · d_x, acc)`, then for
//! Q4_1 `acc = fma(m_w, s_x, acc)` (`quant::kernels::scalar_dot_group`).
//! The float matmuls (`quant.rs`, `tiled.rs`) keep activations in f32 and
//! so differ from the CPU by tenths of a logit; this is the arithmetic of
//! GPU parity with the CPU, and so with llama.cpp (issue 17).
//!
//! Every float operation here is one IEEE operation with one rounding:
//! the division by 127 and its inverse, `roundeven` (CUDA: `llvm.roundeven`;
//! SPIR-V: GLSL `Round`, which Mesa lowers to round-half-even), the f16
//! rounding of the scales by powers of two (exact scalings around one
//! `roundeven`), and explicit `fma`s where the CPU fuses.

use cubecl::prelude::*;

use super::quant::{f16_to_f32, WeightKind};

pub use super::rounding::round_f16;

/// Quantize `x[blocks · 32]` block by block, one unit a block: `qs` four
/// signed bytes a word (element `e` in byte `e % 4` of word `e / 4`), `d`
/// the f16-rounded scale `amax / 127`, `s` the f16-rounded `d · Σq` (with
/// `d` unrounded, as the CPU), `sum_q` the exact `Σq`. Launch with
/// `CubeDim (64)`, `CubeCount (blocks.div_ceil(64))`.
#[cube(launch)]
pub fn quantize_q8(
    x: &[f32],
    qs: &mut [u32],
    d: &mut [f32],
    s: &mut [f32],
    sum_q: &mut [i32],
    blocks: usize,
) {
    let b = ABSOLUTE_POS_X as usize;
    if b < blocks {
        let mut v = Array::<f32>::new(32usize);
        #[unroll]
        for e in 0..32usize {
            v[e] = x[b * 32 + e];
        }
        quantize_block(&v, b, qs, d, s, sum_q);
    }
}

/// Block `b` of [`quantize_q8`] from its 32 values `v`.
#[cube]
pub fn quantize_block(
    v: &Array<f32>,
    b: usize,
    qs: &mut [u32],
    d: &mut [f32],
    s: &mut [f32],
    sum_q: &mut [i32],
) {
    let mut amax = 0.0f32;
    #[unroll]
    for e in 0..32usize {
        amax = f32::max(amax, f32::abs(v[e]));
    }
    let db = amax / 127.0f32;
    let id = select(amax != 0.0f32, 127.0f32 / amax, 0.0f32);
    let mut sum = 0i32;
    #[unroll]
    for wi in 0..8usize {
        let mut word = 0u32;
        #[unroll]
        for k in 0..4usize {
            let q = i32::cast_from(f32::round(v[wi * 4 + k] * id));
            sum += q;
            word |= (u32::cast_from(q) & 255) << (8 * k as u32);
        }
        qs[b * 8 + wi] = word;
    }
    d[b] = round_f16(db);
    s[b] = round_f16(db * f32::cast_from(sum));
    sum_q[b] = sum;
}

/// `a · b + c` with one rounding. CUDA's `fma` is the fused instruction;
/// SPIR-V's (GLSL `Fma`) may round twice and does on lavapipe, so there
/// (`wide`) the product is taken exactly in f64 (24 + 24 bits) and the sum
/// rounded to f64, then to f32: a second rounding that differs from one
/// only when the f64 sum falls exactly halfway between two f32s and the
/// exact one does not (the tests' stand-in; a GPU run uses `fma`).
#[cube]
pub fn fused(a: f32, b: f32, c: f32, #[comptime] wide: bool) -> f32 {
    if comptime!(wide) {
        f32::cast_from(f64::cast_from(a) * f64::cast_from(b) + f64::cast_from(c))
    } else {
        fma(a, b, c)
    }
}

/// `a · b`, rounded once and never fused into a later add: cubecl-llvm
/// marks CUDA's f32 adds and muls `contract`, and `fma(a, b, −0)` carries
/// no flag to contract with ([`super::exact`]'s module docs).
#[cube]
pub fn mul(a: f32, b: f32, #[comptime] wide: bool) -> f32 {
    if comptime!(wide) {
        a * b
    } else {
        fma(a, b, f32::reinterpret(0x8000_0000u32))
    }
}

/// Signed byte `k` of `word`.
#[cube]
pub fn sbyte(word: u32, #[comptime] k: u32) -> i32 {
    let byte = (word >> (8 * k)) & 255;
    i32::cast_from(byte) - select(byte >= 128, 256i32, 0i32)
}

/// `out[j, off + r] = Σ_c x[j, c] · W[r, c]` with `x` quantized by
/// [`quantize_q8`], the CPU's chain per output. One unit an output (the
/// reference arithmetic; speed comes later). Launch with `CubeDim (64)`,
/// `CubeCount (rows.div_ceil(64), n)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn matmul_q8(
    w: &[u32],
    qs: &[u32],
    d: &[f32],
    s: &[f32],
    sum_q: &[i32],
    out: &mut [f32],
    rows: usize,
    cols: usize,
    n: usize,
    out_stride: usize,
    out_off: usize,
    #[comptime] kind: WeightKind,
    #[comptime] wide_fma: bool,
) {
    let r = ABSOLUTE_POS_X as usize;
    let j = CUBE_POS_Y as usize;
    if r < rows && j < n {
        let nb = cols / 32;
        let words = comptime!(kind.words());
        let mut acc = 0.0f32;
        for b in 0..nb {
            let base = (r * nb + b) * words;
            let w0 = w[base];
            let xb = (j * nb + b) * 8;
            let mut isum = 0i32;
            match comptime!(kind) {
                WeightKind::Q8_0 =>
                {
                    #[unroll]
                    for wi in 0..8usize {
                        let ww = w[base + 1 + wi];
                        let xw = qs[xb + wi];
                        #[unroll]
                        for k in 0..4u32 {
                            isum += sbyte(ww, k) * sbyte(xw, k);
                        }
                    }
                }
                _ => {
                    // Byte e of the 16: low nibble element e, high e + 16.
                    #[unroll]
                    for wi in 0..4usize {
                        let ww = w[base + 1 + wi];
                        let xlo = qs[xb + wi];
                        let xhi = qs[xb + 4 + wi];
                        #[unroll]
                        for k in 0..4u32 {
                            let byte = (ww >> (8 * k)) & 255;
                            isum += i32::cast_from(byte & 15) * sbyte(xlo, k);
                            isum += i32::cast_from(byte >> 4) * sbyte(xhi, k);
                        }
                    }
                    if comptime!(kind == WeightKind::Q4_0) {
                        isum -= 8 * sum_q[j * nb + b];
                    }
                }
            }
            let scale = f16_to_f32(w0 & 0xffff) * d[j * nb + b];
            acc = fused(f32::cast_from(isum), scale, acc, wide_fma);
            if comptime!(kind == WeightKind::Q4_1) {
                acc = fused(f16_to_f32(w0 >> 16), s[j * nb + b], acc, wide_fma);
            }
        }
        out[j * out_stride + out_off + r] = acc;
    }
}

/// `x += delta` (with `add`), then RMSNorm in the CPU's arithmetic
/// (`numerics::rms_norm_rows`): the squares (f32) summed in f64 in row
/// order, `mean = (Σ / hidden)` rounded to f32, `scale = 1 / √(mean + eps)`,
/// `h = (x · scale) · w`; and `h` quantized as [`quantize_q8`] quantizes
/// it (the next matmul's input; cube `c` writes blocks `c · hidden / 32 ..`),
/// so the norm and the quantizer are one launch. One unit sums (a row is
/// `hidden` adds). Launch with `CubeCount (idx.len())`, `CubeDim (ROW_THREADS)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_exact(
    x: &mut [f32],
    delta: &[f32],
    w: &[f32],
    h: &mut [f32],
    idx: &[u32],
    qs: &mut [u32],
    d: &mut [f32],
    s: &mut [f32],
    sum_q: &mut [i32],
    eps: f32,
    #[comptime] hidden: usize,
    #[comptime] add: bool,
) {
    let c = CUBE_POS_X as usize;
    let r = idx[c] as usize;
    let tid = UNIT_POS_X as usize;
    let threads = CUBE_DIM_X as usize;
    let mut sq = Shared::new_slice(hidden);
    let mut scale = Shared::new_slice(1usize);
    let mut i = tid;
    while i < hidden {
        let mut v = x[r * hidden + i];
        if comptime!(add) {
            v += delta[r * hidden + i];
            x[r * hidden + i] = v;
        }
        sq[i] = v * v;
        i += threads;
    }
    sync_cube();
    if tid == 0 {
        let mut sum = 0.0f64;
        for k in 0..hidden {
            sum += f64::cast_from(sq[k]);
        }
        let mean = f32::cast_from(sum / f64::cast_from(hidden as u32));
        scale[0] = 1.0f32 / f32::sqrt(mean + eps);
    }
    sync_cube();
    let sc = scale[0];
    let mut i = tid;
    while i < hidden {
        // Each unit reads back only what it wrote itself above; the normed
        // value goes to `sq` too (unit 0's sum is done), for the blocks.
        let v = (x[r * hidden + i] * sc) * w[i];
        h[c * hidden + i] = v;
        sq[i] = v;
        i += threads;
    }
    sync_cube();
    let nb = comptime!(hidden / 32);
    let mut b = tid;
    while b < nb {
        let mut v = Array::<f32>::new(32usize);
        #[unroll]
        for e in 0..32usize {
            v[e] = sq[b * 32 + e];
        }
        quantize_block(&v, c * nb + b, qs, d, s, sum_q);
        b += threads;
    }
}
