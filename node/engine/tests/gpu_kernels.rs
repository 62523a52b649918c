//! The CubeCL kernels on wgpu (Mesa's lavapipe on a machine without a GPU),
//! each against the CPU engine's own op. `cargo test -p gcs-engine
//! --features wgpu --test gpu_kernels -- --nocapture` prints the measured
//! errors. Tolerances (relative to the scale of the values compared):
//! - quantized matmul: ≤ 1e-5 of Σ|w·x| against an f64 product of the
//!   engine's `quant::dequantize` (the CPU matmul itself is further off: it
//!   quantizes activations to 8 bits);
//! - embedding rows: ≤ 2.5e-7 relative of the CPU's; RoPE: ≤ 1e-6 of the
//!   row's largest value (the CPU's FMA contraction differs);
//! - RMSNorm (+ residual), SwiGLU: ≤ 1e-5 relative;
//! - paged attention: ≤ 1e-5 of an f64 reference, ≤ 2e-2 of the CPU pool's
//!   (which rounds Q, K, V and the probabilities to f16).
#![cfg(feature = "wgpu")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use cubecl::client::Client;
use cubecl::prelude::*;
use gcs_engine::attn::{AttnShape, PagedSeqRef};
use gcs_engine::backend::gpu::kernels::attention::HeadShape;
use gcs_engine::backend::gpu::kernels::basic;
use gcs_engine::backend::gpu::kernels::top::TOP_STRIDE;
use gcs_engine::backend::gpu::launch::{
    self, Attn, AttentionKernel, FusedRope, Input, MatmulKernel, RowMeta,
};
use gcs_engine::backend::gpu::weights::{GpuMatrix, GPU_WEIGHT_TYPES};
use gcs_engine::backend::gpu::DeviceBuf;
use gcs_engine::numerics::{rms_norm_rows, swiglu_rows};
use gcs_engine::quant::{dequantize, GgmlType, QActs, QMatrix};

mod common;
use common::gpu::{assert_acts_eq, AttnRig};
use common::rng::{gguf_blocks, Rng};

fn client() -> Client {
    cubecl::Device::Wgpu(Default::default()).client()
}

/// lavapipe's `fma` rounds twice: kernels with ggml's `expf` take the f64
/// stand-in (`wide_fma`).
const WIDE_FMA: bool = true;

/// A matrix of two parts, Q4_1 then Q8_0 (`rows` rows each), of 64
/// columns, and their GGUF bytes: stacked matrices write each part at its
/// row offset.
fn two_part_stack(rng: &mut Rng, rows: (usize, usize)) -> (QMatrix, Vec<u8>, Vec<u8>) {
    let (a, b) = (
        gguf_blocks(rng, GgmlType::Q4_1, rows.0, 64),
        gguf_blocks(rng, GgmlType::Q8_0, rows.1, 64),
    );
    let m = QMatrix::stack(vec![
        QMatrix::from_gguf(GgmlType::Q4_1, rows.0, 64, &a),
        QMatrix::from_gguf(GgmlType::Q8_0, rows.1, 64, &b),
    ])
    .unwrap();
    (m, a, b)
}

/// Every weight type the float matmul reads.
const ALL_TYPES: [GgmlType; 7] = GPU_WEIGHT_TYPES;

/// `shapes`, with widths rounded up to whole 256-element super-blocks for
/// a K-quant (576 becomes 768: 24 blocks of 32 against the 18 of 576).
fn shapes(ty: GgmlType, shapes: [(usize, usize); 2]) -> [(usize, usize); 2] {
    let (per, _) = ty.block_layout();
    shapes.map(|(r, c)| (r, c.next_multiple_of(per)))
}

fn max_rel(a: &[f32], b: &[f32], scale: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .zip(scale)
        .map(|((x, y), s)| (*x as f64 - *y as f64).abs() / s.max(1e-30))
        .fold(0.0, f64::max)
}

#[test]
fn add_and_sum_run() {
    let c = client();
    let n = 1000usize;
    let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..n).map(|i| 2.0 * i as f32).collect();
    let (ha, hb) = (DeviceBuf::upload(&c, &a), DeviceBuf::upload(&c, &b));
    let ho = DeviceBuf::<f32>::uninit(&c, n);
    let count = CubeCount::Static(n.div_ceil(256) as u32, 1, 1);
    basic::add_f32::launch(&c, count, CubeDim::new_1d(256), ha.arg(), hb.arg(), ho.arg());
    assert_eq!(ho.read(&c).unwrap()[999], 2997.0);
    let hs = DeviceBuf::<f32>::uninit(&c, 1);
    let one = CubeCount::Static(1, 1, 1);
    basic::sum_f32::launch(&c, one, CubeDim::new_1d(128), ha.arg(), hs.arg(), 128);
    assert_eq!(hs.read(&c).unwrap()[0], 499500.0);
}

/// GPU product, f64 reference from the dequantized weights, and Σ|w·x|.
fn check_matmul(c: &Client, m: &QMatrix, w: &[f32], n: usize, rng: &mut Rng) -> (f64, f64) {
    let x = rng.vec(n * m.cols);
    let g = GpuMatrix::upload(c, m).unwrap();
    let (hx, ho) = (DeviceBuf::upload(c, &x), DeviceBuf::<f32>::uninit(c, n * m.rows));
    launch::matmul(c, &g, &hx, n, &ho);
    let got = ho.read(c).unwrap();
    let mut cpu = vec![0f32; n * m.rows];
    m.matmul(&x, n, &mut cpu);
    let (mut want, mut scale) = (vec![0f32; n * m.rows], vec![0f64; n * m.rows]);
    for j in 0..n {
        for r in 0..m.rows {
            let (mut s, mut a) = (0f64, 0f64);
            for k in 0..m.cols {
                let p = w[r * m.cols + k] as f64 * x[j * m.cols + k] as f64;
                s += p;
                a += p.abs();
            }
            want[j * m.rows + r] = s as f32;
            scale[j * m.rows + r] = a;
        }
    }
    (max_rel(&got, &want, &scale), max_rel(&cpu, &want, &scale))
}

#[test]
fn quantized_matmul_matches_the_dequantized_weights() {
    let c = client();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for ty in ALL_TYPES {
        for (rows, cols) in shapes(ty, [(37, 96), (64, 576)]) {
            let bytes = gguf_blocks(&mut rng, ty, rows, cols);
            let m = QMatrix::from_gguf(ty, rows, cols, &bytes);
            let w = dequantize(ty, &bytes);
            for n in [1, 5, 8, 17, 64, 100] {
                let (gpu, cpu) = check_matmul(&c, &m, &w, n, &mut rng);
                eprintln!("{ty:?} [{rows}x{cols}] n={n}: gpu {gpu:.2e}, cpu {cpu:.2e} of Σ|w·x|");
                assert!(gpu <= 1e-5, "{ty:?} {rows}x{cols} n={n}: {gpu:e}");
            }
        }
    }
    // The K-quants' device forms: Q4_K as nibbles (24 bytes a 32-element
    // sub-block), Q5_K and Q6_K a byte a quant (44).
    use gcs_engine::backend::gpu::kernels::quant::WeightKind;
    for (ty, kind, bytes) in [
        (GgmlType::Q4_K, WeightKind::K4Sub, 24),
        (GgmlType::Q5_K, WeightKind::KSub, 44),
        (GgmlType::Q6_K, WeightKind::KSub, 44),
    ] {
        let m = QMatrix::from_gguf(ty, 4, 512, &gguf_blocks(&mut rng, ty, 4, 512));
        let g = GpuMatrix::upload(&c, &m).unwrap();
        assert_eq!((g.parts[0].kind, g.nbytes()), (kind, 4 * 512 / 32 * bytes), "{ty:?}");
    }
    // A stack of two types writes each part at its row offset.
    let (m, a, b) = two_part_stack(&mut rng, (24, 16));
    let mut w = dequantize(GgmlType::Q4_1, &a);
    w.extend(dequantize(GgmlType::Q8_0, &b));
    let (gpu, _) = check_matmul(&c, &m, &w, 3, &mut rng);
    assert!(gpu <= 1e-5, "stack: {gpu:e}");
    // Adjacent parts of one type (Q, K and V; gate and up) upload as one
    // part, one launch: Q4_1, Q4_1, Q8_0 is two.
    let a2 = gguf_blocks(&mut rng, GgmlType::Q4_1, 9, 64);
    let m3 = QMatrix::stack(vec![
        QMatrix::from_gguf(GgmlType::Q4_1, 24, 64, &a),
        QMatrix::from_gguf(GgmlType::Q4_1, 9, 64, &a2),
        QMatrix::from_gguf(GgmlType::Q8_0, 16, 64, &b),
    ])
    .unwrap();
    let rows: Vec<usize> =
        GpuMatrix::upload(&c, &m3).unwrap().parts.iter().map(|p| p.rows).collect();
    assert_eq!(rows, [33, 16]);
    let mut w = dequantize(GgmlType::Q4_1, &a);
    w.extend(dequantize(GgmlType::Q4_1, &a2));
    w.extend(dequantize(GgmlType::Q8_0, &b));
    for n in [2, 9] {
        let (gpu, _) = check_matmul(&c, &m3, &w, n, &mut rng);
        assert!(gpu <= 1e-5, "merged stack n={n}: {gpu:e}");
    }
}

