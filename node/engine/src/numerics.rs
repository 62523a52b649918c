//! Scalar emulations of llama.cpp's CPU float routines.
//!
//! Greedy decoding of a small quantized model is chaotic: a one-ulp change
//! upstream of an 8-bit activation quantizer can flip a rounding and change
//! later logits by ~0.1. To reproduce llama.cpp's greedy outputs we follow
//! its arithmetic order where it matters (exp approximation, reductions).

#[inline(always)]
fn c(bits: u32) -> f32 {
    f32::from_bits(bits)
}

/// ggml's vectorised `expf` (AVX-512 `ggml_v_expf`), one lane at a time.
/// Every step is a single IEEE operation, so the result is bit-identical.
#[inline]
pub fn ggml_expf(x: f32) -> f32 {
    let r = c(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(c(0x3fb8_aa3b), r);
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    if n.is_nan() {
        return f32::NAN;
    }
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6).mul_add(b, 1.0));
    scalef(j, n as i32)
}

/// `j * 2^n` with one rounding (like `_mm512_scalef_ps`).
#[inline]
fn scalef(j: f32, n: i32) -> f32 {
    if (-126..=127).contains(&n) {
        j * f32::from_bits(((n + 127) as u32) << 23)
    } else if n > 127 {
        j * f32::from_bits(254 << 23) * f32::from_bits(((n - 127 + 127) as u32) << 23)
    } else {
        // Deep underflow: split so that only the final multiply rounds.
        let a = f32::from_bits(1 << 23); // 2^-126
        let rest = n + 126;
        if rest < -149 {
            0.0
        } else {
            (j * a) * 2f32.powi(rest)
        }
    }
}

/// SiLU as ggml computes it: `x / (1 + exp(0 - x))`.
#[inline]
pub fn ggml_silu(x: f32) -> f32 {
    x / (1.0 + ggml_expf(0.0 - x))
}

/// `_mm512_reduce_add_ps` pairing (GCC): halve 16 -> 8 -> 4 -> 2 -> 1.
#[inline]
pub fn reduce16(a: &[f32; 16]) -> f32 {
    let mut t8 = [0f32; 8];
    for i in 0..8 {
        t8[i] = a[8 + i] + a[i];
    }
    let mut t4 = [0f32; 4];
    for i in 0..4 {
        t4[i] = t8[4 + i] + t8[i];
    }
    let x0 = t4[0] + t4[2];
    let x1 = t4[1] + t4[3];
    x0 + x1
}

/// Dot product in llamafile tinyBLAS order for 16-lane vectors: lane `i`
/// accumulates elements `i, i+16, ...` with FMA, then a tree reduction.
/// Lengths must be multiples of 16 (head dims and padded KV lengths are).
#[inline(always)]
pub fn dot16(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (ca, cb) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        for i in 0..16 {
            acc[i] = ca[i].mul_add(cb[i], acc[i]);
        }
    }
    reduce16(&acc)
}

/// Dot product in the order of ggml's AVX-512 `ggml_vec_dot_f16` (the
/// path llama.cpp's CPU matmul takes for an f16 operand when the batch has a
/// single row, i.e. decode): four 16-lane FMA accumulators, chunk `c` of 16
/// elements going to accumulator `c % 4`, reduced as (0+2) + (1+3), then a
/// tree reduction. A tail of `len % 64` elements is added in f64, as ggml
/// does. Always inlined so callers compiled with FMA get `vfmadd`, not `fmaf`.
#[inline(always)]
pub fn vec_dot_f16_order(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let np = n - n % 64;
    let mut sum = vec_dot_f16_chunks(&a[..np], &b[..np]) as f64;
    for i in np..n {
        sum += (a[i] * b[i]) as f64;
    }
    sum as f32
}

