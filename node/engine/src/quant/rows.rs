//! Row-major quantized matrices: the K-quants (Q4_K, Q5_K, Q6_K, 256-element
//! super-blocks) and Q5_0, kept exactly as the GGUF file stores them (one
//! row = its blocks, contiguous).
//!
//! Two things are transcribed from ggml and must stay so:
//! - [`dequantize_blocks`]: ggml-quants.c `dequantize_row_*`, element by
//!   element with the same float operations (the bit-exact reference).
//! - the dot products, in the float order of the kernels llama.cpp runs on
//!   an AVX-512/AMX CPU, so that logits stay bit-comparable with it:
//!   * K-quants (ggml-cpu/amx/mmq.cpp, vnni and tile paths alike):
//!     activations quantized to Q8_K (`quantize_row_q8_K_ref`: f32 scale,
//!     256 per block); per row and super-block an exact integer sum
//!     `isum = Σ_sub scale_sub · (q · x)` and, for Q4_K/Q5_K, the min term
//!     `msum = Σ_sub min_sub · bsum_sub`; then `acc = fma(isum, d·dx, acc)`
//!     and `acc = fma(-msum, dmin·dx, acc)`, sequentially over super-blocks.
//!   * Q5_0 (llamafile tinyBLAS `tinyBLAS_Q0_AVX`, the same order as
//!     `ggml_vec_dot_q5_0_q8_0`): activations quantized to Q8_0; per block 8
//!     lane sums of 4 consecutive products, `acc[l] = fma(d_w·d_x, lane, acc[l])`,
//!     then a horizontal sum `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`.
//!
//! Integer sums are exact in any order, so a faster kernel only has to keep
//! the float steps.

use half::f16;

use super::{GgmlType, QActs, QK};

pub(crate) use super::k_common::scale_min_k4;
pub use super::k_common::{Q8K, QK_K};

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Whether `ty` is stored by this module.
pub(crate) fn is_row_type(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q5_0 | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K)
}

