//! Row types against the transcribed reference dequantization and against
//! an element-by-element statement of llama.cpp's float order.

use half::f16;

use super::*;
use crate::quant::{dequantize, QMatrix};

thread_local! {
    /// Set by a test to run [`matmul_rows`]' scalar path on this thread.
    pub(super) static FORCE_SCALAR: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Set by a test to run the AVX2 kernels instead of the AVX-512 ones.
    pub(super) static FORCE_AVX2: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn lcg(seed: &mut u64) -> u32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (*seed >> 33) as u32
}

fn f16b(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

/// Random blocks of `ty` with realistic (small, positive) super-scales.
fn random_blocks(ty: GgmlType, n_blocks: usize, seed: &mut u64) -> Vec<u8> {
    let (_, bsz) = ty.block_layout();
    let mut out = Vec::with_capacity(n_blocks * bsz);
    for _ in 0..n_blocks {
        let mut b: Vec<u8> = (0..bsz).map(|_| lcg(seed) as u8).collect();
        let d = (lcg(seed) % 1000) as f32 * 1e-5 + 1e-4;
        let dmin = (lcg(seed) % 1000) as f32 * 1e-5;
        match ty {
            GgmlType::Q5_0 => b[0..2].copy_from_slice(&f16b(d)),
            GgmlType::Q4_K | GgmlType::Q5_K => {
                b[0..2].copy_from_slice(&f16b(d));
                b[2..4].copy_from_slice(&f16b(dmin));
            }
            GgmlType::Q6_K => b[208..210].copy_from_slice(&f16b(d)),
            _ => unreachable!(),
        }
        out.extend_from_slice(&b);
    }
    out
}

/// Integer quant of element `e` of a super-block, written from the block
/// layout comments of ggml-common.h independently of `unpack_k`, with its
/// scale and min.
fn k_element(ty: GgmlType, x: &[u8], e: usize) -> (i32, i32, i32) {
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (j, l) = (e / 32, e % 32);
            let ql = if ty == GgmlType::Q5_K { &x[48..] } else { &x[16..] };
            let byte = ql[(j / 2) * 32 + l];
            let mut q = if j % 2 == 0 { byte & 15 } else { byte >> 4 } as i32;
            if ty == GgmlType::Q5_K && x[16 + l] & (1 << j) != 0 {
                q += 16;
            }
            let (s, m) = scale_min_k4(j, &x[4..16]);
            (q, s as i32, m as i32)
        }
        GgmlType::Q6_K => {
            let (n, r) = (e / 128, e % 128);
            let (quarter, l) = (r / 32, r % 32);
            let byte = x[64 * n + l + 32 * (quarter % 2)];
            let lo = if quarter < 2 { byte & 15 } else { byte >> 4 };
            let hi = (x[128 + 32 * n + l] >> (2 * quarter)) & 3;
            ((lo | (hi << 4)) as i32 - 32, x[192 + e / 16] as i8 as i32, 0)
        }
        _ => unreachable!(),
    }
}

#[test]
fn unpacked_quants_rebuild_the_reference_bit_for_bit() {
    let mut seed = 11;
    for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
        let bytes = random_blocks(ty, 6, &mut seed);
        let reference = dequantize(ty, &bytes);
        let mut kb = KBlock { q: [0; QK_K], scales: [0; 16], mins: [0; 8], d: 0.0, dmin: 0.0 };
        for (bi, x) in bytes.chunks_exact(ty.block_layout().1).enumerate() {
            unpack_k(ty, x, &mut kb);
            for e in 0..QK_K {
                let want = reference[bi * QK_K + e];
                let (q, s, m) = k_element(ty, x, e);
                assert_eq!(kb.q[e] as i32, q, "{ty:?} block {bi} element {e}");
                // ggml's formulas, one rounding per operation.
                let got = if ty == GgmlType::Q6_K {
                    kb.d * kb.scales[e / 16] as f32 * q as f32
                } else {
                    (kb.d * s as f32) * q as f32 - kb.dmin * m as f32
                };
                assert_eq!(got.to_bits(), want.to_bits(), "{ty:?} block {bi} element {e}");
            }
        }
    }
    let bytes = random_blocks(GgmlType::Q5_0, 8, &mut seed);
    let reference = dequantize(GgmlType::Q5_0, &bytes);
    let mut q = [0i8; QK];
    for (bi, x) in bytes.chunks_exact(22).enumerate() {
        let d = unpack_q5_0(x, &mut q);
        for e in 0..QK {
            assert_eq!((q[e] as f32 * d).to_bits(), reference[bi * QK + e].to_bits());
        }
    }
}