/// The three matmul kernels (narrow, wide: 4 weight rows a unit and 1, 2,
/// 4 or 8 batch rows a cube, tiled: shared-memory tiles) give the same
/// bits for every type, row counts that
/// are no multiple of a cube's rows, rows of 48 and of 18 blocks (not a
/// multiple of the 4 lanes), batches that end inside a cube's batch rows,
/// and a two-part stack: a sequence's logits do not depend on the size of
/// the batch it ran in.
#[test]
fn the_matmul_kernels_agree_bit_for_bit() {
    let c = client();
    let mut rng = Rng(0x0dd_ba11);
    let run_in = |m: &GpuMatrix, x: &DeviceBuf<f32>, n: usize, k: MatmulKernel, i: Input<'_>| {
        let o = DeviceBuf::<f32>::uninit(&c, n * m.rows);
        launch::matmul_with(&c, m, x, i, n, &o, false, k);
        o.read(&c).unwrap()
    };
    let run =
        |m: &GpuMatrix, x: &DeviceBuf<f32>, n: usize, k: MatmulKernel| run_in(m, x, n, k, Input::Rows);
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
    for ty in ALL_TYPES {
        for (rows, cols) in shapes(ty, [(70, 1536), (45, 576)]) {
            let m = QMatrix::from_gguf(ty, rows, cols, &gguf_blocks(&mut rng, ty, rows, cols));
            let g = GpuMatrix::upload(&c, &m).unwrap();
            for n in [1, 2, 3, 9, 21, 64, 100] {
                let x = DeviceBuf::upload(&c, &rng.vec(n * cols));
                let narrow = run(&g, &x, n, MatmulKernel::Narrow);
                for k in [MatmulKernel::Wide, MatmulKernel::Tiled] {
                    assert!(same(&narrow, &run(&g, &x, n, k)), "{ty:?} {rows}x{cols} n={n} {k:?}");
                }
            }
        }
    }
    let (m, _, _) = two_part_stack(&mut rng, (24, 40));
    let g = GpuMatrix::upload(&c, &m).unwrap();
    let x = DeviceBuf::upload(&c, &rng.vec(13 * 64));
    let narrow = run(&g, &x, 13, MatmulKernel::Narrow);
    for k in [MatmulKernel::Wide, MatmulKernel::Tiled] {
        assert!(same(&narrow, &run(&g, &x, 13, k)), "stack {k:?}");
    }

    // The down projection's fused input: each kernel over `[gate | up]`
    // rows gives the bits it gives over the SwiGLU kernel's output.
    let (rows, inter) = (45, 576);
    let m = QMatrix::from_gguf(
        GgmlType::Q4_1,
        rows,
        inter,
        &gguf_blocks(&mut rng, GgmlType::Q4_1, rows, inter),
    );
    let g = GpuMatrix::upload(&c, &m).unwrap();
    for n in [1, 9, 70] {
        let gu: Vec<f32> = rng.vec(n * 2 * inter).iter().map(|v| v * 8.0).collect();
        let gu = DeviceBuf::upload(&c, &gu);
        let act = DeviceBuf::<f32>::uninit(&c, n * inter);
        launch::swiglu(&c, &gu, &act, inter, None);
        for k in MatmulKernel::ALL {
            let want = run(&g, &act, n, k);
            assert!(same(&want, &run_in(&g, &gu, n, k, Input::Glu)), "SwiGLU input n={n} {k:?}");
        }
        // The gate/up buffer itself as an input is not the same product
        // (the comparison can fail).
        assert!(!same(
            &run(&g, &act, n, MatmulKernel::Tiled),
            &run(&g, &gu, n, MatmulKernel::Tiled)
        ));
    }

    // The layer norms' fused input: each kernel over the residual rows
    // with `Input::Norm` gives the bits it gives over `rms_norm`'s output
    // (a cube norms its own rows in the one order of `ops::row_scales`),
    // for 1, 2 (the wide kernel's smaller cubes), 9 and 70 rows (the tiled
    // kernel's second tile of batch rows holds 6).
    for (rows, hid) in [(45, 576), (70, 1536)] {
        let m = QMatrix::from_gguf(
            GgmlType::Q4_1,
            rows,
            hid,
            &gguf_blocks(&mut rng, GgmlType::Q4_1, rows, hid),
        );
        let g = GpuMatrix::upload(&c, &m).unwrap();
        let nw = DeviceBuf::upload(&c, &rng.vec(hid));
        for n in [1, 2, 9, 70] {
            let x: Vec<f32> = rng.vec(n * hid).iter().map(|v| v * 30.0).collect();
            let x = DeviceBuf::upload(&c, &x);
            let h = DeviceBuf::<f32>::uninit(&c, n * hid);
            let all: Vec<u32> = (0..n as u32).collect();
            launch::rms_norm(&c, &x, &nw, &h, &DeviceBuf::upload(&c, &all), 1e-5);
            for k in MatmulKernel::ALL {
                let want = run(&g, &h, n, k);
                let got = run_in(&g, &x, n, k, Input::Norm(&nw, 1e-5));
                assert!(same(&want, &got), "normed input {rows}x{hid} n={n} {k:?}");
            }
            assert!(!same(
                &run(&g, &h, n, MatmulKernel::Wide),
                &run(&g, &x, n, MatmulKernel::Wide)
            ));
        }
    }

    // The residual: with `add` each kernel adds its products to what
    // `out` holds, one f32 add each (what the separate add did).
    let m = QMatrix::from_gguf(
        GgmlType::Q8_0,
        45,
        576,
        &gguf_blocks(&mut rng, GgmlType::Q8_0, 45, 576),
    );
    let g = GpuMatrix::upload(&c, &m).unwrap();
    for n in [1, 9, 70] {
        let x = DeviceBuf::upload(&c, &rng.vec(n * 576));
        let resid = rng.vec(n * 45);
        for k in MatmulKernel::ALL {
            let p = run(&g, &x, n, k);
            let o = DeviceBuf::upload(&c, &resid);
            launch::matmul_with(&c, &g, &x, Input::Rows, n, &o, true, k);
            let want: Vec<f32> = resid.iter().zip(&p).map(|(r, p)| r + p).collect();
            assert!(same(&o.read(&c).unwrap(), &want), "residual add n={n} {k:?}");
        }
    }
}

