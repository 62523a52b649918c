//! Element-wise and per-row kernels of a decoder layer: RMSNorm (and the
//! order of its sum every kernel that norms a row follows) and SwiGLU /
//! GeGLU. A row's adjustments and its pick are `pick.rs`.

use cubecl::prelude::*;

use super::rounding::round_f16;

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
