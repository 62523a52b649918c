//! The alternative issue 17 asks to measure against the quantized kernels:
//! f16 copies of the weights multiplied by cubek's matmul (burn's own; on
//! CUDA its tensor-core routines, elsewhere its unit routines), f16 inputs
//! and f32 sums and outputs. The device check's anatomy times it on a
//! layer's gate/up and on the LM head at each batch
//! ([`super::GpuDecoder::anatomy`]); the decoder does not use it (its
//! quantized kernels give a row the same bits at every batch, and read a
//! quarter of the bytes).

use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::zspace::{Shape, Strides};
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::launch::launch_ref;
use cubek::matmul::multi_level::Strategy as Routine;
use cubek::matmul::strategy::Strategy;
use cubek::std::InputBinding;
use half::f16;

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

/// An `[rows, cols]` weight matrix in f16, row-major (each output's
/// weights contiguous, as a GGUF tensor's rows).
#[derive(Debug, Clone)]
pub struct DenseMatrix {
    pub w: DeviceBuf<f16>,
    pub rows: usize,
    pub cols: usize,
}

impl DenseMatrix {
    /// `w` (`rows × cols` values) rounded to f16 on the device.
    pub fn upload(client: &Client, w: &[f32], rows: usize, cols: usize) -> Self {
        assert_eq!(w.len(), rows * cols, "a dense matrix's values");
        let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        Self { w: DeviceBuf::upload(client, &h), rows, cols }
    }

    /// A quantized matrix's values (as the CPU dequantizes them), in f16.
    pub fn from_q(client: &Client, m: &QMatrix) -> Self {
        let w: Vec<f32> = m.gguf_parts().iter().flat_map(|p| dequantize(p.ty, &p.bytes)).collect();
        Self::upload(client, &w, m.rows, m.cols)
    }
}

/// `out[i, r] = Σ_c x[i, c] · w[r, c]` for the first `n` rows of `x`
/// (`[n, cols]` in f16), f32 sums into `out` (`[n, rows]`), by `routine`.
/// A routine the device cannot run (`cmma` without tensor cores) is an
/// error naming it; nothing is launched then.
pub fn matmul(
    client: &Client,
    routine: &Strategy,
    m: &DenseMatrix,
    x: &DeviceBuf<f16>,
    n: usize,
    out: &DeviceBuf<f32>,
) -> Result<(), GpuError> {
    let (k, r) = (m.cols, m.rows);
    if x.len() < n * k || out.len() < n * r || n == 0 {
        return Err(GpuError::Unsupported(format!(
            "dense matmul of {n} rows: input {} values for {k} a row, output {} for {r}",
            x.len(),
            out.len()
        )));
    }
    // Batched rank-3 operands (a batch of one), as cubek's own benches.
    let lhs = x.tensor(Shape::new([1, n, k]), Strides::new(&[n * k, k, 1]));
    // The weights read as `[cols, rows]`: column-major, no copy.
    let rhs = m.w.tensor(Shape::new([1, k, r]), Strides::new(&[k * r, 1, k]));
    let out = out.tensor(Shape::new([1, n, r]), Strides::new(&[n * r, r, 1]));
    let half = <f16 as Scalar>::elem_type_native();
    let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: half,
        rhs: half,
        out: <f32 as Scalar>::elem_type_native(),
    });
    let (lhs, rhs) = (InputBinding::new(lhs, half), InputBinding::new(rhs, half));
    launch_ref(routine, client, lhs, rhs, out, &mut dtypes)
        .map_err(|e| GpuError::Server(format!("cubek {routine}: {}", format!("{e:?}").trim())))
}
