//! Group kernels: 8 weight rows × one activation row → 8 outputs.
//!
//! Per row (lane) the float accumulation is sequential over blocks:
//! `acc = fma(isum, d_w * d_x, acc)` then, for Q4_1, `acc = fma(m_w, s_x, acc)`.
//! Integer block sums are exact in any order, so the AVX2 path and the
//! scalar fallback produce bit-identical results.

use half::f16;

use super::{QKind, GROUP, QK};

/// One quantized activation row.
pub struct ActBlock<'a> {
    pub d: &'a [f32],
    pub s: &'a [f32],
    pub sum_q: &'a [i32],
    pub qs: &'a [i8],
}

/// Dot products of the 8 rows of one packed group with one activation row.
/// `d`/`m`: `[nb, 8]`; `q`: `[nb, 8, qbytes]`.
pub fn dot_group(kind: QKind, d: &[u16], m: &[u16], q: &[u8], a: &ActBlock<'_>) -> [f32; GROUP] {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
    {
        // SAFETY: the required CPU features were detected above.
        return unsafe { avx2::dot_group(kind, d, m, q, a) };
    }
    scalar_dot_group(kind, d, m, q, a)
}

/// Several activation rows against one group: `out` is `[acts.len(), 8]`.
/// For 4-bit weights the unpacked block is reused across rows (prefill);
/// per-row results are identical to [`dot_group`].
pub fn dot_group_multi(
    kind: QKind,
    d: &[u16],
    m: &[u16],
    q: &[u8],
    acts: &[ActBlock<'_>],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if kind != QKind::Q8_0
        && std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
    {
        // SAFETY: the required CPU features were detected above.
        return unsafe { avx2::dot_group_q4_multi(kind, d, m, q, acts, out) };
    }
    for (a, o) in acts.iter().zip(out.chunks_exact_mut(GROUP)) {
        o.copy_from_slice(&dot_group(kind, d, m, q, a));
    }
}

/// Portable reference with the same float operation order.
pub fn scalar_dot_group(
    kind: QKind,
    d: &[u16],
    m: &[u16],
    q: &[u8],
    a: &ActBlock<'_>,
) -> [f32; GROUP] {
    let nb = a.d.len();
    let mut acc = [0f32; GROUP];
    for b in 0..nb {
        let x = &a.qs[b * QK..][..QK];
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let k = b * GROUP + i;
            let isum = match kind {
                QKind::Q4_0 | QKind::Q4_1 => {
                    let blk = &q[b * GROUP * 16..][..GROUP * 16];
                    let mut s = 0i32;
                    for e in 0..16 {
                        let w = blk[((e / 4) * GROUP + i) * 4 + e % 4];
                        s += (w & 15) as i32 * x[e] as i32 + (w >> 4) as i32 * x[e + 16] as i32;
                    }
                    if kind == QKind::Q4_0 {
                        s - 8 * a.sum_q[b]
                    } else {
                        s
                    }
                }
                QKind::Q8_0 => {
                    let w = &q[k * 32..][..32];
                    w.iter().zip(x).map(|(&w, &x)| w as i8 as i32 * x as i32).sum()
                }
            };
            *acc_i = (isum as f32).mul_add(f16::from_bits(d[k]).to_f32() * a.d[b], *acc_i);
            if kind == QKind::Q4_1 {
                *acc_i = f16::from_bits(m[k]).to_f32().mul_add(a.s[b], *acc_i);
            }
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{ActBlock, QKind, GROUP, QK};

    /// 8 partial i32 sums of u8×i8 products (exact: |products| stay far
    /// from i16 saturation for 4-bit and sign-folded 8-bit weights).
    #[inline(always)]
    unsafe fn udot(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }

    /// Horizontal sums of 8 vectors → one vector whose lane i = Σ p[i].
    #[inline(always)]
    unsafe fn transpose_sum(p: &[__m256i; 8]) -> __m256i {
        let t0 = _mm256_hadd_epi32(p[0], p[1]);
        let t1 = _mm256_hadd_epi32(p[2], p[3]);
        let t2 = _mm256_hadd_epi32(p[4], p[5]);
        let t3 = _mm256_hadd_epi32(p[6], p[7]);
        let u0 = _mm256_hadd_epi32(t0, t1);
        let u1 = _mm256_hadd_epi32(t2, t3);
        _mm256_add_epi32(
            _mm256_permute2x128_si256(u0, u1, 0x20),
            _mm256_permute2x128_si256(u0, u1, 0x31),
        )
    }

    /// 8 f16 scales → f32 (exact).
    #[inline(always)]
    unsafe fn load_f16x8(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    /// `acc + Σ4 u8×i8` per i32 lane: AVX-VNNI when present, else
    /// maddubs + madd (exact here: 4-bit unsigned weights).
    #[inline(always)]
    unsafe fn dp(vnni: bool, acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        if vnni {
            dp_vnni(acc, u, s)
        } else {
            _mm256_add_epi32(acc, udot(u, s))
        }
    }

    #[target_feature(enable = "avxvnni,avx2")]
    unsafe fn dp_vnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(acc, u, s)
    }

    /// The 8 rows' quants of one 4-bit group block (`[quad 0..4][row 0..8][4
    /// bytes]`): low nibbles of quads 0..4, then their high nibbles.
    #[inline(always)]
    unsafe fn unpack_q4(base: *const u8) -> [__m256i; 8] {
        let mask = _mm256_set1_epi8(0x0f);
        let mut w = [_mm256_setzero_si256(); 8];
        for j in 0..4 {
            let v = _mm256_loadu_si256(base.add(j * 32) as *const __m256i);
            w[j] = _mm256_and_si256(v, mask);
            w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        }
        w
    }

    /// Exact integer dot products of 8 rows' unpacked 4-bit block `w` with
    /// one activation block `xa` (32 int8 as 8 × 4 bytes); lanes are rows,
    /// so no horizontal sums are needed.
    #[inline(always)]
    unsafe fn q4_isum(vnni: bool, w: &[__m256i; 8], xa: *const i32) -> __m256i {
        let mut isum = _mm256_setzero_si256();
        for j in 0..4 {
            isum = dp(vnni, isum, w[j], _mm256_set1_epi32(xa.add(j).read_unaligned()));
            isum = dp(vnni, isum, w[j + 4], _mm256_set1_epi32(xa.add(j + 4).read_unaligned()));
        }
        isum
    }

    /// Block `b`'s 8 scales and (Q4_1 only, else zeros) 8 mins as f32.
    #[inline(always)]
    unsafe fn scales(kind: QKind, d: &[u16], m: &[u16], b: usize) -> (__m256, __m256) {
        let dw = load_f16x8(d.as_ptr().add(b * GROUP));
        let mw = if kind == QKind::Q4_1 {
            load_f16x8(m.as_ptr().add(b * GROUP))
        } else {
            _mm256_setzero_ps()
        };
        (dw, mw)
    }

    /// `acc` plus block `b` of 8 rows: `isum * (d_w * d_x)` (Q4_0's offset
    /// of 8 taken out of `isum` first), then for Q4_1 `+ m_w * s_x`, in the
    /// order of [`super::scalar_dot_group`].
    #[inline(always)]
    unsafe fn add_block(
        kind: QKind,
        mut isum: __m256i,
        dw: __m256,
        mw: __m256,
        a: &ActBlock<'_>,
        b: usize,
        mut acc: __m256,
    ) -> __m256 {
        if kind == QKind::Q4_0 {
            isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * a.sum_q[b]));
        }
        let dd = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dd, acc);
        if kind == QKind::Q4_1 {
            acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[b]), acc);
        }
        acc
    }

    /// `pub unsafe fn $name(args)`: `$imp(vnni, args)` compiled twice, with
    /// AVX-VNNI and with AVX2 only, calling the variant this CPU has.
    macro_rules! vnni_or_avx2 {
        ($name:ident => $imp:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?) => {
            pub unsafe fn $name($($arg: $ty),*) $(-> $ret)? {
                #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
                unsafe fn with_vnni($($arg: $ty),*) $(-> $ret)? {
                    $imp(true, $($arg),*)
                }
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn with_avx2($($arg: $ty),*) $(-> $ret)? {
                    $imp(false, $($arg),*)
                }
                if std::is_x86_feature_detected!("avxvnni") {
                    with_vnni($($arg),*)
                } else {
                    with_avx2($($arg),*)
                }
            }
        };
    }

    vnni_or_avx2!(dot_group => dot_group_impl(
        kind: QKind, d: &[u16], m: &[u16], q: &[u8], a: &ActBlock<'_>
    ) -> [f32; GROUP]);

    vnni_or_avx2!(dot_group_q4_multi => q4_multi_impl(
        kind: QKind, d: &[u16], m: &[u16], q: &[u8], acts: &[ActBlock<'_>], out: &mut [f32]
    ));

    #[inline(always)]
    unsafe fn q4_multi_impl(
        vnni: bool,
        kind: QKind,
        d: &[u16],
        m: &[u16],
        q: &[u8],
        acts: &[ActBlock<'_>],
        out: &mut [f32],
    ) {
        let nb = acts[0].d.len();
        out.iter_mut().for_each(|x| *x = 0.0);
        for b in 0..nb {
            let w = unpack_q4(q.as_ptr().add(b * GROUP * 16));
            let (dw, mw) = scales(kind, d, m, b);
            for (a, o) in acts.iter().zip(out.chunks_exact_mut(GROUP)) {
                let isum = q4_isum(vnni, &w, a.qs.as_ptr().add(b * QK) as *const i32);
                let acc = add_block(kind, isum, dw, mw, a, b, _mm256_loadu_ps(o.as_ptr()));
                _mm256_storeu_ps(o.as_mut_ptr(), acc);
            }
        }
    }

    #[inline(always)]
    unsafe fn dot_group_impl(
        vnni: bool,
        kind: QKind,
        d: &[u16],
        m: &[u16],
        q: &[u8],
        a: &ActBlock<'_>,
    ) -> [f32; GROUP] {
        let nb = a.d.len();
        debug_assert!(d.len() >= nb * GROUP && q.len() >= nb * GROUP * kind.qbytes());
        let mut acc = _mm256_setzero_ps();
        let mut p = [_mm256_setzero_si256(); 8];
        for b in 0..nb {
            let x = _mm256_loadu_si256(a.qs.as_ptr().add(b * QK) as *const __m256i);
            match kind {
                QKind::Q4_0 | QKind::Q4_1 => {
                    let w = unpack_q4(q.as_ptr().add(b * GROUP * 16));
                    p[0] = q4_isum(vnni, &w, a.qs.as_ptr().add(b * QK) as *const i32);
                }
                QKind::Q8_0 => {
                    let base = q.as_ptr().add(b * GROUP * 32);
                    for (i, pi) in p.iter_mut().enumerate() {
                        let w = _mm256_loadu_si256(base.add(i * 32) as *const __m256i);
                        // maddubs needs an unsigned operand: |w| and w's sign on x.
                        *pi = udot(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
                    }
                }
            }
            let isum = if kind == QKind::Q8_0 { transpose_sum(&p) } else { p[0] };
            let (dw, mw) = scales(kind, d, m, b);
            acc = add_block(kind, isum, dw, mw, a, b, acc);
        }
        let mut out = [0f32; GROUP];
        _mm256_storeu_ps(out.as_mut_ptr(), acc);
        out
    }
}
