//! The alternative issue 17 asks to measure against the quantized kernels:
//! f16 copies of the weights multiplied by cubek's matmul (burn's own; on
//! CUDA its tensor-core routines, elsewhere its unit routines), f16 inputs
//! and f32 sums and outputs. The device check times it on a layer's
//! gate/up and on the LM head at each batch (`devcheck::dense`), and runs
//! the whole decoder on it ([`super::GpuDecoder::with_dense`],
//! `GCS_GPU_DENSE=N`: in steps of N rows or more): off by default, since
//! the quantized kernels give a row the same bits at every batch and read
//! a quarter of the bytes, and the dense step's speed is not measured on
//! a GPU yet.

use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::zspace::{Shape, Strides};
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::launch::launch_ref;
use cubek::matmul::multi_level::Strategy as Routine;
use cubek::matmul::strategy::Strategy;
use cubek::std::InputBinding;
use half::f16;

use super::kernels::dense as k;
use super::kernels::ops::{self, ROW_THREADS};
use super::launch::{counted, groups};
use super::{DeviceBuf, GpuError};
use crate::quant::{dequantize, QMatrix};

/// The cubek routines the anatomy times: tensor cores (`cmma`), one
/// output tile a unit (`unit`, any device), and the vector-matrix
/// routine for a single row.
pub fn routines() -> Vec<(&'static str, Strategy)> {
    vec![
        ("cmma", Routine::SimpleCyclicCmma(Default::default()).into()),
        ("cmma double-buffered", Routine::DoubleCyclicCmma(Default::default()).into()),
        ("unit", Routine::SimpleUnit(Default::default()).into()),
        ("vecmat", Routine::SimpleVecMat(Default::default()).into()),
    ]
}

/// The routines the decoder's dense step tries, in order: tensor cores,
/// else one tile a unit (a problem no tensor-core tile fits, a device
/// without them).
pub fn step_routines() -> [Strategy; 2] {
    [
        Routine::SimpleCyclicCmma(Default::default()).into(),
        Routine::SimpleUnit(Default::default()).into(),
    ]
}

/// [`matmul`] by the first of `routines` the device runs.
pub fn matmul_first(
    client: &Client,
    routines: &[Strategy],
    m: &DenseMatrix,
    x: &DeviceBuf<f16>,
    n: usize,
    out: &DeviceBuf<f32>,
) -> Result<(), GpuError> {
    let mut last = GpuError::Unsupported("no dense matmul routine".into());
    for r in routines {
        match matmul(client, r, m, x, n, out) {
            Ok(()) => return Ok(()),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// A layer's four matrices in f16.
#[derive(Debug)]
pub struct DenseLayer {
    pub wqkv: DenseMatrix,
    pub wo: DenseMatrix,
    pub w_gate_up: DenseMatrix,
    pub w_down: DenseMatrix,
}

/// A model's matrices in f16 ([`super::GpuDecoder::with_dense`]): every
/// layer's and the LM head.
pub struct DenseWeights {
    pub layers: Vec<DenseLayer>,
    pub lm_head: DenseMatrix,
    /// The routines a step tries, in order ([`step_routines`]).
    pub routines: [Strategy; 2],
}

// By hand: cubek's `Strategy` is `Display` only.
impl std::fmt::Debug for DenseWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let routines: Vec<String> = self.routines.iter().map(ToString::to_string).collect();
        f.debug_struct("DenseWeights")
            .field("layers", &self.layers)
            .field("lm_head", &self.lm_head)
            .field("routines", &routines)
            .finish()
    }
}

impl DenseWeights {
    /// Each matrix in parts of at most `max_part` bytes.
    pub fn upload(client: &Client, model: &crate::llama::Llama, max_part: usize) -> Self {
        let up = |m: &QMatrix| DenseMatrix::from_q(client, m, max_part);
        let layers = model
            .blocks
            .iter()
            .map(|b| DenseLayer {
                wqkv: up(&b.q.wqkv),
                wo: up(&b.q.wo),
                w_gate_up: up(&b.q.w_gate_up),
                w_down: up(&b.q.w_down),
            })
            .collect();
        Self { layers, lm_head: up(&model.lm_head), routines: step_routines() }
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| l.wqkv.bytes() + l.wo.bytes() + l.w_gate_up.bytes() + l.w_down.bytes())
            .sum();
        l + self.lm_head.bytes()
    }
}

/// Rows `idx` of `x` normed by `w` (`ops::rms_norm`'s operations) into
/// `h` in f16, row `c` of `h` the row `idx[c]`; with `add`, each of those
/// rows of `add` is first added to `x` in place (a projection joining the
/// residual, `kernels::dense::add_rms_norm`).
pub fn norm_f16(
    c: &Client,
    x: &DeviceBuf<f32>,
    add: Option<&DeviceBuf<f32>>,
    w: &DeviceBuf<f32>,
    h: &DeviceBuf<f16>,
    idx: &DeviceBuf<u32>,
    eps: f32,
) {
    counted();
    let (count, dim) =
        (CubeCount::Static(idx.len() as u32, 1, 1), CubeDim::new_1d(ROW_THREADS as u32));
    let (x, w, h, idx, hidden) = (x.arg(), w.arg(), h.arg(), idx.arg(), w.len());
    match add {
        Some(d) => {
            k::add_rms_norm::launch::<f16>(c, count, dim, x, d.arg(), w, h, idx, hidden, eps)
        }
        None => ops::rms_norm::launch::<f16>(c, count, dim, x, w, h, idx, hidden, eps),
    }
}

