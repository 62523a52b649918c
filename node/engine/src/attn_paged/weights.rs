//! A sampler's weights `exp(l / t - max / t)` over a row of logits, with
//! ggml's `expf` ([`crate::numerics::ggml_expf`]), vectorised. A GPU's
//! picking kernel computes the same function (`kernels::pick::weight`),
//! and each step of it is one IEEE division, subtraction, multiplication
//! or fused multiply-add, so the two sides' weights, and the draws and
//! logprobs summed from them, are the same bits. (A platform's `exp` is
//! not: CUDA's `expf` is within 2 ulp of glibc's, enough to move a draw
//! in a long tail or a logprob's last bits.) Here beside the attention
//! kernels because their ISA layer ([`super::isa`]) is.

use super::isa::{Isa, Scalar};
use super::{exp_lanes, kind, Kind, L};
use crate::numerics::ggml_expf;

/// `out[i] = ggml_expf(x[i] / t - max / t)` (`x` and `out` of one
/// length), on the widest ISA this CPU has: every ISA gives the scalar
/// routine's bits.
pub fn exp_weights(x: &[f32], t: f32, max: f32, out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "one weight a logit");
    match kind() {
        Kind::Scalar => weights::<Scalar>(x, t, max, out),
        // SAFETY: the features were detected by `kind`.
        #[cfg(target_arch = "x86_64")]
        Kind::Avx2 => unsafe { x86::weights_avx2(x, t, max, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Kind::Avx512 => unsafe { x86::weights_avx512(x, t, max, out) },
    }
}

/// One logit's weight, as [`exp_weights`] computes it.
#[inline]
pub fn exp_weight(l: f32, t: f32, max: f32) -> f32 {
    ggml_expf(l / t - max / t)
}

#[inline(always)]
fn weights<I: Isa>(x: &[f32], t: f32, max: f32, out: &mut [f32]) {
    let m = max / t;
    let (xs, x_rest) = x.as_chunks::<L>();
    let (os, o_rest) = out.as_chunks_mut::<L>();
    for (a, o) in xs.iter().zip(os) {
        *o = exp_lanes::<I>(I::sub(I::div(I::ld(a), I::splat(t)), I::splat(m)));
    }
    for (&l, o) in x_rest.iter().zip(o_rest) {
        *o = exp_weight(l, t, max);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::isa::x86::{Avx2, Avx512};

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn weights_avx512(x: &[f32], t: f32, max: f32, out: &mut [f32]) {
        super::weights::<Avx512>(x, t, max, out)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn weights_avx2(x: &[f32], t: f32, max: f32, out: &mut [f32]) {
        super::weights::<Avx2>(x, t, max, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logits a row can hold: a model's spread at temperatures from 0.1
    /// to 2, masked tokens (`-inf`), deep underflow and a tail not a
    /// multiple of 16.
    fn rows() -> Vec<(Vec<f32>, f32)> {
        let mut state = 0x2545_f491u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state as f32 / u32::MAX as f32
        };
        let mut out = vec![];
        for (t, spread) in [(1.0, 30.0), (0.1, 30.0), (0.7, 12.0), (2.0, 80.0), (0.013, 5.0)] {
            let mut row: Vec<f32> = (0..999).map(|_| (next() - 0.5) * spread).collect();
            row[5] = f32::NEG_INFINITY;
            row[600] = -1.0e30;
            out.push((row, t));
        }
        out
    }

    #[test]
    fn every_isa_weighs_as_the_scalar_routine() {
        for (row, t) in rows() {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let want: Vec<u32> = row.iter().map(|&l| exp_weight(l, t, max).to_bits()).collect();
            let bits = |w: &[f32]| w.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let mut got = vec![0f32; row.len()];
            weights::<Scalar>(&row, t, max, &mut got);
            assert_eq!(bits(&got), want, "scalar, t = {t}");
            exp_weights(&row, t, max, &mut got);
            assert_eq!(bits(&got), want, "{:?}, t = {t}", kind());
            assert_eq!((got[5], got[600]), (0.0, 0.0), "masked and underflowing logits weigh 0");
            #[cfg(target_arch = "x86_64")]
            if kind() == Kind::Avx512 {
                // The AVX2 form too, where the default was AVX-512.
                // SAFETY: AVX-512 implies what AVX2's form needs.
                unsafe { x86::weights_avx2(&row, t, max, &mut got) };
                assert_eq!(bits(&got), want, "avx2, t = {t}");
            }
        }
    }

    /// Within 2 ulp of the platform's `exp` of the same argument (ggml's
    /// routine is an approximation; this bounds what switching to it moved).
    #[test]
    fn the_weights_are_within_two_ulp_of_exp() {
        for (row, t) in rows() {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for &l in &row {
                let (a, b) = (exp_weight(l, t, max), (l / t - max / t).exp());
                if b >= f32::MIN_POSITIVE {
                    let ulps = (a.to_bits() as i64 - b.to_bits() as i64).abs();
                    assert!(ulps <= 2, "l {l}, t {t}: {a} against {b}");
                } else {
                    assert!(a < 1.2e-38, "l {l}, t {t}: {a} against {b}");
                }
            }
        }
    }
}
