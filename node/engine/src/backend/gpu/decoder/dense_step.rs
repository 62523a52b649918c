//! [`GpuDecoder::with_dense`]: the step with its matmuls over f16 copies
//! of the weights by cubek's routines (`super::super::dense`), in steps
//! from a number of rows (the device check measures it against the
//! quantized kernels end to end).

use super::{GpuDecoder, GpuError, Layer, StepIo, StepShape};
use crate::backend::gpu::dense::{self, matmul_first, DenseWeights};
use crate::backend::gpu::launch::{self, AttentionKernel};
use crate::backend::gpu::step::DenseIo;
use crate::backend::gpu::DeviceBuf;
use crate::llama::Llama;

impl GpuDecoder {
    /// Multiply by f16 copies of the weights (cubek's tensor-core routine
    /// where the device has one, else its unit routine) in every step of
    /// `from` rows or more (a decode bucket's padded rows, a prefill
    /// step's tokens), by the quantized kernels below that and with
    /// `None` (the default; `GCS_GPU_DENSE=N`); before the first step.
    /// The copies take 2 bytes a weight on the device beside the
    /// quantized ones. The dense step rounds each matmul's input to f16,
    /// so a row's logits differ from the quantized step's, and with a
    /// threshold above 1 a sequence's tokens may depend on how many others
    /// share its steps (as cubek's tiling may at any threshold). Refused
    /// with exact arithmetic.
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

    /// Layer `li` of the dense step, `pending` (the last layer's down
    /// projection, in `d.d`) joining the residual in its first norm's
    /// launch; what it leaves pending. llama: the add and a norm into f16,
    /// Q/K/V, (RoPE and the K/V store,) the attention into f16, O, the add
    /// and a norm into f16, gate/up, SwiGLU into f16, down (left pending):
    /// 8 launches a decode layer. gemma3: a norm into f16, Q/K/V, the head
    /// norms, (RoPE and the K/V store,) the attention into f16 (its
    /// layer's tables and window), O, its post-norm added, a norm into
    /// f16, gate/up, GeGLU into f16, down, its post-norm added: 11.
    pub(super) fn dense_layer<'d>(
        &self,
        io: &StepIo,
        layer: &Layer<'_>,
        w: &DenseWeights,
        li: usize,
        d: &'d DenseIo,
        pending: Option<&'d DeviceBuf<f32>>,
    ) -> std::result::Result<Option<&'d DeviceBuf<f32>>, GpuError> {
        let (cl, c, sh) = (&self.client, &self.config, self.sh);
        let (routines, dl) = (&w.routines, &w.layers[li]);
        let (t, meta, eps, x) = (io.rows(), &io.meta, c.rms_eps, &io.x);
        let Layer { w: l, pool, scale, rope, window, fused } = *layer;
        let kernel = AttentionKernel::for_rows(t, sh);
        dense::norm_f16(cl, x, pending, &l.attn_norm, &d.a16, &io.all, eps);
        matmul_first(cl, routines, &dl.wqkv, &d.a16, t, &io.qkv)?;
        if let Some(g) = &l.gemma {
            launch::head_norm(cl, sh, &io.qkv, t, &g.q, &g.k, self.q_scale, eps);
        }
        if fused.is_none() {
            launch::rope_kv_store(cl, sh, &io.qkv, pool, rope.cos, rope.sin, meta, None);
        }
        launch::float_attention(cl, sh, &io.qkv, pool, &d.a16, meta, scale, window, fused, kernel);
        matmul_first(cl, routines, &dl.wo, &d.a16, t, &d.d)?;
        let Some(g) = &l.gemma else {
            dense::norm_f16(cl, x, Some(&d.d), &l.ffn_norm, &d.a16, &io.all, eps);
            matmul_first(cl, routines, &dl.w_gate_up, &d.a16, t, &io.gu)?;
            dense::glu_f16(cl, &io.gu, &d.a16, c.intermediate, t, false);
            matmul_first(cl, routines, &dl.w_down, &d.a16, t, &d.d)?;
            return Ok(Some(&d.d));
        };
        launch::add_normed(cl, x, &d.d, &g.post_attn, t, eps);
        dense::norm_f16(cl, x, None, &l.ffn_norm, &d.a16, &io.all, eps);
        matmul_first(cl, routines, &dl.w_gate_up, &d.a16, t, &io.gu)?;
        dense::glu_f16(cl, &io.gu, &d.a16, c.intermediate, t, true);
        matmul_first(cl, routines, &dl.w_down, &d.a16, t, &d.d)?;
        launch::add_normed(cl, x, &d.d, &g.post_ffn, t, eps);
        Ok(None)
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
        matmul_first(cl, &w.routines, &w.lm_head, &d.a16, io.seqs(), &io.logits)?;
        self.launch_pick(io);
        Ok(())
    }
}