/// The CPU's matmul arithmetic on the GPU (`kernels::q8`): the inputs
/// quantized on the device equal `QActs::quantize` (scales, sums, bytes)
/// and the products of both kernels (`q8`, `q8_tiled`) equal
/// `QMatrix::matmul` bit for bit, for every type, 18- and 48-block rows,
/// rows and batches off the tile (45 and 70 rows, 70 inputs), a stack, a
/// block of zeros, exact ties of the rounding (k + ½ after scaling) and
/// scales in f16's subnormal range.
#[test]
fn the_q8_matmul_equals_the_cpu_matmul_bit_for_bit() {
    let c = client();
    let mut rng = Rng(0x5eed_0008);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let check = |m: &QMatrix, x: &[f32], n: usize, what: &str| {
        let g = GpuMatrix::upload(&c, m).unwrap();
        let hx = DeviceBuf::upload(&c, x);
        let acts = launch::QActs::new(&c, n * m.cols);
        launch::quantize_q8(&c, &hx, n, m.cols, &acts, None);
        assert_acts_eq(&c, &acts, &QActs::quantize(x, n, m.cols), what);
        let mut cpu = vec![0f32; n * m.rows];
        m.matmul(x, n, &mut cpu);
        for tiled in [false, true] {
            let o = DeviceBuf::<f32>::uninit(&c, n * m.rows);
            // lavapipe's `fma` rounds twice: the f64 stand-in (`wide_fma`).
            launch::matmul_q8_with(&c, &g, &acts, n, &o, true, tiled);
            assert_eq!(bits(&o.read(&c).unwrap()), bits(&cpu), "{what}: products, tiled {tiled}");
        }
    };
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        for (rows, cols) in [(45, 576), (70, 1536)] {
            let m = QMatrix::from_gguf(ty, rows, cols, &gguf_blocks(&mut rng, ty, rows, cols));
            for n in [1, 3, 17, 70] {
                let mut x = rng.vec(n * cols);
                x[..32].fill(0.0);
                // amax 127: the scale is 1 and k + ½ are ties (even: 2, −4, 0, 2).
                x[32..38].copy_from_slice(&[127.0, 2.5, -3.5, 0.5, 1.5, -0.5]);
                // amax 1e-4: d ≈ 7.9e-7, an f16 subnormal.
                for (i, v) in x[64..96].iter_mut().enumerate() {
                    *v = 1e-4 * ((i as f32) - 15.5) / 16.5;
                }
                check(&m, &x, n, &format!("{ty:?} {rows}x{cols} n={n}"));
            }
        }
    }
    let (m, _, _) = two_part_stack(&mut rng, (24, 40));
    check(&m, &rng.vec(5 * 64), 5, "stack");
}

/// RMSNorm in the CPU's arithmetic (`q8::add_rms_norm_exact`) equals
/// `numerics::rms_norm_rows` bit for bit, with the residual added first
/// and over a listed row without one; rows of wide dynamic range (tiny
/// and large values) so the f64 sum's order matters. Its quantized output
/// equals `QActs::quantize` of those rows.
#[test]
fn the_exact_rms_norm_equals_the_cpu_bit_for_bit() {
    let c = client();
    let mut rng = Rng(0x2_0f64);
    let (n, hid) = (5, 576);
    let mut x = rng.vec(n * hid);
    for (i, v) in x.iter_mut().enumerate() {
        *v *= [1e-4, 1.0, 37.0][i % 3];
    }
    let (d, w) = (rng.vec(n * hid), rng.vec(hid));
    let (hx, hd, hw) =
        (DeviceBuf::upload(&c, &x), DeviceBuf::upload(&c, &d), DeviceBuf::upload(&c, &w));
    let hh = DeviceBuf::<f32>::uninit(&c, n * hid);
    let acts = launch::QActs::new(&c, n * hid);
    let idx = DeviceBuf::upload(&c, &(0..n as u32).collect::<Vec<_>>());
    launch::add_rms_norm_q8(&c, &hx, Some(&hd), &hw, &hh, &idx, 1e-5, &acts);
    let sum: Vec<f32> = x.iter().zip(&d).map(|(a, b)| a + b).collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&hx.read(&c).unwrap()), bits(&sum), "x += delta is one f32 add");
    let mut want = sum.clone();
    rms_norm_rows(&mut want, &w, 1e-5);
    assert_eq!(bits(&hh.read(&c).unwrap()), bits(&want), "rows with the residual");
    assert_acts_eq(&c, &acts, &QActs::quantize(&want, n, hid), "quantized");
    let hl = DeviceBuf::<f32>::uninit(&c, hid);
    let last = DeviceBuf::upload(&c, &[3u32]);
    launch::add_rms_norm_q8(&c, &hx, None, &hw, &hl, &last, 1e-5, &acts);
    assert_eq!(bits(&hl.read(&c).unwrap()), bits(&want[3 * hid..4 * hid]), "row 3");
    let q3 = QActs::quantize(&want[3 * hid..4 * hid], 1, hid);
    assert_eq!(bits(&acts.d.read(&c).unwrap()[..hid / 32]), bits(&q3.d), "row 3 quantized");
}

/// Embedding rows: the float kernel within 2.5e-7, the exact one bit for bit.
#[test]
fn embedding_rows_match_the_cpu_rows() {
    let c = client();
    let mut rng = Rng(7);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        let (rows, cols) = (50, 576);
        let m = QMatrix::from_gguf(ty, rows, cols, &gguf_blocks(&mut rng, ty, rows, cols));
        let tokens = [3u32, 49, 0, 3, 17];
        let g = GpuMatrix::upload(&c, &m).unwrap();
        let (ht, hx) = (DeviceBuf::upload(&c, &tokens), DeviceBuf::<f32>::uninit(&c, 5 * cols));
        launch::embed(&c, &g, &ht, &hx, 1.0, None);
        let got = hx.read(&c).unwrap();
        let mut want = vec![0f32; 5 * cols];
        for (i, &t) in tokens.iter().enumerate() {
            m.row_f32(t as usize, &mut want[i * cols..(i + 1) * cols]);
        }
        let scale: Vec<f64> = want.iter().map(|v| (v.abs() as f64).max(1e-3)).collect();
        let e = max_rel(&got, &want, &scale);
        eprintln!("embed {ty:?}: {e:.2e}");
        assert!(e <= 2.5e-7, "{ty:?}: {e:e}");
        // In the CPU's arithmetic (`exact::embed_exact`, with the f64
        // `fma` of wgpu): the same bits.
        launch::embed(&c, &g, &ht, &hx, 1.0, Some(true));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&hx.read(&c).unwrap()), bits(&want), "{ty:?}, exact");
    }
}

#[test]
fn rms_norm_and_swiglu_match_the_cpu() {
    let c = client();
    let mut rng = Rng(11);
    let (n, hid, inter) = (6, 576, 1536);
    let (x, w) = (rng.vec(n * hid), rng.vec(hid));
    let (hx, hw) = (DeviceBuf::upload(&c, &x), DeviceBuf::upload(&c, &w));
    let hh = DeviceBuf::<f32>::uninit(&c, n * hid);
    let idx: Vec<u32> = (0..n as u32).collect();
    launch::rms_norm(&c, &hx, &hw, &hh, &DeviceBuf::upload(&c, &idx), 1e-5);
    let mut sum = x.clone();
    rms_norm_rows(&mut sum, &w, 1e-5);
    let got = hh.read(&c).unwrap();
    let scale: Vec<f64> = sum.iter().map(|v| (v.abs() as f64).max(1e-2)).collect();
    let e = max_rel(&got, &sum, &scale);
    eprintln!("rms_norm: {e:.2e}");
    assert!(e <= 1e-5, "rms_norm {e:e}");
    // Only the listed rows (the output norm).
    let hl = DeviceBuf::<f32>::uninit(&c, hid);
    launch::rms_norm(&c, &hx, &hw, &hl, &DeviceBuf::upload(&c, &[4u32]), 1e-5);
    let e = max_rel(&hl.read(&c).unwrap(), &sum[4 * hid..5 * hid], &scale[4 * hid..5 * hid]);
    assert!(e <= 1e-5, "row 4: {e:e}");

    let gu: Vec<f32> = rng.vec(n * 2 * inter).iter().map(|v| v * 8.0).collect();
    let (hg, ha) = (DeviceBuf::upload(&c, &gu), DeviceBuf::<f32>::uninit(&c, n * inter));
    launch::swiglu(&c, &hg, &ha, inter, None);
    let mut want = vec![0f32; n * inter];
    swiglu_rows(&gu, &mut want, inter);
    let scale: Vec<f64> = want.iter().map(|v| (v.abs() as f64).max(1e-3)).collect();
    let e = max_rel(&ha.read(&c).unwrap(), &want, &scale);
    eprintln!("swiglu: {e:.2e}");
    assert!(e <= 1e-5, "swiglu {e:e}");
}

