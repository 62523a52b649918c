//! cubek's matmul over f16 copies of the weights (`backend::gpu::dense`),
//! which the device check times beside the quantized kernels: on wgpu
//! (lavapipe here) each routine the device runs multiplies by the
//! transposed weights, and one it cannot run says so instead of answering.
//! `cargo test -p gcs-engine --features wgpu --test gpu_dense -- --nocapture`.
#![cfg(feature = "wgpu")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gcs_engine::backend::gpu::dense::{self, DenseMatrix};
use gcs_engine::backend::gpu::DeviceBuf;
use half::f16;

mod common;
use common::rng::Rng;

#[test]
fn dense_matmul_multiplies_by_the_transposed_weights() {
    let c = cubecl::Device::Wgpu(Default::default()).client();
    let mut rng = Rng(0x5eed_0017);
    // SmolLM2's hidden width; an output count off every tile size.
    let (rows, cols) = (200, 576);
    let w: Vec<f32> = rng.vec(rows * cols);
    let m = DenseMatrix::upload(&c, &w, rows, cols);
    let mut ran = vec![];
    for n in [1, 3, 17] {
        let x: Vec<f16> = rng.vec(n * cols).into_iter().map(f16::from_f32).collect();
        let xd = DeviceBuf::upload(&c, &x);
        for (name, routine) in dense::routines() {
            // A marker the product must overwrite.
            let out = DeviceBuf::upload(&c, &vec![f32::NAN; n * rows]);
            if let Err(e) = dense::matmul(&c, &routine, &m, &xd, n, &out) {
                println!("{name} at {n} rows: not run ({e})");
                continue;
            }
            let got = out.read(&c).unwrap();
            let mut worst = 0f64;
            for i in 0..n {
                for r in 0..rows {
                    // f64 over the f16 values both sides multiply.
                    let (mut want, mut scale) = (0f64, 0f64);
                    for k in 0..cols {
                        let p = f64::from(x[i * cols + k].to_f32())
                            * f64::from(f16::from_f32(w[r * cols + k]).to_f32());
                        want += p;
                        scale += p.abs();
                    }
                    let g = f64::from(got[i * rows + r]);
                    worst = worst.max((g - want).abs() / scale);
                }
            }
            println!("{name} at {n} rows: max error {worst:.2e} of Σ|w·x|");
            // f16 inputs exact in f32 products; only the f32 sums round.
            assert!(worst < 1e-5, "{name} at {n} rows: error {worst:.2e}");
            ran.push((name, n));
        }
    }
    // The unit routine runs on every device.
    assert!(ran.iter().filter(|(name, _)| *name == "unit").count() == 3, "{ran:?}");
    // Too few input values for the rows asked: refused, not read past.
    let short = DeviceBuf::upload(&c, &[f16::ZERO; 10]);
    let out = DeviceBuf::<f32>::zeros(&c, rows);
    let (_, unit) = dense::routines().into_iter().find(|(n, _)| *n == "unit").unwrap();
    assert!(dense::matmul(&c, &unit, &m, &short, 1, &out).is_err());
}

/// The device check's part (`devcheck::dense`) on the real SmolLM2: the
/// decoder's quantized kernel and each dense routine the device runs, at
/// one row and at the tiled kernel's batches, each dense product within
/// f16 rounding of the quantized one; a routine it cannot run named.
#[test]
fn the_device_checks_dense_part_times_both_on_the_real_model() {
    use gcs_engine::backend::ComputeDevice;
    use gcs_engine::{cpu_device, devcheck, Engine};
    let Some(path) = common::smollm_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let figs = devcheck::dense::run(&engine, ComputeDevice::Wgpu(0), &[1, 9]);
    for f in &figs {
        println!("{f:?}");
    }
    for op in ["gate_up", "lm_head"] {
        for rows in [1, 9] {
            let of = |k: &str| figs.iter().find(|f| f.op == op && f.rows == rows && f.kernel == k);
            let kernel = if rows < 8 { "quantized (Wide)" } else { "quantized (Tiled)" };
            let q = of(kernel).unwrap_or_else(|| panic!("{op} {rows}: {figs:?}"));
            assert!(q.us.is_some_and(|us| us > 0.0) && q.error.is_none(), "{q:?}");
            let unit = of("f16 cubek unit").unwrap();
            let d = unit.max_rel_diff.unwrap();
            // Weights and inputs rounded to f16: ~1e-3 of the largest
            // output; a transposed or misplaced product would be ~1.
            assert!(d < 2e-2, "{op} {rows}: dense against quantized {d:.2e}");
            let cmma = of("f16 cubek cmma").unwrap();
            assert!(cmma.us.is_some() || cmma.error.is_some(), "{cmma:?}");
        }
    }
}

