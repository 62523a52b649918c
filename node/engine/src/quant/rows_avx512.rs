//! The AVX-512 VNNI version of the Q5_0 prefill kernel
//! (`rows_avx2::q5_0_tiled`): the same exact integer lane sums and the
//! same float steps in the same order, so it is bit-identical to it and to
//! the scalar path (tested), with two activation rows in each 512-bit
//! vector and no register spills.
//!
//! The AVX2 kernel feeds `vpdpbusd` |q| and sign(y, q); AVX-512 has no
//! byte `sign`, so the weights go in unsigned as q + 16 (0..31) and each
//! lane's 16·Σy (one `vpdpbusd` per activation block, shared by all weight
//! rows) is subtracted: Σ(q + 16)·y − 16·Σy = Σ q·y, exactly.
//!
//! [`k_row`] does the same for `rows_avx2::k_row` (the K-quants): two
//! activation rows per vector through the same `maddubs`/`madd` lanes.

use std::arch::x86_64::*;

use super::k_common::{Q8K, QK_K};
use super::rows_avx2::{h16, hsum_ps, k_finish, q5_0_block, unpack};
use super::{GgmlType, QK};

/// Activation rows per tile (pairs of rows per vector): each unpacked
/// weight block serves all of them.
const TILE: usize = 8;

/// Whether this CPU runs [`q5_0_tiled`].
pub fn available() -> bool {
    static YES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *YES.get_or_init(detect)
}

fn detect() -> bool {
    std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512vl")
        && std::is_x86_feature_detected!("avx512dq")
        && std::is_x86_feature_detected!("avx512vnni")
        && std::is_x86_feature_detected!("f16c")
}

/// `out[k * n + t]` = Q5_0 row `k` of `w` (`R` rows of `nb` blocks, each
/// `row_bytes` long) · activation row `t` (Q8_0: `d` per block, `qs`
/// `[n, cols]`), as `rows_avx2::q5_0_rows` computes it.
///
/// # Safety
/// The CPU has the features of [`available`]; `w` holds `R` rows,
/// `qs` and `d` hold `out.len() / R` activation rows of `nb` blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
pub unsafe fn q5_0_tiled<const R: usize>(
    w: &[u8],
    row_bytes: usize,
    nb: usize,
    d: &[f32],
    qs: &[i8],
    out: &mut [f32],
) {
    let cols = nb * QK;
    let n = out.len() / R;
    assert!(w.len() >= (R - 1) * row_bytes + nb * 22 && row_bytes >= nb * 22);
    assert!(qs.len() >= n * cols && d.len() >= n * nb);
    if n <= TILE {
        // One tile: each block is unpacked once anyway.
        let src = Packed { w, row_bytes };
        return tiles::<R, _>(&src, nb, d, qs, out, n);
    }
    // The R rows' blocks unpacked once (q + 16, and the scales), then
    // read from L1 by every tile of activation rows.
    UNPACKED.with(|cell| {
        let mut cell = cell.borrow_mut();
        let (u, dw) = &mut *cell;
        u.resize(nb * R, _mm256_setzero_si256());
        dw.resize(nb * R, 0.0);
        let sixteen = _mm256_set1_epi8(16);
        for (b, (ub, db)) in u.chunks_exact_mut(R).zip(dw.chunks_exact_mut(R)).take(nb).enumerate()
        {
            for k in 0..R {
                let blk = w.as_ptr().add(k * row_bytes + b * 22);
                ub[k] = _mm256_add_epi8(q5_0_block(blk), sixteen);
                db[k] = h16(blk);
            }
        }
        tiles::<R, _>(&Unpacked { u, dw }, nb, d, qs, out, n)
    })
}

/// Where a tile gets each block of its `R` weight rows: `q + 16`
/// broadcast to both halves, and the scales.
trait Blocks<const R: usize> {
    unsafe fn block(&self, b: usize) -> ([__m512i; R], [f32; R]);
}

/// Straight from the GGUF bytes.
struct Packed<'a> {
    w: &'a [u8],
    row_bytes: usize,
}

impl<const R: usize> Blocks<R> for Packed<'_> {
    #[inline(always)]
    unsafe fn block(&self, b: usize) -> ([__m512i; R], [f32; R]) {
        let sixteen = _mm256_set1_epi8(16);
        let mut u = [_mm512_setzero_si512(); R];
        let mut dw = [0f32; R];
        for k in 0..R {
            let blk = self.w.as_ptr().add(k * self.row_bytes + b * 22);
            u[k] = _mm512_broadcast_i64x4(_mm256_add_epi8(q5_0_block(blk), sixteen));
            dw[k] = h16(blk);
        }
        (u, dw)
    }
}

/// Unpacked beforehand, `[block][row]`.
struct Unpacked<'a> {
    u: &'a [__m256i],
    dw: &'a [f32],
}

impl<const R: usize> Blocks<R> for Unpacked<'_> {
    #[inline(always)]
    unsafe fn block(&self, b: usize) -> ([__m512i; R], [f32; R]) {
        let u = std::array::from_fn(|k| _mm512_broadcast_i64x4(self.u[b * R + k]));
        let dw = std::array::from_fn(|k| self.dw[b * R + k]);
        (u, dw)
    }
}