/// gemma3's ops against the CPU's: the per-head Q/K norms (Q then
/// scaled, V untouched), the post-norm residual add, and GeGLU read by a
/// matmul against the matmul of the CPU's GeGLU rows (the f16 table).
#[test]
fn gemma_ops_match_the_cpu() {
    let c = client();
    let mut rng = Rng(29);
    let (n, hd, eps) = (3, 256, 1e-6);
    let sh = HeadShape { n_heads: 4, n_kv_heads: 1, head_dim: hd, neox: true };
    let width = sh.width();
    let qkv: Vec<f32> = rng.vec(n * width).iter().map(|v| v * 3.0).collect();
    let (qn, kn) = (rng.vec(hd), rng.vec(hd));
    let hq = DeviceBuf::upload(&c, &qkv);
    let (hqn, hkn) = (DeviceBuf::upload(&c, &qn), DeviceBuf::upload(&c, &kn));
    launch::head_norm(&c, sh, &hq, n, &hqn, &hkn, 0.0625, eps);
    let got = hq.read(&c).unwrap();
    let mut want = qkv.clone();
    for row in want.chunks_exact_mut(width) {
        let (q, rest) = row.split_at_mut(4 * hd);
        rms_norm_rows(q, &qn, eps);
        q.iter_mut().for_each(|v| *v *= 0.0625);
        rms_norm_rows(&mut rest[..hd], &kn, eps);
    }
    let scale: Vec<f64> = want.iter().map(|v| (v.abs() as f64).max(1e-2)).collect();
    let e = max_rel(&got, &want, &scale);
    eprintln!("head_norm: {e:.2e}");
    assert!(e <= 1e-5, "head_norm {e:e}");
    for r in 0..n {
        let v = r * width + 5 * hd..(r + 1) * width;
        assert_eq!(got[v.clone()], qkv[v], "V of row {r} untouched");
    }

    let hid = 640;
    let (x, d, w) = (rng.vec(n * hid), rng.vec(n * hid), rng.vec(hid));
    let (hx, hd_) = (DeviceBuf::upload(&c, &x), DeviceBuf::upload(&c, &d));
    launch::add_normed(&c, &hx, &hd_, &DeviceBuf::upload(&c, &w), n, eps);
    let mut normed = d.clone();
    rms_norm_rows(&mut normed, &w, eps);
    let want: Vec<f32> = x.iter().zip(&normed).map(|(a, b)| a + b).collect();
    let scale: Vec<f64> = want.iter().map(|v| (v.abs() as f64).max(1e-2)).collect();
    let e = max_rel(&hx.read(&c).unwrap(), &want, &scale);
    eprintln!("add_normed: {e:.2e}");
    assert!(e <= 1e-5, "add_normed {e:e}");

    // GeGLU as the down projection reads it, through an identity matrix
    // (Q8_0 blocks of scale 1 and one quant of 1: each output is one
    // product, exact), against the CPU's rows. Gate values past ±10 take
    // the table's ends (0, and g · u).
    let inter = 576;
    let mut ident = Vec::new();
    for r in 0..inter {
        for b in 0..inter / 32 {
            ident.extend(half::f16::from_f32(1.0).to_le_bytes());
            ident.extend((0..32).map(|e| u8::from(b * 32 + e == r)));
        }
    }
    let m = QMatrix::from_gguf(GgmlType::Q8_0, inter, inter, &ident);
    let g = GpuMatrix::upload(&c, &m).unwrap();
    let gu: Vec<f32> = rng.vec(n * 2 * inter).iter().map(|v| v * 12.0).collect();
    let mut want = vec![0f32; n * inter];
    gcs_engine::gemma3::geglu_rows(&gu, &mut want, inter);
    let hg = DeviceBuf::upload(&c, &gu);
    for k in MatmulKernel::ALL {
        let run = |input: Input<'_>| {
            let o = DeviceBuf::<f32>::uninit(&c, n * inter);
            launch::matmul_with(&c, &g, &hg, input, n, &o, false, k);
            o.read(&c).unwrap()
        };
        let got = run(Input::GeGlu);
        // The up value of output i (the tolerance scales with it).
        let up = |i: usize| gu[(i / inter) * 2 * inter + inter + i % inter].abs();
        let off: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
        let show: Vec<(f32, f32)> = off.iter().take(4).map(|&i| (got[i], want[i])).collect();
        eprintln!("GeGLU input {k:?}: {} of {} differ: {show:?}", off.len(), got.len());
        // Where the two differ: by one f16 step of the GELU, or where the
        // CPU's `1 + tanh` cancels (GELU values below 3e-7).
        for &i in &off {
            let (a, b) = (got[i], want[i]);
            assert!((a - b).abs() <= b.abs() * 1e-3 + 1e-6 * up(i), "{k:?} {i}: {a} against {b}");
        }
        assert!(off.len() * 10 <= got.len(), "{k:?}: {} differ", off.len());
        // SwiGLU's input is another function (the test can fail).
        let silu = run(Input::Glu);
        assert!(silu.iter().zip(&want).filter(|(a, b)| a != b).count() > got.len() / 2);
    }
    // The dense step's GeGLU and SwiGLU (`ops::glu` into f16): each value
    // the fused input's, rounded to f16 once (a zero's sign aside: the
    // identity's products add +0 to a −0).
    for (gelu, input) in [(true, Input::GeGlu), (false, Input::Glu)] {
        let o = DeviceBuf::<f32>::uninit(&c, n * inter);
        launch::matmul_with(&c, &g, &hg, input, n, &o, false, MatmulKernel::Wide);
        let act = DeviceBuf::<half::f16>::uninit(&c, n * inter);
        gcs_engine::backend::gpu::dense::glu_f16(&c, &hg, &act, inter, n, gelu);
        let want = o.read(&c).unwrap();
        let got = act.read(&c).unwrap();
        let off = (0..got.len()).filter(|&i| got[i] != half::f16::from_f32(want[i])).count();
        assert_eq!(off, 0, "glu into f16, gelu {gelu}");
        assert!(got.iter().any(|v| v.to_f32() != 0.0), "not all zero");
    }
}

/// One batch row of the attention test: sequence, position.
struct Seq {
    table: Vec<u32>,
    /// Raw q/k/v rows by position (before RoPE).
    hist: Vec<Vec<f32>>,
}

/// Exact attention of `q` (already rotated) over the keys and values
/// `kv[..=pos]` (each position's K then V, all KV heads), in f64.
fn reference(sh: AttnShape, kv: &[(Vec<f32>, Vec<f32>)], q: &[f32], pos: usize) -> Vec<f32> {
    let (nh, nkv, hd) = (sh.n_heads, sh.n_kv_heads, sh.head_dim);
    let mut out = vec![0f32; nh * hd];
    for h in 0..nh {
        let kvh = h / (nh / nkv);
        let s: Vec<f64> = kv[..=pos]
            .iter()
            .map(|(k, _)| {
                let dot: f64 = (0..hd).map(|d| q[h * hd + d] as f64 * k[kvh * hd + d] as f64).sum();
                dot / (hd as f64).sqrt()
            })
            .collect();
        let m = s.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
        let z: f64 = e.iter().sum();
        for d in 0..hd {
            let v: f64 = (0..=pos).map(|j| e[j] * kv[j].1[kvh * hd + d] as f64).sum();
            out[h * hd + d] = (v / z) as f32;
        }
    }
    out
}