/// [`vec_dot_f16_order`] of vectors that continue with zeros up to a
/// multiple of 64 (llama.cpp's padded, masked KV length): the zero chunks
/// are skipped, which leaves every accumulator unchanged. `len % 16 == 0`.
#[inline(always)]
pub fn vec_dot_f16_order_zero_padded(a: &[f32], b: &[f32]) -> f32 {
    debug_assert!(a.len().is_multiple_of(16) && a.len() == b.len());
    vec_dot_f16_chunks(a, b)
}

#[inline(always)]
fn vec_dot_f16_chunks(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [[0f32; 16]; 4];
    let np = a.len() - a.len() % 64;
    for (ca, cb) in a[..np].chunks_exact(64).zip(b[..np].chunks_exact(64)) {
        for (j, s) in acc.iter_mut().enumerate() {
            for i in 0..16 {
                s[i] = ca[16 * j + i].mul_add(cb[16 * j + i], s[i]);
            }
        }
    }
    // Remaining whole 16-chunks (zero-padded use only).
    for (j, (ca, cb)) in a[np..].chunks_exact(16).zip(b[np..].chunks_exact(16)).enumerate() {
        for i in 0..16 {
            acc[j][i] = ca[i].mul_add(cb[i], acc[j][i]);
        }
    }
    let mut x = [0f32; 16];
    for l in 0..16 {
        x[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    reduce16(&x)
}

/// RMS normalisation like `ggml_compute_forward_rms_norm_f32` followed by
/// the weight multiply: f64 sum of f32 squares.
pub fn rms_norm_rows(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for r in x.chunks_exact_mut(d) {
        let sum: f64 = r.iter().map(|&a| (a * a) as f64).sum();
        let mean = (sum / d as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for (a, &g) in r.iter_mut().zip(w) {
            *a = (*a * scale) * g;
        }
    }
}

/// `act[r] = silu(gate[r]) * up[r]` for rows laid out `[gate | up]`
/// (`gu`: `[n, 2 * inter]`, `act`: `[n, inter]`).
pub fn swiglu_rows(gu: &[f32], act: &mut [f32], inter: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("fma") {
        // SAFETY: FMA support was detected above.
        return unsafe { swiglu_fma(gu, act, inter) };
    }
    swiglu_impl(gu, act, inter)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma,avx2")]
unsafe fn swiglu_fma(gu: &[f32], act: &mut [f32], inter: usize) {
    swiglu_impl(gu, act, inter)
}

#[inline(always)]
fn swiglu_impl(gu: &[f32], act: &mut [f32], inter: usize) {
    for (a, r) in act.chunks_exact_mut(inter).zip(gu.chunks_exact(2 * inter)) {
        let (g, u) = r.split_at(inter);
        for ((a, &g), &u) in a.iter_mut().zip(g).zip(u) {
            *a = ggml_silu(g) * u;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expf_is_accurate() {
        for i in -2000..1770 {
            let x = i as f32 * 0.05;
            let (a, b) = (ggml_expf(x), x.exp());
            assert!((a - b).abs() <= 4e-7 * b.max(f32::MIN_POSITIVE), "{x}: {a} vs {b}");
        }
        assert_eq!(ggml_expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(ggml_expf(-200.0), 0.0);
    }

    #[test]
    fn dot16_and_reduce() {
        let a: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let b = vec![1f32; 64];
        assert_eq!(dot16(&a, &b), (0..64).sum::<i32>() as f32);
        assert_eq!(vec_dot_f16_order(&a, &b), (0..64).sum::<i32>() as f32);
        assert_eq!(vec_dot_f16_order(&a[..40], &b[..40]), (0..40).sum::<i32>() as f32);
        // Zero padding to 64 changes nothing, skipped or not.
        let c: Vec<f32> = (0..48).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut c64 = c.clone();
        c64.resize(64, 0.0);
        let d: Vec<f32> = (0..64).map(|i| (i as f32 * 0.11).cos()).collect();
        assert_eq!(
            vec_dot_f16_order_zero_padded(&c, &d[..48]).to_bits(),
            vec_dot_f16_order(&c64, &d).to_bits()
        );
    }
}
