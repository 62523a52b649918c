//! Quantized kernels against a naive dequantize-then-f32 reference.

use half::f16;

use super::kernels::{dot_group, dot_group_multi, scalar_dot_group, ActBlock};
use super::*;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
}

fn make_blocks(ty: GgmlType, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
    let nb = rows * cols / QK;
    let mut out = Vec::new();
    for _ in 0..nb {
        let d = f16::from_f32(lcg(seed).abs() * 0.05 + 0.001).to_bits().to_le_bytes();
        out.extend_from_slice(&d);
        match ty {
            GgmlType::Q4_1 => {
                out.extend_from_slice(&f16::from_f32(lcg(seed) * 0.3).to_bits().to_le_bytes());
                out.extend((0..16).map(|_| ((lcg(seed) + 1.0) * 127.9) as u8));
            }
            GgmlType::Q4_0 => out.extend((0..16).map(|_| ((lcg(seed) + 1.0) * 127.9) as u8)),
            GgmlType::Q8_0 => out.extend((0..32).map(|_| (lcg(seed) * 127.0) as i8 as u8)),
            _ => unreachable!(),
        }
    }
    out
}

fn check(ty: GgmlType) {
    // 37 rows: exercises a partial (padded) group.
    let (rows, cols, n) = (37, 256, 3);
    let mut seed = 7u64;
    let bytes = make_blocks(ty, rows, cols, &mut seed);
    let w = QMatrix::from_gguf(ty, rows, cols, &bytes);
    let wf = dequantize(ty, &bytes);
    let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed)).collect();
    // SIMD and scalar paths are bit-identical.
    let QData::Quant { kind, d, m, qs } = &w.data else { unreachable!() };
    let a = QActs::quantize(&x, n, cols);
    let nb = cols / QK;
    let act = ActBlock { d: &a.d[..nb], s: &a.s[..nb], sum_q: &a.sum_q[..nb], qs: &a.qs[..cols] };
    let qb = if *kind == QKind::Q8_0 { 32 } else { 16 };
    for g in 0..rows.div_ceil(GROUP) {
        let k0 = g * nb * GROUP;
        let gm = if m.is_empty() { &m[..] } else { &m[k0..k0 + nb * GROUP] };
        let fast = dot_group(
            *kind,
            &d[k0..k0 + nb * GROUP],
            gm,
            &qs[k0 * qb..(k0 + nb * GROUP) * qb],
            &act,
        );
        let slow = scalar_dot_group(
            *kind,
            &d[k0..k0 + nb * GROUP],
            gm,
            &qs[k0 * qb..(k0 + nb * GROUP) * qb],
            &act,
        );
        assert_eq!(fast, slow, "{ty:?} group {g}");
        // The multi-row (prefill) kernel gives the same per-row results.
        let rows: Vec<ActBlock<'_>> = (0..n)
            .map(|t| ActBlock {
                d: &a.d[t * nb..][..nb],
                s: &a.s[t * nb..][..nb],
                sum_q: &a.sum_q[t * nb..][..nb],
                qs: &a.qs[t * cols..][..cols],
            })
            .collect();
        let mut multi = vec![0f32; n * GROUP];
        dot_group_multi(
            *kind,
            &d[k0..k0 + nb * GROUP],
            gm,
            &qs[k0 * qb..(k0 + nb * GROUP) * qb],
            &rows,
            &mut multi,
        );
        for (t, r) in rows.iter().enumerate() {
            let single = dot_group(
                *kind,
                &d[k0..k0 + nb * GROUP],
                gm,
                &qs[k0 * qb..(k0 + nb * GROUP) * qb],
                r,
            );
            assert_eq!(&multi[t * GROUP..(t + 1) * GROUP], &single[..], "{ty:?} multi row {t}");
        }
    }
    let mut out = vec![0f32; n * rows];
    w.matmul(&x, n, &mut out);
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        w.row_f32(r, &mut row);
        assert_eq!(row, wf[r * cols..(r + 1) * cols], "row_f32 {ty:?}");
        for t in 0..n {
            let refv: f32 = (0..cols).map(|c| wf[r * cols + c] * x[t * cols + c]).sum();
            let mag: f32 = (0..cols).map(|c| (wf[r * cols + c] * x[t * cols + c]).abs()).sum();
            let got = out[t * rows + r];
            // Error comes only from 8-bit activation quantization: at most
            // half a step (1/254 of the block max) per element.
            let tol = 0.01 * mag + 1e-4;
            assert!((got - refv).abs() < tol, "{ty:?} r{r} t{t}: {got} vs {refv}");
        }
    }
}

#[test]
fn q4_1_matches_reference() {
    check(GgmlType::Q4_1);
}

#[test]
fn q4_0_matches_reference() {
    check(GgmlType::Q4_0);
}

#[test]
fn q8_0_matches_reference() {
    check(GgmlType::Q8_0);
}

#[test]
fn concat_keeps_rows() {
    let mut seed = 3u64;
    let (a, b) = (
        make_blocks(GgmlType::Q4_1, 16, 64, &mut seed),
        make_blocks(GgmlType::Q4_1, 8, 64, &mut seed),
    );
    let (ma, mb) = (
        QMatrix::from_gguf(GgmlType::Q4_1, 16, 64, &a),
        QMatrix::from_gguf(GgmlType::Q4_1, 8, 64, &b),
    );
    let c = QMatrix::concat_rows(&[&ma, &mb]).unwrap();
    let (mut r1, mut r2) = (vec![0f32; 64], vec![0f32; 64]);
    for r in 0..24 {
        c.row_f32(r, &mut r1);
        if r < 16 {
            ma.row_f32(r, &mut r2)
        } else {
            mb.row_f32(r - 16, &mut r2)
        }
        assert_eq!(r1, r2);
    }
}