#[test]
fn known_blocks_decode_to_known_values() {
    // Q4_K: d = 1, dmin = 0.5, sub-block j has scale j + 1 and min 2
    // (6-bit packing of get_scale_min_k4), every quant 3.
    let mut b = vec![0u8; 144];
    b[0..2].copy_from_slice(&f16b(1.0));
    b[2..4].copy_from_slice(&f16b(0.5));
    for j in 0..4 {
        b[4 + j] = (j + 1) as u8; // scales 0..4
        b[8 + j] = 2; // mins 0..4
    }
    for j in 4..8 {
        // low 4 bits of scale j and min j share byte j + 4.
        b[8 + j] = ((j + 1) as u8 & 0xF) | (2 << 4);
    }
    b[16..144].fill(0x33);
    let y = dequantize(GgmlType::Q4_K, &b);
    for (e, v) in y.iter().enumerate() {
        assert_eq!(*v, (e / 32 + 1) as f32 * 3.0 - 1.0, "element {e}");
    }
    // Q6_K: d = 0.25, scales -2, quant bytes giving q = 63 - 32 = 31.
    let mut b = vec![0u8; 210];
    b[0..128].fill(0xFF);
    b[128..192].fill(0xFF);
    b[192..208].fill((-2i8) as u8);
    b[208..210].copy_from_slice(&f16b(0.25));
    assert!(dequantize(GgmlType::Q6_K, &b).iter().all(|&v| v == 0.25 * -2.0 * 31.0));
    // BF16 is the top half of an f32.
    let bits = 1.5f32.to_bits();
    assert_eq!(dequantize(GgmlType::BF16, &((bits >> 16) as u16).to_le_bytes()), vec![1.5]);
}

/// llama.cpp's result for one row and one activation row, element by
/// element from the reference layouts (see the module docs).
fn ggml_order(ty: GgmlType, w: &[u8], x: &[f32]) -> f32 {
    let (per, bsz) = ty.block_layout();
    if ty == GgmlType::Q5_0 {
        let a = QActs::quantize(x, 1, x.len());
        let dq = dequantize(ty, w);
        let mut acc = [0f32; 8];
        for (b, blk) in w.chunks_exact(bsz).enumerate() {
            let dw = f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32();
            for (l, al) in acc.iter_mut().enumerate() {
                let mut s = 0i32;
                for e in 4 * l..4 * l + 4 {
                    // dequantized / d is the exact integer quant.
                    let q = (dq[b * per + e] / dw).round() as i32;
                    s += q * a.qs[b * per + e] as i32;
                }
                *al = (dw * a.d[b]).mul_add(s as f32, *al);
            }
        }
        let r: Vec<f32> = (0..4).map(|j| acc[j + 4] + acc[j]).collect();
        return (r[0] + r[2]) + (r[1] + r[3]);
    }
    let a = Q8K::quantize(x);
    let mut acc = 0f32;
    for (b, blk) in w.chunks_exact(bsz).enumerate() {
        let (mut isum, mut msum) = (0i64, 0i64);
        for e in 0..QK_K {
            let (q, s, m) = k_element(ty, blk, e);
            isum += (s * q * a.qs[b * QK_K + e] as i32) as i64;
            msum += (m * a.qs[b * QK_K + e] as i32) as i64;
        }
        let dx = a.d[b];
        if ty == GgmlType::Q6_K {
            let d = f16::from_bits(u16::from_le_bytes([blk[208], blk[209]])).to_f32();
            acc = (isum as f32).mul_add(d * dx, acc);
        } else {
            let d = f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32();
            let dmin = f16::from_bits(u16::from_le_bytes([blk[2], blk[3]])).to_f32();
            acc = (isum as f32).mul_add(d * dx, acc);
            acc = (-(msum as f32)).mul_add(dmin * dx, acc);
        }
    }
    acc
}

