//! What the K-quant rows and their AVX2 kernels share: the super-block
//! size, ggml's packed 6-bit scales, and the Q8_K activations that are the
//! dot products' other operand. A leaf of its own so that the scalar rows
//! and the kernels do not import each other.

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j`.
#[inline]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Activations quantized to Q8_K (`quantize_row_q8_K_ref`): per 256
/// elements an f32 scale, 256 int8 and 16 sums of 16.
#[derive(Debug)]
pub struct Q8K {
    pub d: Vec<f32>,
    pub qs: Vec<i8>,
    pub bsums: Vec<i32>,
}

impl Q8K {
    /// Super-blocks in parallel when there are many (a prefill); each is
    /// quantized alone, so the split does not change a bit.
    pub fn quantize(x: &[f32]) -> Self {
        let nb = x.len() / QK_K;
        let mut out =
            Self { d: vec![0f32; nb], qs: vec![0i8; nb * QK_K], bsums: vec![0i32; nb * 16] };
        if nb < 32 {
            // A decode step: one part, no list of parts to build.
            let Self { d, qs, bsums } = &mut out;
            Self::quantize_blocks(x, d, qs, bsums);
            return out;
        }
        let per = nb.div_ceil(crate::par::threads());
        let mut parts: Vec<_> = x
            .chunks(per * QK_K)
            .zip(out.d.chunks_mut(per))
            .zip(out.qs.chunks_mut(per * QK_K))
            .zip(out.bsums.chunks_mut(per * 16))
            .map(|(((x, d), qs), bsums)| (x, d, qs, bsums))
            .collect();
        crate::par::for_each_chunk_mut(&mut parts, 1, |_, p| {
            let (x, d, qs, bsums) = &mut p[0];
            Self::quantize_blocks(x, d, qs, bsums)
        });
        out
    }

    fn quantize_blocks(x: &[f32], d: &mut [f32], qs: &mut [i8], bsums: &mut [i32]) {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("sse4.1") {
            // SAFETY: SSE4.1 support was detected above.
            return unsafe { Self::quantize_sse41(x, d, qs, bsums) };
        }
        Self::quantize_impl(x, d, qs, bsums)
    }

    /// Compiled with SSE4.1 so rounding is one instruction, not a libm call.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "sse4.1")]
    unsafe fn quantize_sse41(x: &[f32], d: &mut [f32], qs: &mut [i8], bsums: &mut [i32]) {
        Self::quantize_impl(x, d, qs, bsums)
    }

    #[inline(always)]
    fn quantize_impl(x: &[f32], d: &mut [f32], qs: &mut [i8], bsums: &mut [i32]) {
        for (i, xb) in x.chunks_exact(QK_K).enumerate() {
            let (mut max, mut amax) = (0f32, 0f32);
            for &v in xb {
                if v.abs() > amax {
                    amax = v.abs();
                    max = v;
                }
            }
            if amax == 0.0 {
                continue;
            }
            let iscale = -127.0 / max;
            let q = &mut qs[i * QK_K..][..QK_K];
            for (qj, &v) in q.iter_mut().zip(xb) {
                // ggml's nearest_int: round half to even.
                *qj = ((iscale * v).round_ties_even() as i32).min(127) as i8;
            }
            for j in 0..16 {
                bsums[i * 16 + j] = q[16 * j..][..16].iter().map(|&v| v as i32).sum();
            }
            d[i] = 1.0 / iscale;
        }
    }
}

