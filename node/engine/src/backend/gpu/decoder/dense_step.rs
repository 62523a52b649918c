//! [`GpuDecoder::with_dense`]: the step with its matmuls over f16 copies
//! of the weights by cubek's routines (`super::super::dense`), for the
//! device check to measure against the quantized kernels end to end.

use super::{GpuDecoder, GpuError, StepIo, StepShape};
use crate::backend::gpu::dense::{self, matmul_first, DenseWeights};
use crate::backend::gpu::launch::{self, AttentionKernel, FusedRope, LayerPool};
use crate::backend::gpu::step::DenseIo;
use crate::backend::gpu::DeviceBuf;
use crate::llama::Llama;

impl GpuDecoder {
    /// Multiply by f16 copies of the weights (cubek's tensor-core routine
    /// where the device has one, else its unit routine) in every step of
    /// `from` rows or more (a decode bucket's padded rows, a prefill
    /// step's tokens), by the quantized kernels below that and with
    /// `None` (the default; `GCS_GPU_DENSE=N`); before the first step.
    /// For gemma3 only the LM head ([`DenseWeights`]). The copies take 2
    /// bytes a weight on the device beside the quantized ones. The dense
    /// step rounds each matmul's input to f16, so a row's logits differ
    /// from the quantized step's, and with a threshold above 1 a
    /// sequence's tokens may depend on how many others share its steps
    /// (as cubek's tiling may at any threshold). Refused with exact
    /// arithmetic.
    pub fn with_dense(
        mut self,
        model: &Llama,
        from: Option<usize>,
    ) -> std::result::Result<Self, GpuError> {
        if from.is_some() && self.shape.exact {
            return Err(GpuError::Unsupported("dense f16 weights with exact arithmetic".into()));
        }
        let max_part = self.max_part_bytes();
        self.dense = from.map(|n| (DenseWeights::upload(&self.client, model, max_part), n.max(1)));
        self.graphs.buckets.clear();
        Ok(self)
    }

    /// The rows from which steps multiply by f16 copies
    /// ([`Self::with_dense`]); `None`: never.
    pub fn dense(&self) -> Option<usize> {
        self.dense.as_ref().map(|(_, from)| *from)
    }

    /// The buffers' shapes of a step of `rows` rows: the dense step's
    /// from the threshold on.
    pub(super) fn shape_for(&self, rows: usize) -> StepShape {
        let dense = self.dense().is_some_and(|from| rows >= from);
        StepShape { dense, ..self.shape }
    }

    /// The dense step's layers, output norm and LM head: per layer the
    /// residual add of the last projection and a norm into f16 (one
    /// launch), Q/K/V, (RoPE and the K/V store,) the attention into f16,
    /// O, the add and a norm into f16, gate/up, SwiGLU into f16, down: 8
    /// launches a decode layer.
    pub(super) fn dense_step(
        &self,
        io: &StepIo,
        w: &DenseWeights,
        d: &DenseIo,
        decode: bool,
    ) -> std::result::Result<(), GpuError> {
        let (cl, c, sh) = (&self.client, &self.config, self.sh);
        let routines = dense::step_routines();
        let (t, meta, eps) = (io.rows(), &io.meta, c.rms_eps);
        let layer_len = (self.n_blocks + 1) * sh.block_len();
        let rope = FusedRope { cos: &self.cos, sin: &self.sin };
        let kernel = AttentionKernel::for_rows(t, sh);
        // The down projection waiting in `d.d` to join the residual.
        let mut pending = None;
        for (li, (l, dl)) in self.layers.iter().zip(&w.layers).enumerate() {
            let pool = LayerPool { k: &self.k_pool, v: &self.v_pool, off: li * layer_len };
            dense::norm_f16(cl, &io.x, pending, &l.attn_norm, &d.a16, &io.all, eps);
            matmul_first(cl, &routines, &dl.wqkv, &d.a16, t, &io.qkv)?;
            if !decode {
                launch::rope_kv_store(cl, sh, &io.qkv, pool, rope.cos, rope.sin, meta, None);
            }
            let fused = decode.then_some(rope);
            let scale = self.score_scale;
            launch::float_attention(cl, sh, &io.qkv, pool, &d.a16, meta, scale, 0, fused, kernel);
            matmul_first(cl, &routines, &dl.wo, &d.a16, t, &d.d)?;
            dense::norm_f16(cl, &io.x, Some(&d.d), &l.ffn_norm, &d.a16, &io.all, eps);
            matmul_first(cl, &routines, &dl.w_gate_up, &d.a16, t, &io.gu)?;
            dense::swiglu_f16(cl, &io.gu, &d.a16, c.intermediate, t);
            matmul_first(cl, &routines, &dl.w_down, &d.a16, t, &d.d)?;
            pending = Some(&d.d);
        }
        self.dense_head(io, w, d, pending)
    }

    /// Each sequence's last row (the only ones read from here), `pending`
    /// added where the layers left a projection to join the residual,
    /// normed into f16, by the LM head's f16 copy; then the pick.
    pub(super) fn dense_head(
        &self,
        io: &StepIo,
        w: &DenseWeights,
        d: &DenseIo,
        pending: Option<&DeviceBuf<f32>>,
    ) -> std::result::Result<(), GpuError> {
        let (cl, eps) = (&self.client, self.config.rms_eps);
        dense::norm_f16(cl, &io.x, pending, &self.output_norm, &d.a16, &io.last, eps);
        matmul_first(cl, &dense::step_routines(), &w.lm_head, &d.a16, io.seqs(), &io.logits)?;
        self.launch_pick(io);
        Ok(())
    }
}