/// The dense step's norm with the residual add inside it
/// (`norm_f16` with `add`): the rows it norms have the projection added
/// in place, the others are untouched, and the f16 rows equal the plain
/// norm's over the host's sums bit for bit.
#[test]
fn the_norm_adds_the_projection_to_the_rows_it_norms() {
    let c = cubecl::Device::Wgpu(Default::default()).client();
    let mut rng = Rng(0xadd_0017);
    let (rows, hidden) = (5, 576);
    let (x, d, w) = (rng.vec(rows * hidden), rng.vec(rows * hidden), rng.vec(hidden));
    let idx = DeviceBuf::upload(&c, &[3u32, 0, 4]);
    let (xd, wd) = (DeviceBuf::upload(&c, &x), DeviceBuf::upload(&c, &w));
    let h = DeviceBuf::<f16>::uninit(&c, 3 * hidden);
    dense::norm_f16(&c, &xd, Some(&DeviceBuf::upload(&c, &d)), &wd, &h, &idx, 1e-5);
    let mut sum = x.clone();
    for r in [3, 0, 4] {
        for i in r * hidden..(r + 1) * hidden {
            sum[i] += d[i];
        }
    }
    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(xd.read(&c).unwrap()), bits(sum.clone()), "x after the add");
    let plain = DeviceBuf::<f16>::uninit(&c, 3 * hidden);
    dense::norm_f16(&c, &DeviceBuf::upload(&c, &sum), None, &wd, &plain, &idx, 1e-5);
    let (got, want) = (h.read(&c).unwrap(), plain.read(&c).unwrap());
    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "normed rows");
    // Not vacuous: the norm of the rows without the add differs.
    let before = DeviceBuf::<f16>::uninit(&c, 3 * hidden);
    dense::norm_f16(&c, &DeviceBuf::upload(&c, &x), None, &wd, &before, &idx, 1e-5);
    assert!(before.read(&c).unwrap() != got);
}

/// `GpuDecoder::with_dense` (every matmul over f16 copies by cubek's
/// routines: the unit routine on lavapipe) against the quantized float
/// decoder on the real SmolLM2: two prompts batched, a prefill and 7
/// teacher-forced decode steps; the launches a step; refused for exact
/// arithmetic.
#[test]
fn the_dense_decoder_agrees_with_the_quantized_one() {
    use gcs_engine::backend::gpu::{launch, GpuDecoder};
    use gcs_engine::backend::{BackendKind, PagedDecoder};
    use gcs_engine::llama::PagedSeq;
    use gcs_engine::{cpu_device, Engine};
    let Some(path) = common::smollm_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let c = cubecl::Device::Wgpu(Default::default()).client();
    let new = || GpuDecoder::new(c.clone(), BackendKind::Wgpu, &engine.model, 16).unwrap();
    let mut float = new().with_exact(false).unwrap();
    let mut dense = new().with_exact(false).unwrap().with_dense(&engine.model, Some(1)).unwrap();
    assert_eq!((dense.dense(), float.dense()), (Some(1), None));
    assert!(dense.weight_bytes() > float.weight_bytes() * 3, "f16 copies beside the blocks");
    // The K/V budget counts the copies the decoder uploads.
    let opts = |n| gcs_engine::backend::GpuOptions { dense: Some(n), ..Default::default() };
    let budgeted = |n| gcs_engine::backend::gpu_weight_bytes(&engine.model, opts(n)).unwrap();
    assert_eq!(budgeted(0), gcs_engine::backend::weight_bytes(&engine.model));
    assert_eq!(budgeted(64) - budgeted(0), (dense.weight_bytes() - float.weight_bytes()) as u64);
    // The quantized decoder is the reference whose tokens both are fed.
    let (agree, total, max_d, _) = common::gpu::compare(&engine, &mut dense, &mut float);
    println!("dense vs quantized (lavapipe): top-1 {agree}/{total}, max |Δ logit| {max_d:.3}");
    // f16 inputs and weights: a few tenths at most on logits near 20; a
    // wrong product would move them by whole units.
    assert!(agree * 100 >= total * 85, "top-1 {agree}/{total}");
    assert!(max_d < 1.5, "max |Δ logit| {max_d}");
    // Launches: 9 a layer in a prefill step (the add and norm, Q/K/V,
    // RoPE/K-V store, attention into f16, O, the add and norm, gate/up,
    // SwiGLU, down), 8 in a decode step; embedding before, the last add
    // and output norm, LM head and pick after.
    let layers = engine.model.config.n_layers;
    for (tokens, past, per_layer) in [(&[1u32, 2][..], 0, 9), (&[3u32][..], 2, 8)] {
        let before = launch::launches();
        let seq = PagedSeq { tokens, past, table: &[4], decode_from: 2 };
        dense.forward_paged(&[seq]).unwrap();
        assert_eq!(launch::launches() - before, 1 + per_layer * layers + 3);
    }
    // Exact arithmetic has no dense form, either way round.
    assert!(new().with_exact(true).unwrap().with_dense(&engine.model, Some(1)).is_err());
    assert!(dense.with_exact(true).is_err());
}

