//! The SIMD operations the attention kernels are written in: 16 f32 lanes
//! (one block's positions), scalar, AVX2 or AVX-512, each rounding exactly
//! as the scalar one.

use half::f16;

use super::L;

/// 16 f32 lanes (one block's positions) in the ISA's registers. Every
/// operation is lane-wise and rounds exactly as the scalar one does (`fma`
/// is fused), so each ISA gives the scalar kernel's bits.
pub(super) trait Isa {
    type V: Copy;
    fn ld(x: &[f32; L]) -> Self::V;
    fn st(v: Self::V, x: &mut [f32; L]);
    fn splat(x: f32) -> Self::V;
    fn add(a: Self::V, b: Self::V) -> Self::V;
    fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c`, one rounding.
    fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// Lane-wise maximum (no NaN reaches it unless the scores are NaN,
    /// and then every probability is NaN on each path).
    fn max(a: Self::V, b: Self::V) -> Self::V;
    fn sub(a: Self::V, b: Self::V) -> Self::V;
    /// `a / b`, correctly rounded (the sampler's `l / t`).
    fn div(a: Self::V, b: Self::V) -> Self::V;
    /// `2^n` of integer-valued lanes clamped to `-126..=127`, as
    /// `f32::from_bits(((n.clamp(-126.0, 127.0) as i32 + 127) as u32) << 23)`
    /// (lanes whose `n` is outside or NaN are recomputed by the caller).
    fn pow2(n: Self::V) -> Self::V;
    /// Whether some lane is outside `lo..=hi` (or NaN).
    fn outside(v: Self::V, lo: f32, hi: f32) -> bool;
    /// 16 halves, widened.
    fn ld_f16(src: &[f16]) -> Self::V;
    /// Rounded to f16 precision (nearest even) and back.
    fn round_f16(v: Self::V) -> Self::V;
    #[inline(always)]
    fn zero() -> Self::V {
        Self::splat(0.0)
    }
    /// Lanes `>= n` set to `+0.0` (rare: a row's last block).
    #[inline(always)]
    fn keep(v: Self::V, n: usize) -> Self::V {
        let mut x = [0f32; L];
        Self::st(v, &mut x);
        x[n..].iter_mut().for_each(|l| *l = 0.0);
        Self::ld(&x)
    }
}

pub(super) struct Scalar;
impl Isa for Scalar {
    type V = [f32; L];
    #[inline(always)]
    fn ld(x: &[f32; L]) -> [f32; L] {
        *x
    }
    #[inline(always)]
    fn st(v: [f32; L], x: &mut [f32; L]) {
        *x = v;
    }
    #[inline(always)]
    fn splat(x: f32) -> [f32; L] {
        [x; L]
    }
    #[inline(always)]
    fn add(a: [f32; L], b: [f32; L]) -> [f32; L] {
        std::array::from_fn(|l| a[l] + b[l])
    }
    #[inline(always)]
    fn mul(a: [f32; L], b: [f32; L]) -> [f32; L] {
        std::array::from_fn(|l| a[l] * b[l])
    }
    #[inline(always)]
    fn fma(a: [f32; L], b: [f32; L], c: [f32; L]) -> [f32; L] {
        std::array::from_fn(|l| a[l].mul_add(b[l], c[l]))
    }
    #[inline(always)]
    fn max(a: [f32; L], b: [f32; L]) -> [f32; L] {
        std::array::from_fn(|l| a[l].max(b[l]))
    }
    #[inline(always)]
    fn sub(a: [f32; L], b: [f32; L]) -> [f32; L] {
        std::array::from_fn(|l| a[l] - b[l])
    }
    #[inline(always)]
    fn div(a: [f32; L], b: [f32; L]) -> [f32; L] {
        std::array::from_fn(|l| a[l] / b[l])
    }
    #[inline(always)]
    fn pow2(n: [f32; L]) -> [f32; L] {
        std::array::from_fn(|l| {
            f32::from_bits(((n[l].clamp(-126.0, 127.0) as i32 + 127) as u32) << 23)
        })
    }
    #[inline(always)]
    fn outside(v: [f32; L], lo: f32, hi: f32) -> bool {
        v.iter().any(|x| !(lo..=hi).contains(x))
    }
    #[inline(always)]
    fn ld_f16(src: &[f16]) -> [f32; L] {
        std::array::from_fn(|l| src[l].to_f32())
    }
    #[inline(always)]
    fn round_f16(v: [f32; L]) -> [f32; L] {
        std::array::from_fn(|l| f16::from_f32(v[l]).to_f32())
    }
}

// The x86 methods call intrinsics from `#[inline(always)]` methods: they
// are only ever inlined into `job_avx2` / `job_avx512`, whose target
// features let LLVM inline the intrinsics in turn (checked by the
// instruction mix of `job_avx512`, see the module's bench note).
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::{Isa, L};
    use half::f16;
    use std::arch::x86_64::*;

