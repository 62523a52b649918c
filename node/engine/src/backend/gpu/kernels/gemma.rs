//! What gemma3 adds to a decoder layer on the device, in float arithmetic
//! (`crate::gemma3` is the CPU's): each Q and K head RMS-normed before
//! RoPE (Q then scaled), the attention's and the FFN's outputs RMS-normed
//! before their residual adds (GeGLU's `ops::gelu_mul`, ggml's tanh GELU
//! looked up through f16, sits beside SiLU in `ops`).

use cubecl::prelude::*;

use super::ops::{row_scales, ROW_THREADS};

/// `qkv`'s Q and K heads RMS-normed in place, cube `(r, h)` head `h` of
/// row `r`: a query head (`h < n_heads`) with `q_norm` and then times
/// `q_scale` (as `gemma3_qk` on the CPU, before RoPE), a key head with
/// `k_norm`. V is not touched. Launch with `CubeCount (rows, n_heads +
/// n_kv_heads)`, `CubeDim (ROW_THREADS)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn head_norm(
    qkv: &mut [f32],
    q_norm: &[f32],
    k_norm: &[f32],
    q_scale: f32,
    eps: f32,
    #[comptime] n_heads: usize,
    #[comptime] n_kv_heads: usize,
    #[comptime] head_dim: usize,
) {
    let h = CUBE_POS_Y as usize;
    let tid = UNIT_POS_X as usize;
    // The head as a row of `head_dim` in `qkv` (a row is whole heads).
    let base = (CUBE_POS_X as usize * comptime!(n_heads + 2 * n_kv_heads) + h) * head_dim;
    // Its sum of squares: unit `u` sums elements u, u + ROW_THREADS, … in
    // order, then a tree (`row_scales` reads a slice it cannot write).
    let mut part = Shared::new_slice(ROW_THREADS);
    let mut ss = 0.0f32;
    let mut i = tid;
    while i < head_dim {
        let v = qkv[base + i];
        ss += v * v;
        i += ROW_THREADS;
    }
    part[tid] = ss;
    sync_cube();
    let mut stride = (ROW_THREADS / 2).runtime();
    while stride > 0 {
        if tid < stride {
            part[tid] = part[tid] + part[tid + stride];
        }
        sync_cube();
        stride /= 2;
    }
    let scale = 1.0f32 / f32::sqrt(part[0] / f32::cast_from(head_dim as u32) + eps);
    let mut i = tid;
    while i < head_dim {
        let v = qkv[base + i] * scale;
        if h < n_heads {
            qkv[base + i] = (v * q_norm[i]) * q_scale;
        } else {
            qkv[base + i] = v * k_norm[i];
        }
        i += ROW_THREADS;
    }
}

/// `x[r] += RMSNorm(d[r]) · w` for row `r = cube_x` (gemma3's post-norms:
/// the attention's O projection and the FFN's down projection are normed
/// before they join the residual). Launch with `CubeCount (rows)`,
/// `CubeDim (ROW_THREADS)`.
#[cube(launch)]
pub fn add_normed(x: &mut [f32], d: &[f32], w: &[f32], hidden: usize, eps: f32) {
    let r = CUBE_POS_X as usize;
    let tid = UNIT_POS_X as usize;
    let sc = row_scales(d, r, r + 1, hidden, eps, tid, ROW_THREADS, 1usize);
    let scale = sc[0];
    let mut i = tid;
    while i < hidden {
        let o = r * hidden + i;
        x[o] = x[o] + (d[o] * scale) * w[i];
        i += ROW_THREADS;
    }
}
