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