/// Position `p`'s K and V (all KV heads) in the device's f16 pools `k`,
/// `v` of the layer at `off`, through the sequence's block `table`.
fn pooled(
    sh: HeadShape,
    (k, v): (&[half::f16], &[half::f16]),
    off: usize,
    table: &[u32],
    p: usize,
) -> (Vec<f32>, Vec<f32>) {
    let hd = sh.head_dim;
    let at = |kvh: usize, d: usize| {
        off + table[p / 16] as usize * sh.block_len() + (kvh * 16 + p % 16) * hd + d
    };
    let idx: Vec<usize> = (0..sh.n_kv_heads * hd).map(|i| at(i / hd, i % hd)).collect();
    (idx.iter().map(|&i| k[i].to_f32()).collect(), idx.iter().map(|&i| v[i].to_f32()).collect())
}

#[test]
fn paged_attention_matches_the_cpu_pool() {
    let c = client();
    let mut rng = Rng(5);
    let rig = AttnRig::new(&c, 256, 12);
    let (ash, sh, rope, layer, pool) = (rig.ash, rig.sh, &rig.rope, rig.layer, rig.pool());
    let (cos, sin) = (&rig.cos, &rig.sin);
    let mut cpu = rig.cpu_pool();
    let width = sh.width();
    let qd = 9 * 64;
    let mut seqs = vec![
        Seq { table: vec![5, 2], hist: vec![] },
        Seq { table: vec![7, 0, 3, 9], hist: vec![] },
    ];
    // Step 1 prefills 20 and 37 rows; steps 2 and 3 decode one row each.
    for step in [vec![20usize, 37], vec![1, 1], vec![1, 1]] {
        let mut qkv = Vec::new();
        let (mut pos, mut slot, mut table, mut tables, mut refs_meta) =
            (vec![], vec![], vec![], vec![], vec![]);
        for (s, &t) in seqs.iter_mut().zip(&step) {
            let past = s.hist.len();
            let toff = tables.len() as u32;
            tables.extend_from_slice(&s.table);
            for i in 0..t {
                let row: Vec<f32> = rng.vec(width).iter().map(|v| v * 3.0).collect();
                qkv.extend_from_slice(&row);
                s.hist.push(row);
                let p = past + i;
                pos.push(p as u32);
                slot.push(s.table[p / 16] * 16 + (p % 16) as u32);
                table.push(toff);
            }
            refs_meta.push((past, t));
        }
        let rows = pos.len();
        let meta = RowMeta {
            pos: DeviceBuf::upload(&c, &pos),
            slot: DeviceBuf::upload(&c, &slot),
            table: DeviceBuf::upload(&c, &table),
            tables: DeviceBuf::upload(&c, &tables),
            single: DeviceBuf::zeros(&c, rows),
        };
        let hq = DeviceBuf::upload(&c, &qkv);
        let ho = DeviceBuf::<f32>::uninit(&c, rows * qd);
        launch::rope_kv_store(&c, sh, &hq, pool, cos, sin, &meta, None);
        launch::paged_attention(&c, sh, &hq, pool, &ho, &meta, 1.0 / 8.0, 0, Attn::Float(None));
        let got = ho.read(&c).unwrap();
        let rotated = hq.read(&c).unwrap();
        let (kp, vp) = (rig.kp.read(&c).unwrap(), rig.vp.read(&c).unwrap());
        // The pools hold each position's rotated K and its V rounded to
        // f16: V exactly, K within one f16 step (a rotation one f32 ulp
        // apart can round to the neighbour).
        let mut kv: Vec<Vec<(Vec<f32>, Vec<f32>)>> = vec![];
        for s in &seqs {
            let at: Vec<_> =
                (0..s.hist.len()).map(|p| pooled(sh, (&kp, &vp), pool.off, &s.table, p)).collect();
            for (p, (k, v)) in at.iter().enumerate() {
                let mut want = s.hist[p][qd..qd + 3 * 64].to_vec();
                rope.apply(&mut want, p);
                for (g, w) in k.iter().zip(&want) {
                    let step = w.abs().max(6.2e-5) / 1024.0;
                    assert!((g - w).abs() <= step, "K at {p}: {g} for {w}");
                }
                let raw = &s.hist[p][qd + 3 * 64..qd + 6 * 64];
                let f16 = |x: &f32| half::f16::from_f32(*x).to_f32();
                assert_eq!(v, &raw.iter().map(f16).collect::<Vec<_>>(), "V at {p}");
            }
            kv.push(at);
        }

        let mut cq = qkv.clone();
        let mut cout = vec![0f32; rows * qd];
        let refs: Vec<PagedSeqRef<'_>> = seqs
            .iter()
            .zip(&refs_meta)
            .map(|(s, &(past, t))| PagedSeqRef { past, t, table: &s.table, decode_from: past + t })
            .collect();
        cpu.attend(layer, rope, &mut cq, &refs, &mut cout);

        let (mut e_ref, mut e_cpu, mut e_rope) = (0f64, 0f64, 0f64);
        let mut r = 0;
        for ((s, &(past, t)), kv) in seqs.iter().zip(&refs_meta).zip(&kv) {
            for i in 0..t {
                let mut q = s.hist[past + i][..qd].to_vec();
                rope.apply(&mut q, past + i);
                let gq = &rotated[r * width..r * width + qd];
                // Relative to the row's largest value: x0·c − x1·s cancels,
                // and the CPU contracts it into an FMA the GPU may not.
                let qs = vec![q.iter().fold(0f32, |a, v| a.max(v.abs())) as f64; qd];
                e_rope = e_rope.max(max_rel(gq, &q, &qs));
                let want = reference(ash, kv, &q, past + i);
                let g = &got[r * qd..(r + 1) * qd];
                let scale = vec![want.iter().fold(0f32, |a, v| a.max(v.abs())) as f64; qd];
                e_ref = e_ref.max(max_rel(g, &want, &scale));
                e_cpu = e_cpu.max(max_rel(g, &cout[r * qd..(r + 1) * qd], &scale));
                r += 1;
            }
        }
        eprintln!("attention step {step:?}: rope {e_rope:.2e}, vs f64 {e_ref:.2e}, vs CPU pool {e_cpu:.2e}");
        assert!(e_rope <= 1e-6, "rope {e_rope:e}");
        assert!(e_ref <= 1e-5, "attention vs f64 {e_ref:e}");
        assert!(e_cpu <= 2e-2, "attention vs CPU {e_cpu:e}");
    }

    // Copy-on-write: sequence 1's third block copied to block 11 gives the
    // same attention through a table pointing at the copy.
    launch::copy_block(&c, sh, &rig.kp, &rig.vp, 3, 11, common::gpu::N_LAYERS);
    let p = seqs[1].hist.len() - 1;
    let run = |tbl: &[u32]| {
        let meta = RowMeta {
            pos: DeviceBuf::upload(&c, &[p as u32]),
            slot: DeviceBuf::upload(&c, &[0u32]),
            table: DeviceBuf::upload(&c, &[0u32]),
            tables: DeviceBuf::upload(&c, tbl),
            single: DeviceBuf::zeros(&c, 1),
        };
        let hq = DeviceBuf::upload(&c, &vec![0.25f32; width]);
        let ho = DeviceBuf::<f32>::uninit(&c, qd);
        launch::paged_attention(&c, sh, &hq, pool, &ho, &meta, 1.0 / 8.0, 0, Attn::Float(None));
        ho.read(&c).unwrap()
    };
    let a = run(&[7, 0, 3, 9]);
    assert_eq!(a, run(&[7, 0, 11, 9]), "copied block");
    assert_ne!(a, run(&[7, 0, 10, 9]), "an unwritten block differs");
}