/// Reference dequantization of whole blocks of `ty` (one of this module's
/// types or BF16), transcribed from ggml-quants.c.
pub fn dequantize_blocks(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let (per, bsz) = ty.block_layout();
    for (x, y) in bytes.chunks_exact(bsz).zip(out.chunks_exact_mut(per)) {
        match ty {
            GgmlType::BF16 => {
                y[0] = f32::from_bits((u16::from_le_bytes([x[0], x[1]]) as u32) << 16)
            }
            GgmlType::Q5_0 => {
                let d = h(x, 0);
                let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
                let qs = &x[6..22];
                for j in 0..16 {
                    let xh0 = (((qh >> j) << 4) & 0x10) as u8;
                    let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
                    let x0 = ((qs[j] & 0x0F) | xh0) as i32 - 16;
                    let x1 = ((qs[j] >> 4) | xh1) as i32 - 16;
                    y[j] = x0 as f32 * d;
                    y[j + 16] = x1 as f32 * d;
                }
            }
            GgmlType::Q4_K | GgmlType::Q5_K => {
                let (d, min) = (h(x, 0), h(x, 2));
                let scales = &x[4..16];
                let five = ty == GgmlType::Q5_K;
                let (qh, mut ql) =
                    if five { (&x[16..48], &x[48..176]) } else { (&x[0..0], &x[16..144]) };
                let mut yi = 0;
                let (mut u1, mut u2) = (1u8, 2u8);
                for is in (0..8).step_by(2) {
                    let (sc, m) = scale_min_k4(is, scales);
                    let (d1, m1) = (d * sc as f32, min * m as f32);
                    let (sc, m) = scale_min_k4(is + 1, scales);
                    let (d2, m2) = (d * sc as f32, min * m as f32);
                    for l in 0..32 {
                        let hi = if five && qh[l] & u1 != 0 { 16 } else { 0 };
                        y[yi + l] = d1 * ((ql[l] & 0xF) + hi) as f32 - m1;
                    }
                    for l in 0..32 {
                        let hi = if five && qh[l] & u2 != 0 { 16 } else { 0 };
                        y[yi + 32 + l] = d2 * ((ql[l] >> 4) + hi) as f32 - m2;
                    }
                    yi += 64;
                    ql = &ql[32..];
                    u1 <<= 2;
                    u2 <<= 2;
                }
            }
            GgmlType::Q6_K => {
                let d = h(x, 208);
                for n in 0..2 {
                    let ql = &x[64 * n..];
                    let qh = &x[128 + 32 * n..];
                    let sc = &x[192 + 8 * n..];
                    let yo = &mut y[128 * n..];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                        yo[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        yo[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        yo[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        yo[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
            other => unreachable!("{other:?} is not a row type"),
        }
    }
}

/// One super-block's quants as integers (Q4_K/Q5_K: 0..32, Q6_K: -32..32)
/// with its per-sub-block scales (and, for Q4_K/Q5_K, mins). Q6_K has 16
/// sub-blocks of 16, the others 8 of 32.
struct KBlock {
    q: [i8; QK_K],
    scales: [i32; 16],
    mins: [i32; 8],
    d: f32,
    dmin: f32,
}

fn unpack_k(ty: GgmlType, x: &[u8], b: &mut KBlock) {
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => {
            b.d = h(x, 0);
            b.dmin = h(x, 2);
            let scales = &x[4..16];
            for j in 0..8 {
                let (s, m) = scale_min_k4(j, scales);
                b.scales[j] = s as i32;
                b.mins[j] = m as i32;
            }
            let five = ty == GgmlType::Q5_K;
            let ql = if five { &x[48..176] } else { &x[16..144] };
            for j in 0..8 {
                let src = &ql[32 * (j / 2)..][..32];
                let dst = &mut b.q[32 * j..][..32];
                for l in 0..32 {
                    let lo = if j % 2 == 0 { src[l] & 0xF } else { src[l] >> 4 };
                    let hi = if five { ((x[16 + l] >> j) & 1) << 4 } else { 0 };
                    dst[l] = (lo | hi) as i8;
                }
            }
        }
        GgmlType::Q6_K => {
            b.d = h(x, 208);
            b.dmin = 0.0;
            for s in 0..16 {
                b.scales[s] = x[192 + s] as i8 as i32;
            }
            for n in 0..2 {
                let (ql, qh) = (&x[64 * n..], &x[128 + 32 * n..]);
                let q = &mut b.q[128 * n..];
                for l in 0..32 {
                    q[l] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                    q[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                    q[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                    q[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                }
            }
        }
        other => unreachable!("{other:?} is not a K-quant"),
    }
}

/// A K-quant super-block's 32-element sub-block as one scale per 16
/// elements, a min and 32 signed quants: element `e` is
/// `a[e / 16] · q[e] − m`, the float operations of [`dequantize_blocks`]
/// (Q4_K/Q5_K: `d1 · q − m1`, both halves one scale; Q6_K: `(d · sc) · q`
/// with `m = 0`, a scale a 16). The GPU decoder's K-quant format.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KSub {
    pub a: [f32; 2],
    pub m: f32,
    pub q: [i8; 32],
}

/// Every 32-element sub-block of `bytes` (whole super-blocks of a
/// K-quant `ty`), in element order.
pub fn k_sub_blocks(ty: GgmlType, bytes: &[u8]) -> Vec<KSub> {
    let (_, bsz) = ty.block_layout();
    let mut kb = KBlock { q: [0; QK_K], scales: [0; 16], mins: [0; 8], d: 0.0, dmin: 0.0 };
    let mut out = Vec::with_capacity(bytes.len() / bsz * 8);
    for x in bytes.chunks_exact(bsz) {
        unpack_k(ty, x, &mut kb);
        for j in 0..8 {
            let mut q = [0i8; 32];
            q.copy_from_slice(&kb.q[32 * j..][..32]);
            let (a, m) = if ty == GgmlType::Q6_K {
                let s = |i: usize| kb.d * kb.scales[i] as f32;
                ([s(2 * j), s(2 * j + 1)], 0.0)
            } else {
                let a = kb.d * kb.scales[j] as f32;
                ([a, a], kb.dmin * kb.mins[j] as f32)
            };
            out.push(KSub { a, m, q });
        }
    }
    out
}

/// `Σ a·b` of equal-length int8 slices (exact).
#[inline(always)]
fn idot(a: &[i8], b: &[i8]) -> i32 {
    a.iter().zip(b).map(|(&x, &y)| x as i32 * y as i32).sum()
}

/// One K-quant super-block against Q8_K block `b` of activation row `a`,
/// added to `acc` in llama.cpp's AMX order.
#[inline(always)]
fn k_block_dot(ty: GgmlType, kb: &KBlock, a: &Q8K, t_block: usize, acc: f32) -> f32 {
    let x = &a.qs[t_block * QK_K..][..QK_K];
    let dx = a.d[t_block];
    if ty == GgmlType::Q6_K {
        let mut isum = 0i32;
        for s in 0..16 {
            isum += kb.scales[s] * idot(&kb.q[16 * s..][..16], &x[16 * s..][..16]);
        }
        return (isum as f32).mul_add(kb.d * dx, acc);
    }
    let bs = &a.bsums[t_block * 16..][..16];
    let (mut isum, mut msum) = (0i32, 0i32);
    for j in 0..8 {
        isum += kb.scales[j] * idot(&kb.q[32 * j..][..32], &x[32 * j..][..32]);
        msum += kb.mins[j] * (bs[2 * j] + bs[2 * j + 1]);
    }
    let acc = (isum as f32).mul_add(kb.d * dx, acc);
    (-(msum as f32)).mul_add(kb.dmin * dx, acc)
}

/// Q5_0 block as 32 signed quants (-16..16).
#[inline(always)]
fn unpack_q5_0(x: &[u8], q: &mut [i8; QK]) -> f32 {
    let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
    for j in 0..16 {
        q[j] = ((x[6 + j] & 0xF) | ((((qh >> j) & 1) as u8) << 4)) as i8 - 16;
        q[j + 16] = ((x[6 + j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4)) as i8 - 16;
    }
    h(x, 0)
}

/// tinyBLAS's `hsum` of 8 lanes.
#[inline(always)]
fn hsum8(a: &[f32; 8]) -> f32 {
    let r: [f32; 4] = std::array::from_fn(|j| a[j + 4] + a[j]);
    (r[0] + r[2]) + (r[1] + r[3])
}

#[cfg(not(test))]
fn force_scalar() -> bool {
    false
}

/// Tests run the scalar path on demand to compare it with the SIMD one.
#[cfg(test)]
fn force_scalar() -> bool {
    tests::FORCE_SCALAR.with(|f| f.get())
}

/// `GCS_ENGINE_NO_AVX512=1` runs the AVX2 kernels where AVX-512 ones
/// would run (side-by-side runs of one binary).
#[cfg(not(test))]
fn force_avx2() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var("GCS_ENGINE_NO_AVX512").is_ok_and(|v| v == "1"))
}

/// Tests run the AVX2 kernels where AVX-512 ones would run, to compare them.
#[cfg(test)]
fn force_avx2() -> bool {
    tests::FORCE_AVX2.with(|f| f.get())
}

/// `f(ti, out)` for each task of `per_task` weight rows, in parallel, on
/// the thread's scratch of `[rows of the task, n]` results.
fn for_each_task(rows: usize, per_task: usize, n: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    crate::par::for_each_index(rows.div_ceil(per_task), |ti| {
        let nr = per_task.min(rows - ti * per_task);
        super::with_scratch(nr * n, |o| f(ti, o))
    })
}

/// `out[t, c0 + r] = Σ_c w[r, c] · x[t, c]` for a row-major matrix of a
/// row type, multithreaded over rows, into columns `c0..c0 + rows` of `outc`.
pub(crate) fn matmul_rows(
    ty: GgmlType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    outc: &super::OutColumns<'_>,
    c0: usize,
) {
    let (per, bsz) = ty.block_layout();
    let nb = cols / per;
    let row_bytes = nb * bsz;
    let region = super::profile::Region::begin(ty);
    let mut quant_ns = 0;
    let threads = crate::par::threads();
    let per_task = if n * rows <= 8192 { rows.div_ceil(threads) } else { 16 };
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c");
    #[cfg(not(target_arch = "x86_64"))]
    let avx2 = false;
    if avx2 && !force_scalar() {
        #[cfg(target_arch = "x86_64")]
        {
            let tq = super::profile::start();
            let q5 = (ty == GgmlType::Q5_0).then(|| QActs::quantize(x, n, cols));
            let q8k = (ty != GgmlType::Q5_0).then(|| Q8K::quantize(x));
            quant_ns = tq.map_or(0, |t| t.elapsed().as_nanos() as u64);
            // Several activation rows (a prefill) take the AVX-512 kernels
            // where the CPU has them.
            let wide = n > 1 && !force_avx2() && super::rows_avx512::available();
            let task = |ti: usize, o: &mut [f32]| {
                let r0 = ti * per_task;
                if let Some(a) = &q5 {
                    // Four rows at a time, then the rest one by one.
                    let four = o.len() / (4 * n) * 4 * n;
                    let (o4, o1) = o.split_at_mut(four);
                    for (gi, og) in o4.chunks_mut(4 * n).enumerate() {
                        let w = &bytes[(r0 + 4 * gi) * row_bytes..][..4 * row_bytes];
                        // SAFETY: the CPU features were detected above.
                        unsafe {
                            if wide {
                                super::rows_avx512::q5_0_tiled::<4>(
                                    w, row_bytes, nb, &a.d, &a.qs, og,
                                )
                            } else {
                                super::rows_avx2::q5_0_rows::<4>(w, row_bytes, nb, &a.d, &a.qs, og)
                            }
                        }
                    }
                    for (ri, orow) in o1.chunks_mut(n).enumerate() {
                        let r = r0 + four / n + ri;
                        let w = &bytes[r * row_bytes..][..row_bytes];
                        // SAFETY: as above.
                        unsafe {
                            if wide {
                                super::rows_avx512::q5_0_tiled::<1>(
                                    w, row_bytes, nb, &a.d, &a.qs, orow,
                                )
                            } else {
                                super::rows_avx2::q5_0_rows::<1>(
                                    w, row_bytes, nb, &a.d, &a.qs, orow,
                                )
                            }
                        }
                    }
                    return;
                }
                let Some(a) = &q8k else { return };
                for (ri, orow) in o.chunks_mut(n).enumerate() {
                    let w = &bytes[(r0 + ri) * row_bytes..][..row_bytes];
                    // SAFETY: the CPU features were detected above (and
                    // AVX-512's by `available`).
                    unsafe {
                        if wide {
                            super::rows_avx512::k_row(ty, w, nb, a, orow)
                        } else {
                            super::rows_avx2::k_row(ty, w, nb, a, orow)
                        }
                    }
                }
            };
            for_each_task(rows, per_task, n, |ti, o| {
                super::profile::Region::task(&region, || {
                    task(ti, o);
                    // SAFETY: rows ti * per_task.. are this task's alone.
                    unsafe { outc.put_rows(c0 + ti * per_task, o) }
                })
            });
        }
    } else if ty == GgmlType::Q5_0 {
        let acts = QActs::quantize(x, n, cols);
        for_each_task(rows, per_task, n, |ti, o| {
            let mut q = [0i8; QK];
            let mut acc = vec![[0f32; 8]; n];
            for (ri, orow) in o.chunks_mut(n).enumerate() {
                let r = ti * per_task + ri;
                let w = &bytes[r * row_bytes..][..row_bytes];
                acc.iter_mut().for_each(|a| *a = [0.0; 8]);
                for b in 0..nb {
                    let dw = unpack_q5_0(&w[b * bsz..][..bsz], &mut q);
                    for (t, at) in acc.iter_mut().enumerate() {
                        let xq = &acts.qs[t * cols + b * QK..][..QK];
                        let d = dw * acts.d[t * nb + b];
                        for (l, al) in at.iter_mut().enumerate() {
                            let s = idot(&q[4 * l..][..4], &xq[4 * l..][..4]);
                            *al = d.mul_add(s as f32, *al);
                        }
                    }
                }
                for (o, a) in orow.iter_mut().zip(&acc) {
                    *o = hsum8(a);
                }
            }
            // SAFETY: rows ti * per_task.. are this task's alone.
            unsafe { outc.put_rows(c0 + ti * per_task, o) }
        });
    } else {
        let acts = Q8K::quantize(x);
        for_each_task(rows, per_task, n, |ti, o| {
            let mut kb = KBlock { q: [0; QK_K], scales: [0; 16], mins: [0; 8], d: 0.0, dmin: 0.0 };
            for (ri, orow) in o.chunks_mut(n).enumerate() {
                let r = ti * per_task + ri;
                let w = &bytes[r * row_bytes..][..row_bytes];
                orow.iter_mut().for_each(|v| *v = 0.0);
                for b in 0..nb {
                    unpack_k(ty, &w[b * bsz..][..bsz], &mut kb);
                    for (t, ot) in orow.iter_mut().enumerate() {
                        *ot = k_block_dot(ty, &kb, &acts, t * nb + b, *ot);
                    }
                }
            }
            // SAFETY: as above.
            unsafe { outc.put_rows(c0 + ti * per_task, o) }
        });
    }
    super::profile::Region::finish(region, quant_ns);
}

#[cfg(test)]
#[path = "rows_tests.rs"]
mod tests;
