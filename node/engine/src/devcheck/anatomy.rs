//! The anatomy of a decode step on the checked GPU: the time of each
//! kernel, of the step launched eagerly and replayed as a graph, and of
//! the host's writes and reads around it ([`GpuDecoder::anatomy`]). The
//! decode figures say how fast; this says where the time goes.

use serde::Serialize;

use crate::backend::ComputeDevice;
use crate::Engine;

/// Decode-step context (positions already cached) the anatomy runs at:
/// about where the decode figures' streams are.
pub const CONTEXT: usize = 128;
/// The context of one more figure, at one row: how a lone long
/// conversation's step (its attention above all, 9 cubes over 16 chunks
/// of keys a layer) compares with a short one's.
pub const LONG_CONTEXT: usize = 2048;
/// Calls of each part per timing.
pub const ITERS: usize = 20;

/// A step of `rows` rows at context `ctx`, part by part.
#[derive(Debug, Clone, Serialize)]
pub struct AnatomyFigure {
    pub rows: usize,
    pub ctx: usize,
    /// Kernels one step launches.
    pub launches: usize,
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub parts: Vec<crate::backend::gpu::StepPart>,
    /// Why this batch has no figure.
    pub error: Option<String>,
}

/// The anatomy at each batch of `batches` at [`CONTEXT`], then at one
/// row at [`LONG_CONTEXT`] (empty on the CPU or in a build without a GPU
/// runtime).
pub fn run(engine: &Engine, device: ComputeDevice, batches: &[usize]) -> Vec<AnatomyFigure> {
    if device == ComputeDevice::Cpu {
        return vec![];
    }
    gpu(engine, device, batches)
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn gpu(engine: &Engine, device: ComputeDevice, batches: &[usize]) -> Vec<AnatomyFigure> {
    use crate::backend::gpu::GpuDecoder;
    use crate::backend::select::{check_device, client};
    let shapes: Vec<(usize, usize)> =
        batches.iter().map(|&rows| (rows, CONTEXT)).chain([(1, LONG_CONTEXT)]).collect();
    let failed = |rows, ctx, e: String| AnatomyFigure {
        rows,
        ctx,
        launches: 0,
        parts: vec![],
        error: Some(e),
    };
    let fail = |e: String| shapes.iter().map(|&(r, ctx)| failed(r, ctx, e.clone())).collect();
    let kind = match check_device(device) {
        Ok(Some(info)) => info.kind,
        Ok(None) => return vec![],
        Err(e) => return fail(e.to_string()),
    };
    let dec = client(device).map_err(|e| e.to_string()).and_then(|cl| {
        // Every row reads the same blocks: the longest context's worth.
        let blocks = LONG_CONTEXT.div_ceil(crate::paged::BLOCK_SIZE) + 1;
        GpuDecoder::new(cl, kind, &engine.model, blocks).map_err(|e| e.to_string())
    });
    let dec = match dec {
        Ok(d) => d,
        Err(e) => return fail(e),
    };
    shapes
        .iter()
        .map(|&(rows, ctx)| match dec.anatomy(rows, ctx, ITERS) {
            Ok(a) => AnatomyFigure { rows, ctx, launches: a.launches, parts: a.parts, error: None },
            Err(e) => failed(rows, ctx, e.to_string()),
        })
        .collect()
}

#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
fn gpu(_engine: &Engine, _device: ComputeDevice, _batches: &[usize]) -> Vec<AnatomyFigure> {
    vec![]
}
