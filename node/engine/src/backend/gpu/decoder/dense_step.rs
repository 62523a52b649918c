//! [`GpuDecoder::with_dense`]: the step with its matmuls over f16 copies
//! of the weights by cubek's routines (`super::super::dense`), for the
//! device check to measure against the quantized kernels end to end.

use super::{GpuDecoder, GpuError, StepIo};
use crate::backend::gpu::dense::{self, matmul_first, DenseWeights};
use crate::backend::gpu::launch::{self, Attn, FusedRope, LayerPool};
use crate::backend::gpu::step::DenseIo;
use crate::llama::Llama;

impl GpuDecoder {
    /// Multiply by f16 copies of the weights (cubek's tensor-core routine
    /// where the device has one, else its unit routine) or by the
    /// quantized kernels (the default; `GCS_GPU_DENSE=1` turns this on);
    /// before the first step. The copies take 2 bytes a weight on the
    /// device beside the quantized ones. The dense step rounds each
    /// matmul's input to f16, so a row's logits differ from the quantized
    /// step's (and may differ between batch sizes, as cubek's tiling
    /// does). Refused for gemma3 and with exact arithmetic.
    pub fn with_dense(mut self, model: &Llama, on: bool) -> std::result::Result<Self, GpuError> {
        if on && (self.config.gemma3.is_some() || self.shape.exact) {
            return Err(GpuError::Unsupported(
                "dense f16 weights for gemma3 or with exact arithmetic".into(),
            ));
        }
        self.dense = on.then(|| DenseWeights::upload(&self.client, model));
        self.shape.dense = on;
        self.graphs.buckets.clear();
        Ok(self)
    }

    /// Whether steps multiply by f16 copies ([`Self::with_dense`]).
    pub fn dense(&self) -> bool {
        self.dense.is_some()
    }

    /// The dense step's layers, output norm and LM head: per layer a norm
    /// into f16, Q/K/V, (RoPE and the K/V store,) the attention, its
    /// output into f16, O, the residual add, a norm into f16, gate/up,
    /// SwiGLU into f16, down and the residual add.
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
        for (li, (l, dl)) in self.layers.iter().zip(&w.layers).enumerate() {
            let pool = LayerPool { k: &self.k_pool, v: &self.v_pool, off: li * layer_len };
            dense::norm_f16(cl, &io.x, &l.attn_norm, &d.a16, &io.all, eps);
            matmul_first(cl, &routines, &dl.wqkv, &d.a16, t, &io.qkv)?;
            if !decode {
                launch::rope_kv_store(cl, sh, &io.qkv, pool, rope.cos, rope.sin, meta, None);
            }
            let attn = Attn::Float(decode.then_some(rope));
            launch::paged_attention(
                cl,
                sh,
                &io.qkv,
                pool,
                &io.attn,
                meta,
                self.score_scale,
                0,
                attn,
            );
            dense::cast_f16(cl, &io.attn, &d.a16, t * dl.wo.cols);
            matmul_first(cl, &routines, &dl.wo, &d.a16, t, &d.d)?;
            dense::add_in(cl, &io.x, &d.d, t * c.hidden);
            dense::norm_f16(cl, &io.x, &l.ffn_norm, &d.a16, &io.all, eps);
            matmul_first(cl, &routines, &dl.w_gate_up, &d.a16, t, &io.gu)?;
            dense::swiglu_f16(cl, &io.gu, &d.a16, c.intermediate, t);
            matmul_first(cl, &routines, &dl.w_down, &d.a16, t, &d.d)?;
            dense::add_in(cl, &io.x, &d.d, t * c.hidden);
        }
        // Each sequence's last row: the output norm into f16, the logits.
        dense::norm_f16(cl, &io.x, &self.output_norm, &d.a16, &io.last, eps);
        matmul_first(cl, &routines, &w.lm_head, &d.a16, io.seqs(), &io.logits)?;
        self.launch_pick(io);
        Ok(())
    }
}
