//! Matmul over quantized weights for larger batches: a shared-memory tiled
//! kernel. A cube computes a `TM × TN` tile of the output (weight rows ×
//! batch rows); per 32-element block it dequantizes the `TM` weight rows'
//! block and loads the `TN` batch rows' 32 inputs into shared memory once,
//! and each unit computes `TT × TT` outputs from there. The weights are
//! read once per `TN` batch rows (once per 8 in `matmul_q`), the inputs
//! once per `TM` weight rows.
//!
//! It keeps [`super::quant`]'s summation order exactly (see its module
//! docs), so it agrees bit for bit with `matmul_q` and `matmul_q_wide`:
//! the blocks are taken lane by lane (`l`, `l + 32`, … summed into `P_l`)
//! with the lanes in the post-order of `matmul_q`'s reduction tree (lane
//! `bitrev5(i)` at step `i`: 0, 16, 8, 24, 4, …), and the partial sums of
//! the tree wait on a stack of five levels, added as a binary counter
//! carries: at step `i`, `P` is added to the levels of `i`'s trailing
//! ones. Addition commutes exactly, so each node is the tree's sum.

use cubecl::prelude::*;

use super::quant::{
    dequant_eighth, input, scale_of, scales_for, store, InputKind, WeightKind, LANES,
};

/// Weight rows per cube.
pub const TM: usize = 32;
/// Batch rows per cube.
pub const TN: usize = 64;
/// Outputs per unit along each side.
pub const TT: usize = 4;
/// Units along the batch rows (`CubeDim` x).
pub const UX: usize = TN / TT;
/// Units along the weight rows (`CubeDim` y).
pub const UY: usize = TM / TT;
/// Levels of the lanes' tree (`LANES` = 2^LEVELS).
const LEVELS: usize = 5;
/// Outputs a unit holds.
const OUTS: usize = TT * TT;

/// `out[j, off + r] = Σ_c x[j, c] · W[r, c]`, tiled (the input as
/// `input_kind` says, [`super::quant::input`]; with `add`, added to
/// `out`). Launch with
/// `CubeDim (UX, UY)` and `CubeCount (rows.div_ceil(TM), n.div_ceil(TN))`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn matmul_q_tiled(
    w: &[u32],
    x: &[f32],
    nw: &[f32],
    out: &mut [f32],
    rows: usize,
    cols: usize,
    n: usize,
    out_stride: usize,
    out_off: usize,
    eps: f32,
    #[comptime] kind: WeightKind,
    #[comptime] input_kind: InputKind,
    #[comptime] add: bool,
) {
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let tid = ty * UX + tx;
    let r_base = CUBE_POS_X as usize * TM;
    let j_base = CUBE_POS_Y as usize * TN;
    let nb = cols / 32;
    let words = comptime!(kind.words());
    let sc = scales_for(x, j_base, n, cols, eps, tid, UX * UY, TN, input_kind);
    // Element e of a block for tile row r at ws[e · TM + r] (and xs alike):
    // a unit's TT rows are adjacent.
    let mut ws = Shared::new_slice(32 * TM);
    let mut xs = Shared::new_slice(32 * TN);
    // The tree's pending partial sums, level by level, and the current one.
    let mut stack = Array::<f32>::new(LEVELS * OUTS);
    let mut cur = Array::<f32>::new(OUTS);
    let mut s = Array::<f32>::new(OUTS);
    let mut wv = Array::<f32>::new(8usize);
    let mut a = Array::<f32>::new(TT);
    let mut bv = Array::<f32>::new(TT);
    #[unroll]
    for q in 0..LEVELS * OUTS {
        stack[q] = 0.0;
    }
    // Loaders: unit `tid` dequantizes eighth `tid % 4` of tile row
    // `tid / 4`'s block (TM · 4 units), and loads the inputs' eighths
    // `tid, tid + UX · UY, …` (TN · 4 of them).
    let (lr, lc) = (tid / 4, tid % 4);
    let wr = r_base + lr;
    // A row past the matrix reads row 0 (in bounds); its outputs are never
    // written.
    let wrr = select(wr < rows, wr, 0usize);
    let mut i = 0usize;
    while i < LANES {
        let l = ((i & 1) << 4) | ((i & 2) << 2) | (i & 4) | ((i & 8) >> 2) | ((i & 16) >> 4);
        #[unroll]
        for q in 0..OUTS {
            cur[q] = 0.0;
        }
        // Uniform over the cube: every unit runs the same iterations.
        let mut b = l;
        while b < nb {
            sync_cube();
            if lr < TM {
                dequant_eighth(w, (wrr * nb + b) * words, lc, &mut wv, 0, kind);
                #[unroll]
                for e in 0..8usize {
                    ws[(lc * 8 + e) * TM + lr] = wv[e];
                }
            }
            let mut p = tid;
            while p < TN * 4 {
                let (xr, xc) = (p / 4, p % 4);
                let j = j_base + xr;
                let jj = select(j < n, j, 0usize);
                let scj = scale_of(&sc, xr, input_kind);
                #[unroll]
                for e in 0..8usize {
                    let v = input(x, nw, scj, jj, b * 32 + xc * 8 + e, cols, input_kind);
                    xs[(xc * 8 + e) * TN + xr] = select(j < n, v, 0.0f32);
                }
                p += UX * UY;
            }
            sync_cube();
            #[unroll]
            for q in 0..OUTS {
                s[q] = 0.0;
            }
            // s = Σ_e w·x in element order, like `matmul_q`'s block sum.
            #[unroll]
            for e in 0..32usize {
                #[unroll]
                for k in 0..TT {
                    a[k] = ws[e * TM + ty * TT + k];
                    bv[k] = xs[e * TN + tx * TT + k];
                }
                #[unroll]
                for r in 0..TT {
                    #[unroll]
                    for k in 0..TT {
                        s[r * TT + k] += a[r] * bv[k];
                    }
                }
            }
            #[unroll]
            for q in 0..OUTS {
                cur[q] += s[q];
            }
            b += LANES;
        }
        // Step i's carries: add the pending sums of i's trailing ones, park
        // the result at the first zero bit.
        #[unroll]
        for k in 0..LEVELS {
            let mask = comptime!((1usize << k) - 1);
            let carry = (i & mask) == mask;
            let bit = ((i >> k) & 1) == 1;
            let add = carry && bit;
            let park = carry && !bit;
            #[unroll]
            for q in 0..OUTS {
                let sum = stack[k * OUTS + q] + cur[q];
                cur[q] = select(add, sum, cur[q]);
                stack[k * OUTS + q] = select(park, cur[q], stack[k * OUTS + q]);
            }
        }
        i += 1;
    }
    #[unroll]
    for r in 0..TT {
        #[unroll]
        for k in 0..TT {
            let row = r_base + ty * TT + r;
            let j = j_base + tx * TT + k;
            if row < rows && j < n {
                store(out, j * out_stride + out_off + row, cur[r * TT + k], add);
            }
        }
    }
}