/// The device argmax picks the host's token: the largest value, the
/// lowest index among equal ones (rows of one value, a tie far apart, the
/// maximum at either end, all negative).
/// The two float attention kernels (a cube per query head; a cube per KV
/// head serving its 3 query heads) give the same bits: two sequences, one
/// of 300 positions (three chunks of keys), every row a prefill row, with
/// and without a sliding window.
#[test]
fn the_attention_kernels_agree_bit_for_bit() {
    let c = client();
    let mut rng = Rng(0x9_a77);
    let rig = AttnRig::new(&c, 512, 40);
    let (sh, pool) = (rig.sh, rig.pool());
    let tables: [Vec<u32>; 2] = [(0..19).rev().collect(), vec![30, 21, 25]];
    let lens = [300usize, 40];
    let (mut pos, mut slot, mut table, mut flat) = (vec![], vec![], vec![], vec![]);
    for (t, &len) in tables.iter().zip(&lens) {
        let toff = flat.len() as u32;
        flat.extend_from_slice(t);
        for p in 0..len {
            pos.push(p as u32);
            slot.push(t[p / 16] * 16 + (p % 16) as u32);
            table.push(toff);
        }
    }
    let rows = pos.len();
    let meta = RowMeta {
        pos: DeviceBuf::upload(&c, &pos),
        slot: DeviceBuf::upload(&c, &slot),
        table: DeviceBuf::upload(&c, &table),
        tables: DeviceBuf::upload(&c, &flat),
        single: DeviceBuf::zeros(&c, rows),
    };
    let qkv: Vec<f32> = rng.vec(rows * sh.width()).iter().map(|v| v * 3.0).collect();
    let hq = DeviceBuf::upload(&c, &qkv);
    launch::rope_kv_store(&c, sh, &hq, pool, &rig.cos, &rig.sin, &meta, None);
    assert_eq!(AttentionKernel::for_rows(rows, sh), AttentionKernel::KvHead);
    assert_eq!(AttentionKernel::for_rows(1, sh), AttentionKernel::Head);
    let run = |window: usize, k: AttentionKernel| {
        let o = DeviceBuf::<f32>::uninit(&c, rows * 9 * 64);
        launch::paged_attention_with(&c, sh, &hq, pool, &o, &meta, 0.125, window, Attn::Float(None), k);
        o.read(&c).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
    };
    for window in [0, 100] {
        let head = run(window, AttentionKernel::Head);
        assert_eq!(head, run(window, AttentionKernel::KvHead), "window {window}");
    }
    // The window changes the outputs (the comparison is not vacuous).
    assert_ne!(run(0, AttentionKernel::KvHead), run(100, AttentionKernel::KvHead));
    // Into f16 (the dense step's matmul input): each f32 output rounded
    // once, in both forms.
    for k in [AttentionKernel::Head, AttentionKernel::KvHead] {
        let o = DeviceBuf::<half::f16>::uninit(&c, rows * 9 * 64);
        launch::float_attention(&c, sh, &hq, pool, &o, &meta, 0.125, 0, None, k);
        let got: Vec<u16> = o.read(&c).unwrap().iter().map(|v| v.to_bits()).collect();
        let want: Vec<u16> =
            run(0, k).iter().map(|&b| half::f16::from_f32(f32::from_bits(b)).to_bits()).collect();
        assert!(got == want, "f16 outputs, {k:?}");
    }

    // A decode step (each row its sequence's only one): RoPE and the K/V
    // store inside the attention (`FusedRope`) give the outputs and the
    // pools of `rope_kv_store` then the attention, bit for bit, in both
    // forms. Rows: both sequences above, at their next position, and a new
    // sequence at position 0 (block 35).
    let decode = RowMeta {
        pos: DeviceBuf::upload(&c, &[300u32, 40, 0]),
        slot: DeviceBuf::upload(&c, &[tables[0][300 / 16] * 16 + 12, 25 * 16 + 8, 35 * 16]),
        table: DeviceBuf::upload(&c, &[0u32, 19, 22]),
        tables: DeviceBuf::upload(&c, &[flat.clone(), vec![35]].concat()),
        single: DeviceBuf::zeros(&c, 3),
    };
    let q3 = rng.vec(3 * sh.width());
    let (k0, v0) = (rig.kp.read(&c).unwrap(), rig.vp.read(&c).unwrap());
    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let wide = |v: Vec<half::f16>| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    let step = |rope: Option<FusedRope<'_>>, k: AttentionKernel| {
        // Each run from the same state (`rope_kv_store` rotates Q in place).
        let hq = DeviceBuf::upload(&c, &q3);
        rig.kp.write(&c, &k0);
        rig.vp.write(&c, &v0);
        if rope.is_none() {
            launch::rope_kv_store(&c, sh, &hq, pool, &rig.cos, &rig.sin, &decode, None);
        }
        let o = DeviceBuf::<f32>::uninit(&c, 3 * 9 * 64);
        launch::paged_attention_with(&c, sh, &hq, pool, &o, &decode, 0.125, 0, Attn::Float(rope), k);
        let (kp, vp) = (wide(rig.kp.read(&c).unwrap()), wide(rig.vp.read(&c).unwrap()));
        [o.read(&c).unwrap(), kp, vp].map(bits)
    };
    let apart = step(None, AttentionKernel::Head);
    assert_ne!(apart[1], bits(wide(k0.clone())), "the step stores its rows' keys");
    let rope = FusedRope { cos: &rig.cos, sin: &rig.sin };
    for k in [AttentionKernel::Head, AttentionKernel::KvHead] {
        let fused = step(Some(rope), k);
        for (what, (a, b)) in ["outputs", "K pool", "V pool"].iter().zip(apart.iter().zip(&fused)) {
            assert!(a == b, "fused RoPE, {k:?}: {what}");
        }
    }
}