/// A threshold (`with_dense(Some(2))`): a step of fewer rows runs the
/// quantized kernels, one of 2 or more the dense step: each step's logits
/// equal, bit for bit, those of the decoder that always runs that kind,
/// and its launches are that kind's.
#[test]
fn a_dense_threshold_picks_each_steps_kernels_by_its_rows() {
    use gcs_engine::backend::gpu::{launch, GpuDecoder};
    use gcs_engine::backend::{BackendKind, PagedDecoder};
    use gcs_engine::llama::PagedSeq;
    use gcs_engine::{cpu_device, Engine};
    let Some(path) = common::smollm_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let c = cubecl::Device::Wgpu(Default::default()).client();
    let new = |from| {
        let d = GpuDecoder::new(c.clone(), BackendKind::Wgpu, &engine.model, 8).unwrap();
        d.with_exact(false).unwrap().with_dense(&engine.model, from).unwrap()
    };
    let (mut quantized, mut dense, mut hybrid) = (new(None), new(Some(1)), new(Some(2)));
    assert_eq!(hybrid.dense(), Some(2));
    let layers = engine.model.config.n_layers;
    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // A one-row step (its own block), then a two-row one (another block):
    // the quantized decode step's 5 launches a layer, the dense prefill's 9.
    for (tokens, table, per_layer) in [(&[7u32][..], [1u32], 5), (&[1u32, 2][..], [2], 9)] {
        let seq = [PagedSeq { tokens, past: 0, table: &table, decode_from: 0 }];
        let before = launch::launches();
        let got = bits(hybrid.forward_paged(&seq).unwrap());
        assert_eq!(
            launch::launches() - before,
            1 + per_layer * layers + 3,
            "{} rows",
            tokens.len()
        );
        let q = bits(quantized.forward_paged(&seq).unwrap());
        let d = bits(dense.forward_paged(&seq).unwrap());
        let (same, other) = if tokens.len() < 2 { (q, d) } else { (d, q) };
        assert!(got == same && got != other, "{} rows: not the step of its kind", tokens.len());
    }
}

/// Gemma 3 with dense steps: every matrix in f16, its layers' head norms,
/// post-norms and GeGLU (in f16) as the quantized step's, and its
/// 262,144-token LM head (tied to the embedding) uploaded in parts under
/// wgpu's binding limit (each part's product copied into its columns):
/// against the quantized decoder, the copies counted by the K/V budget.
#[test]
fn gemma_with_dense_steps_agrees_with_the_quantized_decoder() {
    use gcs_engine::backend::gpu::{launch, GpuDecoder};
    use gcs_engine::backend::PagedDecoder;
    use gcs_engine::backend::{gpu_weight_bytes, weight_bytes, BackendKind, GpuOptions};
    use gcs_engine::llama::PagedSeq;
    use gcs_engine::{cpu_device, Engine};
    let Some(path) = common::gemma_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let c = cubecl::Device::Wgpu(Default::default()).client();
    let new = || GpuDecoder::new(c.clone(), BackendKind::Wgpu, &engine.model, 16).unwrap();
    let mut float = new().with_exact(false).unwrap();
    let mut dense = new().with_dense(&engine.model, Some(1)).unwrap();
    let copies = dense.weight_bytes() - float.weight_bytes();
    let cfg = &engine.model.config;
    assert!(copies > 2 * cfg.vocab * cfg.hidden, "the head and the layers: {copies}");
    let opts = GpuOptions { dense: Some(1), ..Default::default() };
    let budgeted = gpu_weight_bytes(&engine.model, opts).unwrap();
    assert_eq!(budgeted - weight_bytes(&engine.model), copies as u64);
    let (agree, total, max_d, _) = common::gpu::compare(&engine, &mut dense, &mut float);
    println!(
        "gemma3 dense vs quantized (lavapipe): top-1 {agree}/{total}, max |Δ logit| {max_d:.3}"
    );
    // f16 inputs and weights; a column of a part copied to the wrong
    // place, or a norm or GeGLU left out, would move logits by whole units.
    assert!(agree * 100 >= total * 85, "top-1 {agree}/{total}");
    assert!(max_d < 2.0, "max |Δ logit| {max_d}");
    // A decode step: 3 launches a layer more than the quantized one's 8
    // (two norms and GeGLU launched apart from the matmuls), 1 fewer in
    // the half of the layers whose quantized Q/K/V are two parts (V in
    // Q8_0), a launch each, where the f16 copy is one.
    let count = |d: &mut GpuDecoder| {
        let seq = PagedSeq { tokens: &[3], past: 2, table: &[4], decode_from: 2 };
        let before = launch::launches();
        d.forward_paged(&[seq]).unwrap();
        launch::launches() - before
    };
    let (q, d) = (count(&mut float), count(&mut dense));
    println!("gemma3 decode step: {q} launches quantized, {d} dense");
    // The head on wgpu: 6 f16 parts, each a product and a copy, against
    // the quantized embedding table's 3 parts, a launch each.
    assert_eq!(d - q, 3 * cfg.n_layers - cfg.n_layers / 2 + 6 * 2 - 3, "{d} against {q}");
}

