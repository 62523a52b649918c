//! AVX2 versions of [`super::rows`]' dot products: the same exact integer
//! sums and the same float steps in the same order, so they are
//! bit-identical to the scalar path (tested), only vectorised.

use std::arch::x86_64::*;

use super::k_common::{scale_min_k4, Q8K, QK_K};
use super::{GgmlType, QK};

/// An f16 at `p` as f32 with F16C (exact, like any conversion).
#[inline(always)]
unsafe fn h16(p: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u16).read_unaligned() as i32)))
}

/// tinyBLAS's `hsum`: `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`.
#[inline(always)]
unsafe fn hsum_ps(v: __m256) -> f32 {
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
unsafe fn q5_0_block(blk: *const u8) -> __m256i {
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

#[inline(always)]
unsafe fn q5_0_impl<const VNNI: bool, const R: usize>(
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
/// elements) with a scale per 16 elements; the quant is `q - off`.
struct Unpacked {
    q: [__m256i; 8],
    sc16: [i16; 16],
    off: i32,
    mins: [i32; 8],
    d: f32,
    dmin: f32,
}

/// Bits `shift..shift + 2` of every byte of `qh`, moved to bits 4..6.
#[inline(always)]
unsafe fn hi2(qh: __m256i, shift: i32, m2: __m256i) -> __m256i {
    let v = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), m2);
    _mm256_slli_epi16(v, 4)
}

#[inline(always)]
unsafe fn unpack(ty: GgmlType, x: &[u8]) -> Unpacked {
    let p = x.as_ptr();
    let m4 = _mm256_set1_epi8(0x0F);
    let mut u = Unpacked {
        q: [_mm256_setzero_si256(); 8],
        sc16: [0; 16],
        off: 0,
        mins: [0; 8],
        d: 0.0,
        dmin: 0.0,
    };
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => {
            u.d = h16(p);
            u.dmin = h16(p.add(2));
            for j in 0..8 {
                let (s, m) = scale_min_k4(j, &x[4..16]);
                u.sc16[2 * j] = s as i16;
                u.sc16[2 * j + 1] = s as i16;
                u.mins[j] = m as i32;
            }
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
            for s in 0..16 {
                u.sc16[s] = x[192 + s] as i8 as i16;
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

/// `out[t] = Σ` over one K-quant row (`nb` super-blocks) · activation row
/// `t`, in llama.cpp's AMX order (see [`super::rows`]).
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
                let s = _mm256_set_m128i(
                    _mm_set1_epi16(u.sc16[2 * v + 1]),
                    _mm_set1_epi16(u.sc16[2 * v]),
                );
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
            }
            let bs = &a.bsums[tb * 16..][..16];
            let mut isum = hsum_epi32(acc);
            if u.off != 0 {
                let corr: i32 = (0..16).map(|s| u.sc16[s] as i32 * bs[s]).sum();
                isum -= u.off * corr;
            }
            let dx = a.d[tb];
            *o = (isum as f32).mul_add(u.d * dx, *o);
            if ty != GgmlType::Q6_K {
                let msum: i32 = (0..8).map(|j| u.mins[j] * (bs[2 * j] + bs[2 * j + 1])).sum();
                *o = (-(msum as f32)).mul_add(u.dmin * dx, *o);
            }
        }
    }
}
