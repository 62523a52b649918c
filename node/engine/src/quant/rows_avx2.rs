//! AVX2 versions of [`super::rows`]' dot products: the same exact integer
//! sums and the same float steps in the same order, so they are
//! bit-identical to the scalar path (tested), only vectorised.

use std::arch::x86_64::*;

use super::k_common::{Q8K, QK_K};
use super::{GgmlType, QK};

/// An f16 at `p` as f32 with F16C (exact, like any conversion).
#[inline(always)]
pub(super) unsafe fn h16(p: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u16).read_unaligned() as i32)))
}

/// tinyBLAS's `hsum`: `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`.
#[inline(always)]
pub(super) unsafe fn hsum_ps(v: __m256) -> f32 {
    let x = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
}

#[inline(always)]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)))
}

/// One Q5_0 block as 32 signed bytes (-16..16), ggml's `bytes_from_bits_32` way.
#[inline(always)]
pub(super) unsafe fn q5_0_block(blk: *const u8) -> __m256i {
    let qs = _mm_loadu_si128(blk.add(6) as *const __m128i);
    let m4 = _mm_set1_epi8(0x0F);
    let nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
    let qh = (blk.add(2) as *const u32).read_unaligned();
    let shuf = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0x0000000000000000,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    let bits = _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
    _mm256_or_si256(nib, _mm256_andnot_si256(bits, _mm256_set1_epi8(0xF0u8 as i8)))
}

/// `out[k * n + t]` = Q5_0 row `k` of `w` (`R` rows of `nb` blocks, each
/// `row_bytes` long) · activation row `t` (Q8_0: `d` per block, `qs`
/// `[n, cols]`), in tinyBLAS's order: one accumulator chain per (row,
/// activation row), `R` rows interleaved to hide the FMA latency. With
/// AVX-VNNI when the CPU has it (the same exact lane sums).
pub unsafe fn q5_0_rows<const R: usize>(
    w: &[u8],
    row_bytes: usize,
    nb: usize,
    d: &[f32],
    qs: &[i8],
    out: &mut [f32],
) {
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn vnni<const R: usize>(
        w: &[u8],
        rb: usize,
        nb: usize,
        d: &[f32],
        qs: &[i8],
        out: &mut [f32],
    ) {
        q5_0_impl::<true, R>(w, rb, nb, d, qs, out)
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2<const R: usize>(
        w: &[u8],
        rb: usize,
        nb: usize,
        d: &[f32],
        qs: &[i8],
        out: &mut [f32],
    ) {
        q5_0_impl::<false, R>(w, rb, nb, d, qs, out)
    }
    if std::is_x86_feature_detected!("avxvnni") {
        vnni::<R>(w, row_bytes, nb, d, qs, out)
    } else {
        avx2::<R>(w, row_bytes, nb, d, qs, out)
    }
}

#[target_feature(enable = "avx2,avxvnni")]
unsafe fn dpbusd(a: __m256i, b: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b)
}

/// Activation rows per tile of the prefill kernel: each unpacked weight
/// block serves this many rows before the next is unpacked.
const TILE: usize = 8;

#[inline(always)]
unsafe fn q5_0_impl<const VNNI: bool, const R: usize>(
    w: &[u8],
    row_bytes: usize,
    nb: usize,
    d: &[f32],
    qs: &[i8],
    out: &mut [f32],
) {
    if out.len() > R {
        return q5_0_tiled::<VNNI, R>(w, row_bytes, nb, d, qs, out);
    }
    q5_0_one::<VNNI, R>(w, row_bytes, nb, d, qs, out)
}

/// Several activation rows (prefill): the same float steps per (weight row,
/// activation row) as [`q5_0_one`], but each weight block is unpacked once
/// per tile of [`TILE`] activation rows instead of once per row.
#[inline(always)]
unsafe fn q5_0_tiled<const VNNI: bool, const R: usize>(
    w: &[u8],
    row_bytes: usize,
    nb: usize,
    d: &[f32],
    qs: &[i8],
    out: &mut [f32],
) {
    let cols = nb * QK;
    let n = out.len() / R;
    debug_assert!(w.len() >= R * row_bytes && row_bytes >= nb * 22 && qs.len() >= n * cols);
    for t0 in (0..n).step_by(TILE) {
        let tn = TILE.min(n - t0);
        let mut acc = [[_mm256_setzero_ps(); TILE]; R];
        for b in 0..nb {
            let mut qx = [_mm256_setzero_si256(); R];
            let mut ax = [_mm256_setzero_si256(); R];
            let mut dw = [0f32; R];
            for k in 0..R {
                let blk = w.as_ptr().add(k * row_bytes + b * 22);
                qx[k] = q5_0_block(blk);
                ax[k] = _mm256_sign_epi8(qx[k], qx[k]);
                dw[k] = h16(blk);
            }
            for tt in 0..tn {
                let t = t0 + tt;
                let y = _mm256_loadu_si256(qs.as_ptr().add(t * cols + b * QK) as *const __m256i);
                let dx = d[t * nb + b];
                for k in 0..R {
                    let sy = _mm256_sign_epi8(y, qx[k]);
                    let dot = if VNNI {
                        dpbusd(ax[k], sy)
                    } else {
                        _mm256_madd_epi16(_mm256_maddubs_epi16(ax[k], sy), _mm256_set1_epi16(1))
                    };
                    let dd = _mm256_set1_ps(dw[k] * dx);
                    acc[k][tt] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(dot), acc[k][tt]);
                }
            }
        }
        for (k, ak) in acc.iter().enumerate() {
            for (tt, a) in ak[..tn].iter().enumerate() {
                out[k * n + t0 + tt] = hsum_ps(*a);
            }
        }
    }
}