    pub(in crate::attn_paged) struct Avx2;
    pub(in crate::attn_paged) struct Avx512;

    // Rounding to nearest even, as `f16::from_f32` (F16C's immediate has
    // 3 bits, AVX-512's 4: it also takes "no exceptions").
    const RNE: i32 = _MM_FROUND_TO_NEAREST_INT;
    const RNE_SAE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

    // SAFETY (every method): only instantiated behind the feature checks of
    // `super::kind` (avx2+fma+f16c; avx512f for `Avx512`); loads and stores
    // are unaligned and bounds-checked by the slice indexing first.
    impl Isa for Avx2 {
        type V = [__m256; 2];
        #[inline(always)]
        fn ld(x: &[f32; L]) -> Self::V {
            unsafe { [_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(x.as_ptr().add(8))] }
        }
        #[inline(always)]
        fn st(v: Self::V, x: &mut [f32; L]) {
            unsafe {
                _mm256_storeu_ps(x.as_mut_ptr(), v[0]);
                _mm256_storeu_ps(x.as_mut_ptr().add(8), v[1]);
            }
        }
        #[inline(always)]
        fn splat(x: f32) -> Self::V {
            unsafe { [_mm256_set1_ps(x); 2] }
        }
        #[inline(always)]
        fn add(a: Self::V, b: Self::V) -> Self::V {
            unsafe { [_mm256_add_ps(a[0], b[0]), _mm256_add_ps(a[1], b[1])] }
        }
        #[inline(always)]
        fn mul(a: Self::V, b: Self::V) -> Self::V {
            unsafe { [_mm256_mul_ps(a[0], b[0]), _mm256_mul_ps(a[1], b[1])] }
        }
        #[inline(always)]
        fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
            unsafe { [_mm256_fmadd_ps(a[0], b[0], c[0]), _mm256_fmadd_ps(a[1], b[1], c[1])] }
        }
        #[inline(always)]
        fn max(a: Self::V, b: Self::V) -> Self::V {
            unsafe { [_mm256_max_ps(a[0], b[0]), _mm256_max_ps(a[1], b[1])] }
        }
        #[inline(always)]
        fn sub(a: Self::V, b: Self::V) -> Self::V {
            unsafe { [_mm256_sub_ps(a[0], b[0]), _mm256_sub_ps(a[1], b[1])] }
        }
        #[inline(always)]
        fn div(a: Self::V, b: Self::V) -> Self::V {
            unsafe { [_mm256_div_ps(a[0], b[0]), _mm256_div_ps(a[1], b[1])] }
        }
        #[inline(always)]
        fn pow2(n: Self::V) -> Self::V {
            unsafe {
                let one = |n: __m256| {
                    let c = _mm256_min_ps(
                        _mm256_max_ps(n, _mm256_set1_ps(-126.0)),
                        _mm256_set1_ps(127.0),
                    );
                    let i = _mm256_add_epi32(_mm256_cvttps_epi32(c), _mm256_set1_epi32(127));
                    _mm256_castsi256_ps(_mm256_slli_epi32::<23>(i))
                };
                [one(n[0]), one(n[1])]
            }
        }
        #[inline(always)]
        fn outside(v: Self::V, lo: f32, hi: f32) -> bool {
            unsafe {
                let inside = |v: __m256| {
                    let ge = _mm256_cmp_ps::<_CMP_GE_OQ>(v, _mm256_set1_ps(lo));
                    let le = _mm256_cmp_ps::<_CMP_LE_OQ>(v, _mm256_set1_ps(hi));
                    _mm256_movemask_ps(_mm256_and_ps(ge, le))
                };
                (inside(v[0]) & inside(v[1])) != 0xff
            }
        }
        #[inline(always)]
        fn ld_f16(src: &[f16]) -> Self::V {
            let p = src[..L].as_ptr() as *const __m128i;
            unsafe {
                [_mm256_cvtph_ps(_mm_loadu_si128(p)), _mm256_cvtph_ps(_mm_loadu_si128(p.add(1)))]
            }
        }
        #[inline(always)]
        fn round_f16(v: Self::V) -> Self::V {
            unsafe {
                [
                    _mm256_cvtph_ps(_mm256_cvtps_ph::<RNE>(v[0])),
                    _mm256_cvtph_ps(_mm256_cvtps_ph::<RNE>(v[1])),
                ]
            }
        }
    }

    impl Isa for Avx512 {
        type V = __m512;
        #[inline(always)]
        fn ld(x: &[f32; L]) -> __m512 {
            unsafe { _mm512_loadu_ps(x.as_ptr()) }
        }
        #[inline(always)]
        fn st(v: __m512, x: &mut [f32; L]) {
            unsafe { _mm512_storeu_ps(x.as_mut_ptr(), v) }
        }
        #[inline(always)]
        fn splat(x: f32) -> __m512 {
            unsafe { _mm512_set1_ps(x) }
        }
        #[inline(always)]
        fn add(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_add_ps(a, b) }
        }
        #[inline(always)]
        fn mul(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_mul_ps(a, b) }
        }
        #[inline(always)]
        fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        fn max(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_max_ps(a, b) }
        }
        #[inline(always)]
        fn sub(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_sub_ps(a, b) }
        }
        #[inline(always)]
        fn div(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_div_ps(a, b) }
        }
        #[inline(always)]
        fn pow2(n: __m512) -> __m512 {
            unsafe {
                let c =
                    _mm512_min_ps(_mm512_max_ps(n, _mm512_set1_ps(-126.0)), _mm512_set1_ps(127.0));
                let i = _mm512_add_epi32(_mm512_cvttps_epi32(c), _mm512_set1_epi32(127));
                _mm512_castsi512_ps(_mm512_slli_epi32::<23>(i))
            }
        }
        #[inline(always)]
        fn outside(v: __m512, lo: f32, hi: f32) -> bool {
            unsafe {
                let ge = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(v, _mm512_set1_ps(lo));
                let le = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(v, _mm512_set1_ps(hi));
                (ge & le) != 0xffff
            }
        }
        #[inline(always)]
        fn ld_f16(src: &[f16]) -> __m512 {
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(src[..L].as_ptr() as *const __m256i)) }
        }
        #[inline(always)]
        fn round_f16(v: __m512) -> __m512 {
            unsafe { _mm512_cvtph_ps(_mm512_cvtps_ph::<RNE_SAE>(v)) }
        }
        #[inline(always)]
        fn keep(v: __m512, n: usize) -> __m512 {
            let m: __mmask16 = if n >= L { !0 } else { (1u16 << n) - 1 };
            unsafe { _mm512_maskz_mov_ps(m, v) }
        }
    }
}