/// The SwiGLU (gemma3: `gelu`, GeGLU) of `t` rows `[gate | up]` of `gu`
/// into `act` in f16.
pub fn glu_f16(
    c: &Client,
    gu: &DeviceBuf<f32>,
    act: &DeviceBuf<f16>,
    inter: usize,
    t: usize,
    gelu: bool,
) {
    counted();
    let n = t * inter;
    let (count, dim) = (CubeCount::Static(groups(n, 256), 1, 1), CubeDim::new_1d(256));
    ops::glu::launch::<f16>(c, count, dim, gu.arg(), act.arg(), inter, n, gelu);
}

/// An `[rows, cols]` weight matrix in f16, row-major (each output's
/// weights contiguous, as a GGUF tensor's rows), in parts of whole rows:
/// one, unless a wgpu adapter's binding limit splits it
/// ([`DenseMatrix::upload_parts`]).
#[derive(Debug, Clone)]
pub struct DenseMatrix {
    /// Each part's weights and its rows, in order.
    pub parts: Vec<(DeviceBuf<f16>, usize)>,
    pub rows: usize,
    pub cols: usize,
}

impl DenseMatrix {
    /// `w` (`rows × cols` values) rounded to f16 on the device, one part.
    pub fn upload(client: &Client, w: &[f32], rows: usize, cols: usize) -> Self {
        Self::upload_parts(client, w, rows, cols, usize::MAX)
    }

    /// [`Self::upload`] in parts of at most `max_bytes` (whole rows, one
    /// at least).
    pub fn upload_parts(
        client: &Client,
        w: &[f32],
        rows: usize,
        cols: usize,
        max_bytes: usize,
    ) -> Self {
        assert_eq!(w.len(), rows * cols, "a dense matrix's values");
        // As few parts as fit, of rows as even as they divide.
        let most = (max_bytes / 2 / cols.max(1)).clamp(1, rows.max(1));
        let per = rows.max(1).div_ceil(rows.max(1).div_ceil(most));
        let parts = w
            .chunks(per * cols.max(1))
            .map(|c| {
                let h: Vec<f16> = c.iter().map(|&v| f16::from_f32(v)).collect();
                (DeviceBuf::upload(client, &h), c.len() / cols.max(1))
            })
            .collect();
        Self { parts, rows, cols }
    }

    /// A quantized matrix's values (as the CPU dequantizes them), in f16,
    /// in parts of at most `max_bytes`.
    pub fn from_q(client: &Client, m: &QMatrix, max_bytes: usize) -> Self {
        let w: Vec<f32> = m.gguf_parts().iter().flat_map(|p| dequantize(p.ty, &p.bytes)).collect();
        Self::upload_parts(client, &w, m.rows, m.cols, max_bytes)
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.rows * self.cols * 2
    }
}

/// `out[i, r] = Σ_c x[i, c] · w[r, c]` for the first `n` rows of `x`
/// (`[n, cols]` in f16), f32 sums into `out` (`[n, rows]`), by `routine`.
/// A matrix in parts multiplies each into a buffer of its own, whose
/// columns are then copied to theirs in `out` (a launch more a part). A
/// routine the device cannot run (`cmma` without tensor cores) is an
/// error naming it, nothing launched for that part ([`matmul_first`]
/// then runs the next routine over every part).
pub fn matmul(
    client: &Client,
    routine: &Strategy,
    m: &DenseMatrix,
    x: &DeviceBuf<f16>,
    n: usize,
    out: &DeviceBuf<f32>,
) -> Result<(), GpuError> {
    let (cols, r) = (m.cols, m.rows);
    if x.len() < n * cols || out.len() < n * r || n == 0 {
        return Err(GpuError::Unsupported(format!(
            "dense matmul of {n} rows: input {} values for {cols} a row, output {} for {r}",
            x.len(),
            out.len()
        )));
    }
    if let [(w, _)] = &m.parts[..] {
        return matmul_part(client, routine, w, cols, r, x, n, out);
    }
    let mut r0 = 0;
    for (w, rows) in &m.parts {
        // Allocated in the step: parts are wgpu's only, which records no
        // graphs (an allocation would break a CUDA capture).
        let part = DeviceBuf::<f32>::uninit(client, n * rows);
        matmul_part(client, routine, w, cols, *rows, x, n, &part)?;
        counted();
        let (count, dim) = (CubeCount::Static(groups(n * rows, 256), 1, 1), CubeDim::new_1d(256));
        k::copy_cols::launch(client, count, dim, part.arg(), out.arg(), *rows, r, r0, n * rows);
        r0 += rows;
    }
    Ok(())
}

/// [`matmul`] of one part: `w` is `[rows, k]`, `out` `[n, rows]`.
#[allow(clippy::too_many_arguments)]
fn matmul_part(
    client: &Client,
    routine: &Strategy,
    w: &DeviceBuf<f16>,
    k: usize,
    r: usize,
    x: &DeviceBuf<f16>,
    n: usize,
    out: &DeviceBuf<f32>,
) -> Result<(), GpuError> {
    // Batched rank-3 operands (a batch of one), as cubek's own benches.
    let lhs = x.tensor(Shape::new([1, n, k]), Strides::new(&[n * k, k, 1]));
    // The weights read as `[cols, rows]`: column-major, no copy.
    let rhs = w.tensor(Shape::new([1, k, r]), Strides::new(&[k * r, 1, k]));
    let out = out.tensor(Shape::new([1, n, r]), Strides::new(&[n * r, r, 1]));
    let half = <f16 as Scalar>::elem_type_native();
    let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: half,
        rhs: half,
        out: <f32 as Scalar>::elem_type_native(),
    });
    let (lhs, rhs) = (InputBinding::new(lhs, half), InputBinding::new(rhs, half));
    launch_ref(routine, client, lhs, rhs, out, &mut dtypes)
        .map_err(|e| GpuError::Server(format!("cubek {routine}: {}", format!("{e:?}").trim())))?;
    counted();
    Ok(())
}