/// One activation row (decode).
#[inline(always)]
unsafe fn q5_0_one<const VNNI: bool, const R: usize>(
    w: &[u8],
    row_bytes: usize,
    nb: usize,
    d: &[f32],
    qs: &[i8],
    out: &mut [f32],
) {
    let cols = nb * QK;
    let n = out.len() / R;
    debug_assert!(w.len() >= R * row_bytes && row_bytes >= nb * 22 && qs.len() >= n * cols);
    for t in 0..n {
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let y = _mm256_loadu_si256(qs.as_ptr().add(t * cols + b * QK) as *const __m256i);
            let dx = d[t * nb + b];
            for (k, acc_k) in acc.iter_mut().enumerate() {
                let blk = w.as_ptr().add(k * row_bytes + b * 22);
                let qx = q5_0_block(blk);
                let (ax, sy) = (_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(y, qx));
                let dot = if VNNI {
                    dpbusd(ax, sy)
                } else {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
                };
                let dd = _mm256_set1_ps(h16(blk) * dx);
                *acc_k = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(dot), *acc_k);
            }
        }
        for (k, a) in acc.iter().enumerate() {
            out[k * n + t] = hsum_ps(*a);
        }
    }
}

/// A K-quant super-block unpacked to unsigned bytes (8 vectors of 32
/// elements); the quant is `q - off`. `sc[v]`: the i16 scales of vector
/// `v`'s two 16-element halves; `sc16`/`mins16`: the 16 sub-block scales
/// (Q6_K) or each sub-block's min twice (Q4_K/Q5_K), for one `madd` against
/// the activations' 16 sums.
pub(super) struct Unpacked {
    pub(super) q: [__m256i; 8],
    pub(super) sc: [__m256i; 8],
    sc16: __m256i,
    mins16: __m256i,
    off: i32,
    d: f32,
    dmin: f32,
}

/// Bits `shift..shift + 2` of every byte of `qh`, moved to bits 4..6.
#[inline(always)]
unsafe fn hi2(qh: __m256i, shift: i32, m2: __m256i) -> __m256i {
    let v = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), m2);
    _mm256_slli_epi16(v, 4)
}

/// ggml's 12 packed bytes of Q4_K/Q5_K 6-bit scales and mins as 8 scales
/// then 8 mins (bytes), the `utmp` shuffle of its AVX2 kernels (the same
/// values as `k_common::scale_min_k4`, tested through the matmul).
#[inline(always)]
pub(super) fn scales_mins_k4(x: &[u8]) -> [u8; 16] {
    const K1: u32 = 0x3f3f_3f3f;
    const K2: u32 = 0x0f0f_0f0f;
    const K3: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]]);
    let (u0, u1, u2) = (w(0), w(1), w(2));
    let u3 = ((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4);
    let m_lo = u1 & K1;
    let s_hi = (u2 & K2) | (((u0 >> 6) & K3) << 4);
    let mut out = [0u8; 16];
    out[0..4].copy_from_slice(&(u0 & K1).to_le_bytes());
    out[4..8].copy_from_slice(&s_hi.to_le_bytes());
    out[8..12].copy_from_slice(&m_lo.to_le_bytes());
    out[12..16].copy_from_slice(&u3.to_le_bytes());
    out
}