/// The bias and penalty additions (`launch::adjust_rows`) against the
/// host adding them one after another: rows of 5,000 logits with up to
/// 700 additions each (past the cube's 64 units), runs of one id up to 9
/// long straddling the units' strides, ids at both ends of the row, a row
/// with none, and values whose sum depends on the order (1e8 then ±1);
/// grammar masks on two rows (every token they do not allow −inf, their
/// additions to those left −inf): every logit bit for bit; the rows past
/// `off`'s end untouched. Each addition's token's logit before them comes
/// back, and the rows scored (a sequence with logprobs beside additions)
/// get the candidates of their masked rows before the additions.
#[test]
fn adjust_rows_masks_then_adds_each_ids_run_in_order() {
    use gcs_engine::backend::Adjust;
    let c = client();
    let mut rng = Rng(0xad_1057);
    let (rows, vocab) = (5, 5000);
    let l = rng.vec(rows * vocab);
    let mut per_seq: Vec<Vec<(u32, f32)>> = vec![];
    for r in 0..rows - 1 {
        let mut adds = vec![];
        let n = [700, 0, 65, 300][r];
        while adds.len() < n {
            let id = (rng.next() % vocab as u64) as u32;
            let id = [0, vocab as u32 - 1, id][(rng.next() % 3) as usize];
            for _ in 0..1 + rng.next() % 9 {
                let a = [1e8, -1e8, 1.0, -100.0, rng.f() * 3.0][(rng.next() % 5) as usize];
                adds.push((id, a));
            }
        }
        per_seq.push(adds);
    }
    // Grammar masks on rows 0 and 3: about half the tokens, then only a
    // few (shorter than the row: the tokens past it are not allowed).
    let words = |keep: u64, n: usize, rng: &mut Rng| -> Vec<u32> {
        (0..n)
            .map(|_| (0..32).fold(0u32, |w, b| w | u32::from(rng.next().is_multiple_of(keep)) << b))
            .collect()
    };
    let half = words(2, vocab.div_ceil(32), &mut rng);
    let few = words(40, 100, &mut rng);
    let masks = [Some(&half[..]), None, None, Some(&few[..])];
    let adjust = Adjust::new(per_seq.iter().map(Vec::as_slice)).with_masks(masks);
    // Offsets for the first rows − 1 rows: the launch covers only them.
    let ends = |f: &dyn Fn(usize) -> std::ops::Range<usize>| -> Vec<u32> {
        std::iter::once(0).chain((0..rows - 1).map(|r| f(r).end as u32)).collect()
    };
    let nan = f32::NAN;
    let bufs = launch::AdjustBufs {
        off: DeviceBuf::upload(&c, &ends(&|r| adjust.range(r))),
        ids: DeviceBuf::upload(&c, adjust.ids()),
        adds: DeviceBuf::upload(&c, adjust.adds()),
        raw: DeviceBuf::upload(&c, &vec![nan; adjust.ids().len()]),
        mask_off: DeviceBuf::upload(&c, &ends(&|r| adjust.mask_range(r))),
        words: DeviceBuf::upload(&c, adjust.mask_words()),
        scored: DeviceBuf::upload(&c, &vec![nan; rows * TOP_STRIDE]),
    };
    // Rows 0 to 2 scored (sequences with logprobs), row 3 not.
    let pick: Vec<f32> = (0..rows).flat_map(|r| [0.0, 0.0, 0.0, f32::from(r < 3)]).collect();
    let logits = DeviceBuf::upload(&c, &l);
    launch::adjust_rows(&c, &logits, &bufs, &DeviceBuf::upload(&c, &pick), vocab, WIDE_FMA);
    // The host's order: masked tokens −inf, then every addition in turn.
    let mut masked = l.clone();
    for (r, m) in masks.iter().enumerate() {
        let Some(m) = m else { continue };
        for (t, x) in masked[r * vocab..(r + 1) * vocab].iter_mut().enumerate() {
            if !gcs_engine::constraint::word_allows(m, t as u32) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    let mut want = masked.clone();
    for (r, adds) in per_seq.iter().enumerate() {
        let row = &mut want[r * vocab..(r + 1) * vocab];
        adds.iter().for_each(|&(id, a)| row[id as usize] += a);
    }
    let inf =
        |r: usize| want[r * vocab..(r + 1) * vocab].iter().filter(|x| x.is_infinite()).count();
    assert!(inf(0) > vocab / 3 && inf(0) < 2 * vocab / 3 && inf(3) > vocab - 200, "{}", inf(3));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&logits.read(&c).unwrap()), bits(&want));
    // Not vacuous: each run added in reverse gives other bits somewhere
    // (1e8 + 1 − 1e8 is not 1 − 1e8 + 1e8).
    let mut reversed = l.clone();
    for (r, adds) in per_seq.iter().enumerate() {
        for run in adds.chunk_by(|a, b| a.0 == b.0) {
            run.iter().rev().for_each(|&(id, a)| reversed[r * vocab + id as usize] += a);
        }
    }
    assert_ne!(bits(&reversed), bits(&want));
    assert_eq!(&want[(rows - 1) * vocab..], &l[(rows - 1) * vocab..], "the last row has no range");
    // Each addition's token's logit before the additions (masked: −inf).
    let raw = bufs.raw.read(&c).unwrap();
    for r in 0..rows - 1 {
        let ids = &adjust.ids()[adjust.range(r)];
        let want: Vec<f32> = ids.iter().map(|&id| masked[r * vocab + id as usize]).collect();
        assert_eq!(bits(&raw[adjust.range(r)]), bits(&want), "row {r}: the logits before");
    }
    assert!(raw.iter().any(|x| x.is_infinite()) && raw.iter().any(|x| x.is_finite()));
    // A scored row's candidates are those of its masked row before the
    // additions (bit for bit; its mass at 1 within rounding), a row not
    // scored gets none.
    let scored = bufs.scored.read(&c).unwrap();
    for r in 0..3 {
        let after = gcs_engine::sampling::top_candidates(&want[r * vocab..(r + 1) * vocab], 0.0);
        let host = &masked[r * vocab..(r + 1) * vocab];
        let g = &scored[r * TOP_STRIDE..(r + 1) * TOP_STRIDE];
        let want = gcs_engine::sampling::top_candidates(host, 0.0);
        let k = want.cand.len();
        let cand: Vec<(u32, u32)> = (0..k).map(|i| (g[i] as u32, g[k + i].to_bits())).collect();
        let want_cand: Vec<(u32, u32)> = want.cand.iter().map(|&(i, v)| (i, v.to_bits())).collect();
        assert_eq!(cand, want_cand, "row {r}: scored before the additions");
        let ok = common::gpu::mass_is_exact(g[2 * k + 1], host, 1.0);
        assert!(ok && g[2 * k] == 0.0, "row {r}: unit mass {}, mass {}", g[2 * k + 1], g[2 * k]);
        // Not vacuous: rows 0 and 2 have additions that change them.
        assert!(r == 1 || after.cand != want.cand, "row {r}: the additions change it");
    }
    assert!(scored[3 * TOP_STRIDE..4 * TOP_STRIDE].iter().all(|x| x.is_nan()), "row 3 not scored");
}

/// Rows of 1,000 and of 5,000 logits (each unit's first eight-load groups
/// and its tail: ties across both), picked at temperature 0.
#[test]
fn pick_rows_at_temperature_0_is_the_host_argmax_with_ties() {
    use gcs_engine::sampling::argmax;
    let c = client();
    let mut rng = Rng(0x5eed_1234);
    for vocab in [1000, 5000] {
        let rows = 6;
        let mut l = rng.vec(rows * vocab);
        l[vocab..2 * vocab].fill(0.25);
        l[2 * vocab + vocab - 500] = 5.0;
        l[2 * vocab + 700] = 5.0;
        l[2 * vocab + 300] = 5.0;
        l[3 * vocab + vocab - 1] = 9.0;
        l[4 * vocab..5 * vocab].iter_mut().for_each(|v| *v = -2.0 - v.abs());
        l[4 * vocab] = -0.5;
        let logits = DeviceBuf::upload(&c, &l);
        let out = launch::Picked::new(&c, rows);
        let greedy = DeviceBuf::upload(&c, &vec![0.0f32; 4 * rows]);
        launch::pick_rows(&c, &logits, &greedy, &out, vocab, WIDE_FMA);
        let got = out.ids.read(&c).unwrap();
        let want: Vec<u32> = l.chunks(vocab).map(argmax).collect();
        assert_eq!(got, want, "vocab {vocab}");
        assert_eq!(&want[1..5], &[0, 300, vocab as u32 - 1, 0]);
        // Each picked token's logit beside it.
        let logit: Vec<f32> =
            want.iter().enumerate().map(|(r, &t)| l[r * vocab + t as usize]).collect();
        assert_eq!(out.chosen.read(&c).unwrap(), logit, "vocab {vocab}");
    }
}