#[test]
fn matmul_follows_ggml_order_and_approximates_f32() {
    let mut seed = 5;
    // n = 11 covers a full and a partial tile of the prefill kernels.
    let cases = [GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K]
        .into_iter()
        .flat_map(|ty| [(ty, 1), (ty, 3), (ty, 11)]);
    for (ty, n) in cases {
        let (per, bsz) = ty.block_layout();
        let (rows, cols) = (13, 512);
        let bytes = random_blocks(ty, rows * cols / per, &mut seed);
        let m = QMatrix::from_gguf(ty, rows, cols, &bytes);
        let x: Vec<f32> =
            (0..n * cols).map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0).collect();
        let mut out = vec![0f32; n * rows];
        m.matmul(&x, n, &mut out);
        // The scalar path gives the same bits (rayon runs it on this
        // thread too: the matrix is small enough for one task per thread,
        // but the flag is per thread, so compare only when it took effect).
        FORCE_SCALAR.with(|f| f.set(true));
        let mut scalar = vec![0f32; n * rows];
        rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap().install(|| {
            FORCE_SCALAR.with(|f| f.set(true));
            m.matmul(&x, n, &mut scalar)
        });
        FORCE_SCALAR.with(|f| f.set(false));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out), bits(&scalar), "{ty:?}: SIMD and scalar paths differ");
        // And the AVX2 kernels where the AVX-512 ones ran (n > 1, Q5_0).
        let mut avx2 = vec![0f32; n * rows];
        rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap().install(|| {
            FORCE_AVX2.with(|f| f.set(true));
            m.matmul(&x, n, &mut avx2);
            FORCE_AVX2.with(|f| f.set(false));
        });
        assert_eq!(bits(&out), bits(&avx2), "{ty:?}: AVX-512 and AVX2 paths differ");
        let wf = dequantize(ty, &bytes);
        let row_bytes = cols / per * bsz;
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            m.row_f32(r, &mut row);
            assert_eq!(row, wf[r * cols..(r + 1) * cols], "{ty:?} row_f32 {r}");
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                let got = out[t * rows + r];
                let want = ggml_order(ty, &bytes[r * row_bytes..][..row_bytes], xt);
                assert_eq!(got.to_bits(), want.to_bits(), "{ty:?} r{r} t{t}: {got} vs {want}");
                let refv: f32 = (0..cols).map(|c| wf[r * cols + c] * xt[c]).sum();
                let mag: f32 = (0..cols).map(|c| (wf[r * cols + c] * xt[c]).abs()).sum();
                assert!(
                    (got - refv).abs() < 0.01 * mag + 1e-4,
                    "{ty:?} r{r} t{t}: {got} vs {refv}"
                );
            }
        }
        // Fusing along rows keeps every row.
        let m2 = QMatrix::concat_rows(&[&m, &m]).expect("same type fuses");
        m2.row_f32(rows + 2, &mut row);
        assert_eq!(row, wf[2 * cols..3 * cols]);
    }
}

#[test]
fn q8k_matches_ggml_reference_quantizer() {
    // Largest magnitude negative: iscale = -127 / max is positive.
    let mut x = vec![0f32; QK_K];
    for (i, v) in x.iter_mut().enumerate() {
        *v = (i as f32 - 100.0) * 0.01;
    }
    x[7] = -2.54;
    let a = Q8K::quantize(&x);
    assert_eq!(a.qs[7], -127);
    assert_eq!(a.d[0], 1.0 / (-127.0f32 / -2.54));
    // max = 127/64 makes iscale exactly -64: halves round to even.
    let mut y = vec![0f32; QK_K];
    y[0] = 127.0 / 64.0;
    y[1] = 1.0 / 128.0; // -0.5 -> 0
    y[2] = 3.0 / 128.0; // -1.5 -> -2
    y[3] = 5.0 / 128.0; // -2.5 -> -2
    let b = Q8K::quantize(&y);
    assert_eq!(&b.qs[..4], &[-127, 0, -2, -2]);
    assert_eq!(b.d[0], -1.0 / 64.0);
    assert_eq!(b.bsums[0], -127 - 4);
    assert!(Q8K::quantize(&[0.0; QK_K]).qs.iter().all(|&q| q == 0));
}

#[cfg(target_arch = "x86_64")]
#[test]
fn packed_scale_shuffle_equals_get_scale_min_k4() {
    let mut seed = 11;
    for _ in 0..2000 {
        let x: Vec<u8> = (0..12).map(|_| lcg(&mut seed) as u8).collect();
        let sm = super::super::rows_avx2::scales_mins_k4(&x);
        for j in 0..8 {
            assert_eq!((sm[j], sm[8 + j]), scale_min_k4(j, &x), "sub-block {j} of {x:?}");
        }
    }
}

/// The GPU decoder's sub-blocks (`k_sub_blocks`: a scale a 16, a min, 32
/// quants) give `dequantize_blocks`' values bit for bit, by `a · q − m`.
#[test]
fn k_sub_blocks_rebuild_the_reference_bit_for_bit() {
    let mut seed = 23;
    for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
        let bytes = random_blocks(ty, 5, &mut seed);
        let mut want = vec![0f32; 5 * QK_K];
        dequantize_blocks(ty, &bytes, &mut want);
        let subs = k_sub_blocks(ty, &bytes);
        assert_eq!(subs.len(), 5 * 8);
        let got: Vec<f32> = subs
            .iter()
            .flat_map(|s| (0..32).map(move |e| s.a[e / 16] * s.q[e] as f32 - s.m))
            .collect();
        let same = got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits());
        assert!(same, "{ty:?}");
        // Q6_K's two halves have their own scales; the others one.
        let split = subs.iter().any(|s| s.a[0] != s.a[1]);
        assert_eq!(split, ty == GgmlType::Q6_K, "{ty:?}");
    }
}