/// Every tile of `TILE` activation rows.
#[inline(always)]
unsafe fn tiles<const R: usize, S: Blocks<R>>(
    src: &S,
    nb: usize,
    d: &[f32],
    qs: &[i8],
    out: &mut [f32],
    n: usize,
) {
    let mut t0 = 0;
    while t0 < n {
        let tn = TILE.min(n - t0);
        // Constant pair counts, so the accumulators stay in registers.
        match tn.div_ceil(2) {
            4 => tile::<R, 4, S>(src, nb, d, qs, out, t0, tn),
            3 => tile::<R, 3, S>(src, nb, d, qs, out, t0, tn),
            2 => tile::<R, 2, S>(src, nb, d, qs, out, t0, tn),
            _ => tile::<R, 1, S>(src, nb, d, qs, out, t0, tn),
        }
        t0 += TILE;
    }
}

thread_local! {
    /// Unpacked weight blocks `[block][row]` and their scales, reused.
    static UNPACKED: std::cell::RefCell<(Vec<__m256i>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Activation rows `t0..t0 + tn` (`P` pairs; an odd last row pairs with
/// zeros and its half is not stored).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const R: usize, const P: usize, S: Blocks<R>>(
    src: &S,
    nb: usize,
    d: &[f32],
    qs: &[i8],
    out: &mut [f32],
    t0: usize,
    tn: usize,
) {
    let cols = nb * QK;
    let n = out.len() / R;
    let x16 = _mm512_set1_epi8(16);
    let zero = _mm512_setzero_si512();
    // acc[k][p]: row t0 + 2p in the low 8 lanes, t0 + 2p + 1 in the high.
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    for b in 0..nb {
        let (u, dw) = src.block(b);
        for p in 0..P {
            let t = t0 + 2 * p;
            let y0 = _mm256_loadu_si256(qs.as_ptr().add(t * cols + b * QK) as *const __m256i);
            let dx0 = d[t * nb + b];
            let (y1, dx1) = if 2 * p + 1 < tn {
                let at = (t + 1) * cols + b * QK;
                (_mm256_loadu_si256(qs.as_ptr().add(at) as *const __m256i), d[(t + 1) * nb + b])
            } else {
                (_mm256_setzero_si256(), 0.0)
            };
            let y = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(y0), y1);
            let neg = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, x16, y));
            let dx = _mm512_insertf32x8::<1>(
                _mm512_castps256_ps512(_mm256_set1_ps(dx0)),
                _mm256_set1_ps(dx1),
            );
            for k in 0..R {
                let dot = _mm512_dpbusd_epi32(neg, u[k], y);
                let dd = _mm512_mul_ps(_mm512_set1_ps(dw[k]), dx);
                acc[k][p] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(dot), acc[k][p]);
            }
        }
    }
    for (k, ak) in acc.iter().enumerate() {
        for (p, a) in ak.iter().enumerate() {
            let t = t0 + 2 * p;
            out[k * n + t] = hsum_ps(_mm512_castps512_ps256(*a));
            if 2 * p + 1 < tn {
                out[k * n + t + 1] = hsum_ps(_mm512_extractf32x8_ps::<1>(*a));
            }
        }
    }
}

/// `rows_avx2::k_row` with two activation rows in each 512-bit vector: the
/// low half of every lane is row t's, bit for bit what the AVX2 kernel
/// computes, and the high half row t + 1's.
///
/// # Safety
/// The CPU has the features of [`available`]; `w` holds `nb` super-blocks
/// of `ty`, `a` holds `out.len()` activation rows of `nb` super-blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
pub unsafe fn k_row(ty: GgmlType, w: &[u8], nb: usize, a: &Q8K, out: &mut [f32]) {
    let bsz = ty.block_layout().1;
    let n = out.len();
    assert!(w.len() >= nb * bsz && a.qs.len() >= n * nb * QK_K && a.d.len() >= n * nb);
    assert!(a.bsums.len() >= n * nb * 16);
    out.iter_mut().for_each(|o| *o = 0.0);
    for b in 0..nb {
        let u = unpack(ty, &w[b * bsz..][..bsz]);
        let q: [__m512i; 8] = std::array::from_fn(|v| _mm512_broadcast_i64x4(u.q[v]));
        let sc: [__m512i; 8] = std::array::from_fn(|v| _mm512_broadcast_i64x4(u.sc[v]));
        for t in (0..n).step_by(2) {
            let two = t + 1 < n;
            let tb0 = t * nb + b;
            // A lone last row is paired with itself (its copy is dropped).
            let tb1 = if two { tb0 + nb } else { tb0 };
            let (x0, x1) = (a.qs.as_ptr().add(tb0 * QK_K), a.qs.as_ptr().add(tb1 * QK_K));
            let mut acc = _mm512_setzero_si512();
            for v in 0..8 {
                let lo = _mm256_loadu_si256(x0.add(32 * v) as *const __m256i);
                let hi = _mm256_loadu_si256(x1.add(32 * v) as *const __m256i);
                let x = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                let p = _mm512_maddubs_epi16(q[v], x);
                acc = _mm512_add_epi32(acc, _mm512_madd_epi16(p, sc[v]));
            }
            k_finish(ty, &u, a, tb0, _mm512_castsi512_si256(acc), &mut out[t]);
            if two {
                k_finish(ty, &u, a, tb1, _mm512_extracti64x4_epi64::<1>(acc), &mut out[t + 1]);
            }
        }
    }
}