/// A matrix in parts (as on wgpu past its binding limit) multiplies as
/// the whole one, each part's product in its own columns.
#[test]
fn a_dense_matrix_in_parts_multiplies_as_the_whole() {
    let c = cubecl::Device::Wgpu(Default::default()).client();
    let mut rng = Rng(0x9a7_0017);
    let (rows, cols, n) = (300, 64, 5);
    let w = rng.vec(rows * cols);
    let whole = DenseMatrix::upload(&c, &w, rows, cols);
    // 7 whole rows a part at most: 43 parts, the last of 6 rows.
    let parts = DenseMatrix::upload_parts(&c, &w, rows, cols, 7 * cols * 2 + 1);
    assert_eq!((whole.parts.len(), parts.parts.len()), (1, 43));
    assert_eq!(parts.parts.iter().map(|p| p.1).sum::<usize>(), rows);
    let x: Vec<f16> = rng.vec(n * cols).into_iter().map(f16::from_f32).collect();
    let xd = DeviceBuf::upload(&c, &x);
    let (_, unit) = dense::routines().into_iter().find(|(n, _)| *n == "unit").unwrap();
    let run = |m: &DenseMatrix| {
        let out = DeviceBuf::upload(&c, &vec![f32::NAN; n * rows]);
        dense::matmul(&c, &unit, m, &xd, n, &out).unwrap();
        out.read(&c).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    };
    let (a, b) = (run(&whole), run(&parts));
    assert!(a.iter().all(|&v| !f32::from_bits(v).is_nan()), "every output written");
    assert!(a == b, "parts against the whole");
}

/// The device check (`gcs-node gpu-check`) on lavapipe, small: its last
/// two parts, the dense products and the dense decoder, report figures
/// (the decoder's parity against the CPU within f16's reach of the
/// quantized decoder's) after everything before them.
#[test]
#[ignore = "33 min on lavapipe (the whole device check, its anatomy above all): --ignored"]
fn the_device_check_reports_the_dense_decoder() {
    use gcs_engine::backend::ComputeDevice;
    use gcs_engine::devcheck::{run, CheckConfig};
    use gcs_engine::{cpu_device, ChatMessage, Engine};
    let Some(path) = common::smollm_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let prompts: Vec<Vec<u32>> = ["What is 2 + 2?", "Name a colour."]
        .iter()
        .map(|p| engine.prompt_tokens(&[ChatMessage::new("user", *p)]).unwrap())
        .collect();
    let cfg = CheckConfig {
        model: path,
        device: ComputeDevice::Wgpu(0),
        prompts,
        greedy_tokens: 4,
        logit_prompts: 1,
        batches: vec![1, 2],
        decode_tokens: 3,
        prefill_tokens: 40,
        naive_steps: 0,
        embed_dir: None,
        embed_batches: vec![],
    };
    let r = run(&cfg).unwrap();
    let d = r.dense_decoder.as_ref().expect("the dense decoder's part");
    let f = d.figures.as_ref().unwrap_or_else(|| panic!("{:?}", d.error));
    println!("dense decoder: {:?}", f.parity);
    println!("quantized decoder: {:?}", r.parity);
    assert_eq!(f.parity.top1_total, r.parity.top1_total);
    assert!(f.parity.top1_agree + 1 >= r.parity.top1_agree, "{:?}", f.parity);
    assert!(f.parity.max_abs_logit_delta < r.parity.max_abs_logit_delta + 0.5, "{:?}", f.parity);
    assert_eq!(f.decode.iter().map(|x| x.batch).collect::<Vec<_>>(), [1, 2]);
    assert!(f.decode.iter().all(|x| x.tokens_per_s > 0.0 && x.streams_equal == x.batch), "{f:?}");
    for op in ["gate_up", "lm_head"] {
        assert!(r
            .dense
            .iter()
            .any(|x| x.op == op && x.kernel == "f16 cubek unit" && x.us.is_some()));
    }
}