/// Temperature draws on the device against the host's
/// `draw_temperature` at the same uniforms: rows of 1,000, 5,000 and
/// 49,152 logits (SmolLM2's vocabulary), and 49,152 with a long tail,
/// temperatures from 0.3 to 1.5, greedy rows in the same launch. Both
/// group their running sums by the same ranges of ids and weigh each
/// logit by ggml's `expf` (IEEE operations only), so every draw is the
/// host's; u = 0 draws the first token. Dropping the temperature from the
/// kernel's weights, or choosing the range after the one the draw falls
/// in, makes it fail. (lavapipe's own `exp` drew these 80 tokens too; the
/// masses below are what tell its bits from ggml's.)
#[test]
fn pick_rows_draws_as_the_host_at_the_same_uniforms() {
    use gcs_engine::sampling::{argmax, draw_temperature};
    let c = client();
    let mut rng = Rng(0x0d2a_3b11);
    let (mut same, mut all) = (0, 0);
    // Rows shaped like a model's too: 16 ids first that hold most of the
    // mass, then a long tail of small weights that draws at u near 1 land
    // in, where one running sum over the row rounds far from the grouped
    // sums (they drew tokens tens of ids apart).
    for (vocab, tail) in [(1000usize, false), (5000, false), (49_152, false), (49_152, true)] {
        let rows = 24;
        let l: Vec<f32> = (0..rows * vocab)
            .map(|i| match (tail, i % vocab < 16) {
                (false, _) => rng.f() * 6.0,
                (true, true) => rng.f() * 0.5,
                (true, false) => rng.f() - 12.0,
            })
            .collect();
        let mut pick = vec![];
        for r in 0..rows {
            let t = [0.3f32, 0.7, 1.0, 1.5][r % 4];
            // Every sixth row greedy; row 1 draws at u = 0.
            let u = match (r, tail) {
                (1, _) => 0.0,
                (_, false) => (rng.f() + 1.0) / 2.0,
                (_, true) => 0.97 + 0.015 * (rng.f() + 1.0),
            };
            pick.extend(if r % 6 == 5 { [0.0, u, 0.0, 0.0] } else { [t, u, 0.0, 0.0] });
        }
        let logits = DeviceBuf::upload(&c, &l);
        let out = launch::Picked::new(&c, rows);
        launch::pick_rows(&c, &logits, &DeviceBuf::upload(&c, &pick), &out, vocab, WIDE_FMA);
        let (got, logit) = (out.ids.read(&c).unwrap(), out.chosen.read(&c).unwrap());
        for (r, row) in l.chunks(vocab).enumerate() {
            assert_eq!(logit[r], row[got[r] as usize], "vocab {vocab} row {r}: the drawn logit");
            let (t, u) = (pick[4 * r], pick[4 * r + 1]);
            if t == 0.0 {
                assert_eq!(got[r], argmax(row), "vocab {vocab} row {r}: greedy");
                continue;
            }
            all += 1;
            same += usize::from(got[r] == draw_temperature(row, t, u));
        }
        assert_eq!(got[1], 0, "u = 0 draws the first token");
    }
    eprintln!("{same} of {all} draws equal the host's");
    assert_eq!(same, all, "{same} of {all} draws equal the host's");
    // A low temperature draws the best token whatever the uniform; a
    // high one spreads over many.
    let vocab = 5000;
    let mut row = rng.vec(vocab);
    row[1234] = 3.0;
    let rows = 64;
    let l = row.repeat(rows);
    let mut pick = vec![];
    for r in 0..rows {
        let t = if r < rows / 2 { 0.01 } else { 50.0 };
        pick.extend([t, (r % 32) as f32 / 32.0 + 0.01, 0.0, 0.0]);
    }
    let out = launch::Picked::new(&c, rows);
    let (logits, pick) = (DeviceBuf::upload(&c, &l), DeviceBuf::upload(&c, &pick));
    launch::pick_rows(&c, &logits, &pick, &out, vocab, WIDE_FMA);
    let got = out.ids.read(&c).unwrap();
    assert!(got[..rows / 2].iter().all(|&t| t == 1234), "{got:?}");
    let spread: std::collections::HashSet<_> = got[rows / 2..].iter().collect();
    assert!(spread.len() > 25, "{spread:?}");
}

/// The best candidates of top-k / top-p / min-p rows, selected on the
/// device, against the host's `top_candidates`: the same ids in the same
/// order with the same logits (bit for bit), and the mass the host's bit
/// for bit (ggml's `expf` on both sides, summed alike: with lavapipe's
/// `exp` for the device's weights this fails). Rows of random logits, of few distinct
/// values (ties across the cut: the select's id passes), all equal (the
/// lowest ids), with -0.0 beside 0.0 and -inf (`total_cmp`'s order), over
/// vocabularies smaller and larger than the candidates; the logprobs'
/// normaliser (the mass at temperature 1) too, and both within rounding
/// of their exact values. A greedy row and a drawing row selecting candidates too (a
/// sequence with logprobs) keep their argmax and their draw, and a row
/// without candidates in the same launch its argmax.
#[test]
fn pick_rows_selects_the_host_top_candidates() {
    use gcs_engine::sampling::{argmax, draw_temperature, top_candidates, TOP_CANDIDATES};
    let c = client();
    let mut rng = Rng(0x7095_e1ec);
    for vocab in [100usize, 1000, 5000, 49_152] {
        let rows = 6;
        let mut l: Vec<f32> = rng.vec(rows * vocab).iter().map(|v| v * 6.0).collect();
        let row = |r: usize| r * vocab..(r + 1) * vocab;
        l[row(1)].iter_mut().for_each(|v| *v = (*v * 2.0).round() / 4.0);
        l[row(2)].fill(0.25);
        l[row(3)].iter_mut().enumerate().for_each(|(i, v)| {
            *v = [-0.0, 0.0, -v.abs(), f32::NEG_INFINITY][i % 4];
        });
        l[row(4)].iter_mut().step_by(2).for_each(|v| *v = f32::NEG_INFINITY);
        let rows = 8;
        l.extend(rng.vec(2 * vocab).iter().map(|v| v * 6.0));
        // [temperature, uniform, candidates, _] a row: the last two a
        // greedy and a drawing row with candidates, then a greedy row
        // without.
        let picks = [[0.7f32, -1.0, 1.0], [1.0, -1.0, 1.0], [1.3, -1.0, 1.0], [0.5, -1.0, 1.0]];
        let picks =
            [&picks[..], &[[1.0, -1.0, 1.0], [0.0, 0.0, 1.0], [1.0, 0.3, 1.0], [0.0; 3]]].concat();
        let pick: Vec<f32> = picks.iter().flat_map(|p| [p[0], p[1], p[2], 0.0]).collect();
        let (logits, out) = (DeviceBuf::upload(&c, &l), launch::Picked::new(&c, rows));
        launch::pick_rows(&c, &logits, &DeviceBuf::upload(&c, &pick), &out, vocab, WIDE_FMA);
        let (got_ids, got) = (out.ids.read(&c).unwrap(), out.top.read(&c).unwrap());
        for (r, &[t, u, sel]) in picks.iter().enumerate() {
            let host = &l[row(r)];
            let token =
                if u >= 0.0 && t > 0.0 { draw_temperature(host, t, u) } else { argmax(host) };
            assert_eq!(got_ids[r], token, "vocab {vocab} row {r}: the token");
            if sel == 0.0 {
                continue;
            }
            let want = top_candidates(host, t);
            let g = &got[r * TOP_STRIDE..(r + 1) * TOP_STRIDE];
            let k = vocab.min(TOP_CANDIDATES);
            let cand: Vec<(u32, u32)> =
                (0..k).map(|i| (g[i] as u32, g[TOP_CANDIDATES + i].to_bits())).collect();
            let want_cand: Vec<(u32, u32)> =
                want.cand.iter().map(|&(i, v)| (i, v.to_bits())).collect();
            assert_eq!(cand, want_cand, "vocab {vocab} row {r}");
            let (mass, unit) = (g[2 * TOP_CANDIDATES], g[2 * TOP_CANDIDATES + 1]);
            if t > 0.0 {
                let ok = common::gpu::mass_is_exact(mass, host, t);
                assert!(ok, "vocab {vocab} row {r}: mass {mass}, host {}", want.mass);
                assert_eq!(mass.to_bits(), want.mass.to_bits(), "vocab {vocab} row {r}: mass");
            }
            let ok = common::gpu::mass_is_exact(unit, host, 1.0);
            assert!(ok, "vocab {vocab} row {r}: unit mass {unit}, host {}", want.unit_mass);
            let host_unit = want.unit_mass as f32;
            assert_eq!(unit.to_bits(), host_unit.to_bits(), "vocab {vocab} row {r}: unit mass");
        }
    }
}