#[inline(always)]
pub(super) unsafe fn unpack(ty: GgmlType, x: &[u8]) -> Unpacked {
    let p = x.as_ptr();
    let m4 = _mm256_set1_epi8(0x0F);
    let zero = _mm256_setzero_si256();
    let mut u = Unpacked {
        q: [zero; 8],
        sc: [zero; 8],
        sc16: zero,
        mins16: zero,
        off: 0,
        d: 0.0,
        dmin: 0.0,
    };
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => {
            u.d = h16(p);
            u.dmin = h16(p.add(2));
            let sm = scales_mins_k4(&x[4..16]);
            for j in 0..8 {
                u.sc[j] = _mm256_set1_epi16(sm[j] as i16);
            }
            // Each min twice: sub-block j covers the 16-sums 2j and 2j + 1.
            let mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(sm.as_ptr().add(8) as *const __m128i));
            u.mins16 =
                _mm256_set_m128i(_mm_unpackhi_epi16(mins, mins), _mm_unpacklo_epi16(mins, mins));
            let five = ty == GgmlType::Q5_K;
            let ql = p.add(if five { 48 } else { 16 });
            for k in 0..4 {
                let bytes = _mm256_loadu_si256(ql.add(32 * k) as *const __m256i);
                u.q[2 * k] = _mm256_and_si256(bytes, m4);
                u.q[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4);
            }
            if five {
                let qh = _mm256_loadu_si256(p.add(16) as *const __m256i);
                let one = _mm256_set1_epi8(1);
                for j in 0..8 {
                    let b =
                        _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j as i32)), one);
                    u.q[j] = _mm256_or_si256(u.q[j], _mm256_slli_epi16(b, 4));
                }
            }
        }
        GgmlType::Q6_K => {
            u.d = h16(p.add(208));
            u.off = 32;
            let sc = _mm_loadu_si128(p.add(192) as *const __m128i);
            u.sc16 = _mm256_cvtepi8_epi16(sc);
            let mut s16 = [0i16; 16];
            _mm256_storeu_si256(s16.as_mut_ptr() as *mut __m256i, u.sc16);
            for v in 0..8 {
                u.sc[v] =
                    _mm256_set_m128i(_mm_set1_epi16(s16[2 * v + 1]), _mm_set1_epi16(s16[2 * v]));
            }
            let m2 = _mm256_set1_epi8(3);
            for n in 0..2 {
                let qa = _mm256_loadu_si256(p.add(64 * n) as *const __m256i);
                let qb = _mm256_loadu_si256(p.add(64 * n + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i);
                u.q[4 * n] = _mm256_or_si256(_mm256_and_si256(qa, m4), hi2(qh, 0, m2));
                u.q[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(qb, m4), hi2(qh, 2, m2));
                u.q[4 * n + 2] =
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4), hi2(qh, 4, m2));
                u.q[4 * n + 3] =
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), m4), hi2(qh, 6, m2));
            }
        }
        _ => {}
    }
    u
}

/// The 16 sums of 16 of an activation block as i16 (exact: |sum| ≤ 16·127).
#[inline(always)]
unsafe fn bsums16(bs: *const i32) -> __m256i {
    let lo = _mm256_loadu_si256(bs as *const __m256i);
    let hi = _mm256_loadu_si256(bs.add(8) as *const __m256i);
    // packs works per 128-bit lane: [lo0-3 hi0-3 lo4-7 hi4-7] → reorder.
    _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8)
}

/// `out[t] = Σ` over one K-quant row (`nb` super-blocks) · activation row
/// `t`, in llama.cpp's AMX order (see [`super::rows`]): per super-block the
/// exact integer `isum` (offset and min corrections as integer dot products
/// with the activations' 16-sums), then the two `fma`s.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn k_row(ty: GgmlType, w: &[u8], nb: usize, a: &Q8K, out: &mut [f32]) {
    let bsz = ty.block_layout().1;
    out.iter_mut().for_each(|o| *o = 0.0);
    for b in 0..nb {
        let u = unpack(ty, &w[b * bsz..][..bsz]);
        for (t, o) in out.iter_mut().enumerate() {
            let tb = t * nb + b;
            let xb = a.qs.as_ptr().add(tb * QK_K);
            let mut acc = _mm256_setzero_si256();
            for v in 0..8 {
                let x = _mm256_loadu_si256(xb.add(32 * v) as *const __m256i);
                let p = _mm256_maddubs_epi16(u.q[v], x);
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, u.sc[v]));
            }
            k_finish(ty, &u, a, tb, acc, o);
        }
    }
}

/// One (weight row, activation row) super-block after its 8 vectors:
/// `acc`'s lanes are Σ scale·q·x; the offset and min corrections, the
/// exact `isum`, then the two `fma`s into `o`.
#[inline(always)]
pub(super) unsafe fn k_finish(
    ty: GgmlType,
    u: &Unpacked,
    a: &Q8K,
    tb: usize,
    mut acc: __m256i,
    o: &mut f32,
) {
    let bs = bsums16(a.bsums.as_ptr().add(tb * 16));
    if u.off != 0 {
        // Σ scale·(q − off)·x = Σ scale·q·x − off·Σ scale·bsum.
        let corr = _mm256_madd_epi16(u.sc16, bs);
        acc = _mm256_sub_epi32(acc, _mm256_slli_epi32(corr, 5));
        debug_assert_eq!(u.off, 32);
    }
    let isum = hsum_epi32(acc);
    let dx = a.d[tb];
    *o = (isum as f32).mul_add(u.d * dx, *o);
    if ty != GgmlType::Q6_K {
        let msum = hsum_epi32(_mm256_madd_epi16(u.mins16, bs));
        *o = (-(msum as f32)).mul_add(u.dmin * dx, *o);
    }
}
