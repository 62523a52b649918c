//! [`super::q8::matmul_q8`] for larger batches, tiled as
//! [`super::tiled`]: a cube computes a `TM × TN` tile of the output
//! (weight rows × batch rows). Per 32-element block it loads the `TM`
//! weight rows' quants and scales and the `TN` batch rows' 8-bit inputs
//! into shared memory once, and each unit computes `TT × TT` outputs from
//! there. The arithmetic is `matmul_q8`'s, output by output: an integer
//! block dot (exact in any order), then the same float chain over the
//! blocks in order (`acc = fma(isum, d_w · d_x, acc)`, Q4_1's `fma(m_w,
//! s_x, acc)`), so the two kernels, and the CPU, agree bit for bit. The
//! simple kernel reads each weight block once per batch row; this one once
//! per `TN` rows.

use cubecl::prelude::*;

use super::q8::{fused, sbyte};
use super::quant::{f16_to_f32, WeightKind};
use super::tiled::{TM, TN, TT, UX, UY};

/// Outputs a unit holds.
const OUTS: usize = TT * TT;

/// `out[j, off + r] = Σ_c x[j, c] · W[r, c]` over inputs quantized by
/// `q8::quantize_q8`, tiled. Launch with `CubeDim (UX, UY)` and
/// `CubeCount (rows.div_ceil(TM), n.div_ceil(TN))`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn matmul_q8_tiled(
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
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let tid = ty * UX + tx;
    let r_base = CUBE_POS_X as usize * TM;
    let j_base = CUBE_POS_Y as usize * TN;
    let nb = cols / 32;
    let words = comptime!(kind.words());
    // Element e of a block for tile row r at wq[e · TM + r] (xq alike).
    let mut wq = Shared::new_slice(32 * TM);
    let mut wd = Shared::new_slice(TM);
    let mut wm = Shared::new_slice(TM);
    let mut xq = Shared::new_slice(32 * TN);
    let mut xd = Shared::new_slice(TN);
    let mut xs = Shared::new_slice(TN);
    let mut xsum = Shared::new_slice(TN);
    let mut acc = Array::<f32>::new(OUTS);
    let mut isum = Array::<i32>::new(OUTS);
    #[unroll]
    for q in 0..OUTS {
        acc[q] = 0.0;
    }
    // Weight loaders: unit `tid` takes quarter `tid % 4` of tile row
    // `tid / 4`'s block (TM · 4 = UX · UY units). A row past the matrix
    // reads row 0 (in bounds); its outputs are never written.
    let (lr, lc) = (tid / 4, tid % 4);
    let wr = r_base + lr;
    let wrr = select(wr < rows, wr, 0usize);
    for b in 0..nb {
        sync_cube();
        let base = (wrr * nb + b) * words;
        let w0 = w[base];
        if lc == 0 {
            wd[lr] = f16_to_f32(w0 & 0xffff);
            wm[lr] = f16_to_f32(w0 >> 16);
        }
        match comptime!(kind) {
            WeightKind::Q8_0 =>
            {
                #[unroll]
                for h in 0..2usize {
                    let word = w[base + 1 + lc * 2 + h];
                    #[unroll]
                    for k in 0..4u32 {
                        wq[((lc * 2 + h) * 4 + k as usize) * TM + lr] = sbyte(word, k);
                    }
                }
            }
            _ => {
                // Byte e of the 16: low nibble element e, high e + 16.
                let word = w[base + 1 + lc];
                #[unroll]
                for k in 0..4u32 {
                    let byte = (word >> (8 * k)) & 255;
                    let e = lc * 4 + k as usize;
                    wq[e * TM + lr] = i32::cast_from(byte & 15);
                    wq[(e + 16) * TM + lr] = i32::cast_from(byte >> 4);
                }
            }
        }
        // Input loaders: word `p % 8` of tile row `p / 8`'s block.
        let mut p = tid;
        while p < TN * 8 {
            let (xr, wi) = (p / 8, p % 8);
            let j = j_base + xr;
            let jj = select(j < n, j, 0usize);
            let word = qs[(jj * nb + b) * 8 + wi];
            #[unroll]
            for k in 0..4u32 {
                xq[(wi * 4 + k as usize) * TN + xr] = sbyte(word, k);
            }
            if wi == 0 {
                xd[xr] = d[jj * nb + b];
                xs[xr] = s[jj * nb + b];
                xsum[xr] = sum_q[jj * nb + b];
            }
            p += UX * UY;
        }
        sync_cube();
        #[unroll]
        for q in 0..OUTS {
            isum[q] = 0;
        }
        for e in 0..32usize {
            #[unroll]
            for r in 0..TT {
                let a = wq[e * TM + ty * TT + r];
                #[unroll]
                for k in 0..TT {
                    isum[r * TT + k] += a * xq[e * TN + tx * TT + k];
                }
            }
        }
        #[unroll]
        for r in 0..TT {
            let (dw, mw) = (wd[ty * TT + r], wm[ty * TT + r]);
            #[unroll]
            for k in 0..TT {
                let c = tx * TT + k;
                let mut is = isum[r * TT + k];
                if comptime!(kind == WeightKind::Q4_0) {
                    is -= 8 * xsum[c];
                }
                let scale = dw * xd[c];
                let mut a = fused(f32::cast_from(is), scale, acc[r * TT + k], wide_fma);
                if comptime!(kind == WeightKind::Q4_1) {
                    a = fused(mw, xs[c], a, wide_fma);
                }
                acc[r * TT + k] = a;
            }
        }
    }
    #[unroll]
    for r in 0..TT {
        #[unroll]
        for k in 0..TT {
            let row = r_base + ty * TT + r;
            let j = j_base + tx * TT + k;
            if row < rows && j < n {
                out[j * out_stride + out_off + row] = acc[r * TT + k];
            }
        }
    }
}
