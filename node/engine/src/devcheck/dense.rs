//! Issue 17 asks which is faster at batch 1 and 64: the quantized blocks
//! dequantized inside the decoder's own matmul kernels, or f16 copies of
//! the weights (`backend::gpu::dense`: cubek's routines, tensor cores on
//! CUDA). This times both on layer 0's gate/up and on the LM head of the
//! checked model at each batch, over the same input rows, and says how far
//! each dense product lies from the quantized one (f16 rounding of the
//! weights and the input: about 1e-3 of the largest output).

use serde::Serialize;

use crate::backend::ComputeDevice;
use crate::Engine;

/// One product at one batch by one kernel.
#[derive(Debug, Clone, Serialize)]
pub struct DenseFigure {
    pub op: String,
    pub rows: usize,
    /// `quantized (Wide)` / `quantized (Tiled)`: the decoder's kernel for
    /// this batch; `f16 cubek <routine>`: a dense copy.
    pub kernel: String,
    /// A call's time, the device waited for after all calls.
    pub us: Option<f64>,
    /// Multiply-adds a second, ×2, over the call's time.
    pub tflops: Option<f64>,
    /// The largest |dense − quantized| over the largest |quantized|.
    pub max_rel_diff: Option<f64>,
    /// Why there is no figure (a routine the device lacks hardware for).
    pub error: Option<String>,
}

/// Calls a timing averages.
pub const ITERS: usize = 20;

/// Both products at each of `batches` (empty on the CPU or in a build
/// without a GPU runtime). A panic inside a routine is caught and reported
/// as one figure: it ends this part of the check, not the check.
pub fn run(engine: &Engine, device: ComputeDevice, batches: &[usize]) -> Vec<DenseFigure> {
    if device == ComputeDevice::Cpu {
        return vec![];
    }
    let go = std::panic::AssertUnwindSafe(|| gpu(engine, device, batches));
    std::panic::catch_unwind(go).unwrap_or_else(|p| {
        let why = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".into());
        vec![failed("all", 0, "", format!("panicked: {why}"))]
    })
}

fn failed(op: &str, rows: usize, kernel: &str, e: String) -> DenseFigure {
    let (op, kernel) = (op.to_string(), kernel.to_string());
    DenseFigure { op, rows, kernel, us: None, tflops: None, max_rel_diff: None, error: Some(e) }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn gpu(engine: &Engine, device: ComputeDevice, batches: &[usize]) -> Vec<DenseFigure> {
    use crate::backend::gpu::dense::{self, DenseMatrix};
    use crate::backend::gpu::launch::{self, Input, MatmulKernel};
    use crate::backend::gpu::weights::GpuMatrix;
    use crate::backend::gpu::{DeviceBuf, GpuError};
    use crate::backend::select::client;
    use half::f16;
    use std::time::Instant;

    let cl = match client(device) {
        Ok(c) => c,
        Err(e) => return vec![failed("all", 0, "", e.to_string())],
    };
    let model = &engine.model;
    let Some(layer) = model.blocks.first() else { return vec![] };
    let mut figures = vec![];
    for (op, q) in [("gate_up", &*layer.q.w_gate_up), ("lm_head", &*model.lm_head)] {
        let quant = match GpuMatrix::upload(&cl, q) {
            Ok(m) => m,
            Err(e) => {
                figures.push(failed(op, 0, "quantized", e.to_string()));
                continue;
            }
        };
        let dense_m = DenseMatrix::from_q(&cl, q, usize::MAX);
        let flops = |rows: usize, us: f64| 2.0 * (rows * q.rows * q.cols) as f64 / us / 1e6;
        for &rows in batches {
            let x: Vec<f32> = (0..rows * q.cols)
                .map(|i| (i.wrapping_mul(2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let (xd, out) =
                (DeviceBuf::upload(&cl, &x), DeviceBuf::<f32>::uninit(&cl, rows * q.rows));
            let x16: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
            let x16 = DeviceBuf::upload(&cl, &x16);
            // Once untimed (the first launch compiles), then `ITERS` calls;
            // a one-value read waits for the stream each time.
            let time = |f: &mut dyn FnMut() -> Result<(), GpuError>| -> Result<f64, GpuError> {
                f()?;
                xd.read_rows(&cl, 1, &[0])?;
                let t = Instant::now();
                for _ in 0..ITERS {
                    f()?;
                }
                xd.read_rows(&cl, 1, &[0])?;
                Ok(t.elapsed().as_secs_f64() * 1e6 / ITERS as f64)
            };
            let k = MatmulKernel::for_rows(rows);
            let kernel = format!("quantized ({k:?})");
            let mut run_q = || {
                launch::matmul_with(&cl, &quant, &xd, Input::Rows, rows, &out, false, k);
                Ok(())
            };
            let reference = match time(&mut run_q).and_then(|us| Ok((us, out.read(&cl)?))) {
                Ok((us, r)) => {
                    let tflops = Some(flops(rows, us));
                    let (op, us) = (op.to_string(), Some(us));
                    figures.push(DenseFigure {
                        op,
                        rows,
                        kernel,
                        us,
                        tflops,
                        max_rel_diff: None,
                        error: None,
                    });
                    r
                }
                Err(e) => {
                    figures.push(failed(op, rows, &kernel, e.to_string()));
                    continue;
                }
            };
            let top = reference.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
            for (name, routine) in dense::routines() {
                let kernel = format!("f16 cubek {name}");
                let mut run_d = || dense::matmul(&cl, &routine, &dense_m, &x16, rows, &out);
                match time(&mut run_d).and_then(|us| Ok((us, out.read(&cl)?))) {
                    Ok((us, got)) => {
                        let diff =
                            got.iter().zip(&reference).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                        figures.push(DenseFigure {
                            op: op.to_string(),
                            rows,
                            kernel,
                            us: Some(us),
                            tflops: Some(flops(rows, us)),
                            max_rel_diff: Some(f64::from(diff / top)),
                            error: None,
                        });
                    }
                    Err(e) => figures.push(failed(op, rows, &kernel, e.to_string())),
                }
            }
        }
    }
    figures
}

#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
fn gpu(_engine: &Engine, _device: ComputeDevice, _batches: &[usize]) -> Vec<DenseFigure> {
    vec![]
}
