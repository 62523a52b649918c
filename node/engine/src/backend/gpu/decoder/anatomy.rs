//! [`GpuDecoder::anatomy`]: where a decode step's time goes, for the
//! device check (`devcheck/anatomy.rs`).

use super::{DeviceBuf, GpuDecoder, GpuError, StepIo, BLOCK, STEP};
use crate::backend::gpu::launch::{self, Attn, FusedRope, Input, LayerPool};
use crate::backend::rows::HostRows;
use crate::llama::PagedSeq;

/// One part of a decode step and its cost ([`GpuDecoder::anatomy`]).
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepPart {
    pub part: String,
    /// Host time a call, before waiting for the GPU.
    pub enqueue_us: f64,
    /// A call's share of the time until the GPU finished them all.
    pub us: f64,
}

/// A decode step's parts ([`GpuDecoder::anatomy`]).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Anatomy {
    /// Kernels one step launches (each a few µs of a small batch's step).
    pub launches: usize,
    pub parts: Vec<StepPart>,
}

impl GpuDecoder {
    /// Where a decode step of `rows` rows at context `ctx` spends its time
    /// (the GPU check's anatomy): each part called once, then `iters` times
    /// and a read of the step's ids, which waits for the stream. `enqueue_us` is
    /// the host's time a call before that wait, `us` a call's share of the
    /// whole: launch-bound parts have the two close, GPU-bound ones not.
    /// Layer 0's weights stand for every layer's. The parts are llama's
    /// layer ops: a gemma3 model's head norms and post-norms are timed
    /// only within the whole step.
    pub fn anatomy(
        &self,
        rows: usize,
        ctx: usize,
        iters: usize,
    ) -> std::result::Result<Anatomy, GpuError> {
        let _one = STEP.lock().unwrap_or_else(|e| e.into_inner());
        let (cl, c, sh) = (self.client.clone(), self.config.clone(), self.sh);
        let ctx = ctx.min(self.n_blocks * BLOCK).max(1) - 1;
        let table: Vec<u32> = (0..(ctx + 1).div_ceil(BLOCK) as u32).collect();
        let tok = [1u32];
        let seqs: Vec<PagedSeq<'_>> = (0..rows.max(1))
            .map(|_| PagedSeq { tokens: &tok, past: ctx, table: &table, decode_from: 0 })
            .collect();
        let host = HostRows::new(&seqs);
        let io = StepIo::bucket(&cl, self.shape_for(host.rows()), host.rows(), host.tables.len());
        io.write(&cl, &host);
        let before = launch::launches();
        self.launch_step(&io)?;
        let launches = launch::launches() - before;
        let iters = iters.max(1);
        let mut parts = vec![];
        let mut time = |part: &str, f: &mut dyn FnMut() -> std::result::Result<(), GpuError>| {
            // Once untimed: a kernel's first launch compiles it.
            f()?;
            io.picked.ids.read(&cl)?;
            let t = std::time::Instant::now();
            for _ in 0..iters {
                f()?;
            }
            let enqueue = t.elapsed();
            io.picked.ids.read(&cl)?;
            let per = |d: std::time::Duration| d.as_secs_f64() * 1e6 / iters as f64;
            parts.push(StepPart {
                part: part.into(),
                enqueue_us: per(enqueue),
                us: per(t.elapsed()),
            });
            Ok::<(), GpuError>(())
        };
        time("write inputs", &mut || {
            io.write(&cl, &host);
            Ok(())
        })?;
        time("step, eager", &mut || self.launch_step(&io))?;
        time("read ids", &mut || io.picked.ids.read(&cl).map(|_| ()))?;
        let l = &self.layers[0];
        let pool = LayerPool { k: &self.k_pool, v: &self.v_pool, off: 0 };
        // Where the parts' residual adds and norms write, so the step's
        // own buffers keep their inputs.
        let scratch = DeviceBuf::<f32>::uninit(&cl, io.rows() * c.hidden);
        let normed = DeviceBuf::<f32>::uninit(&cl, io.rows() * c.hidden);
        let (t, n, meta) = (io.rows(), io.seqs(), &io.meta);
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        time("embed", &mut || {
            launch::embed(&cl, &self.embed, &io.tok, &io.x, self.embed_scale, None);
            Ok(())
        })?;
        let eps = c.rms_eps;
        let (attn_norm, ffn_norm) = (Input::Norm(&l.attn_norm, eps), Input::Norm(&l.ffn_norm, eps));
        time("matmul qkv (normed input)", &mut || {
            launch::matmul_in(&cl, &l.wqkv, &io.x, attn_norm, t, &io.qkv, false);
            Ok(())
        })?;
        time("rope_kv_store", &mut || {
            launch::rope_kv_store(&cl, sh, &io.qkv, pool, &self.cos, &self.sin, meta, None);
            Ok(())
        })?;
        // Both float attention kernels (the same bits; `AttentionKernel::
        // for_rows` picks by rows), alone and with RoPE and the K/V store
        // inside (a decode step's).
        let rope = FusedRope { cos: &self.cos, sin: &self.sin };
        for k in [launch::AttentionKernel::Head, launch::AttentionKernel::KvHead] {
            for (what, r) in [("", None), (" + RoPE/K-V store", Some(rope))] {
                time(&format!("attention {k:?}{what}"), &mut || {
                    let (q, o) = (&io.qkv, &io.attn);
                    let how = Attn::Float(r);
                    launch::paged_attention_with(&cl, sh, q, pool, o, meta, scale, 0, how, k);
                    Ok(())
                })?;
            }
        }
        // The residual adds go to `scratch`, not `x`.
        time("matmul o (+ residual)", &mut || {
            launch::matmul_in(&cl, &l.wo, &io.attn, Input::Rows, t, &scratch, true);
            Ok(())
        })?;
        time("matmul gate_up (normed input)", &mut || {
            launch::matmul_in(&cl, &l.w_gate_up, &io.x, ffn_norm, t, &io.gu, false);
            Ok(())
        })?;
        time("matmul down (SwiGLU input, + residual)", &mut || {
            launch::matmul_in(&cl, &l.w_down, &io.gu, Input::Glu, t, &scratch, true);
            Ok(())
        })?;
        time("output rms_norm", &mut || {
            launch::rms_norm(&cl, &io.x, &self.output_norm, &io.hl, &io.last, eps);
            Ok(())
        })?;
        time("lm_head", &mut || {
            launch::matmul(&cl, &self.lm_head, &io.hl, n, &io.logits);
            Ok(())
        })?;
        let wide = self.wide_fma();
        time("pick (argmax)", &mut || {
            launch::pick_rows(&cl, &io.logits, &io.pick, &io.picked, self.shape.vocab, wide);
            Ok(())
        })?;
        // Every row drawing at temperature 1 instead (the OpenAI default).
        let draws = DeviceBuf::upload(&cl, &[1.0f32, 0.5, 0.0, 0.0].repeat(n));
        time("pick (temperature draw)", &mut || {
            launch::pick_rows(&cl, &io.logits, &draws, &io.picked, self.shape.vocab, wide);
            Ok(())
        })?;
        // Every row a top-p draw instead: its best candidates selected.
        let tops = DeviceBuf::upload(&cl, &[1.0f32, -1.0, 1.0, 0.0].repeat(n));
        time("pick (top candidates)", &mut || {
            launch::pick_rows(&cl, &io.logits, &tops, &io.picked, self.shape.vocab, wide);
            Ok(())
        })?;
        // The bias and penalty additions before a pick: none (what every
        // replayed step launches), then 300 a row (the most biases a
        // request may give), each adding 0 (the logits stay as they are).
        let vocab = self.shape.vocab;
        if let Some(a) = &io.adjust {
            time("adjust (none)", &mut || {
                launch::adjust_rows(&cl, &io.logits, a, &io.pick, vocab, wide);
                Ok(())
            })?;
        }
        let bufs = |off: &[u32], ids: &[u32], mask_off: &[u32], words: &[u32]| {
            let a = launch::AdjustBufs::zeros(&cl, n, ids.len(), words.len());
            a.off.write(&cl, off);
            a.ids.write(&cl, ids);
            a.mask_off.write(&cl, mask_off);
            a.words.write(&cl, words);
            a
        };
        let mut row: Vec<u32> =
            (0..300.min(vocab as u32)).map(|i| i * 163 % vocab as u32).collect();
        row.sort_unstable();
        let off: Vec<u32> = (0..=n as u32).map(|r| r * row.len() as u32).collect();
        let many = bufs(&off, &row.repeat(n), &vec![0u32; n + 1], &[0u32]);
        time("adjust (300 a row)", &mut || {
            launch::adjust_rows(&cl, &io.logits, &many, &io.pick, vocab, wide);
            Ok(())
        })?;
        // The same with logprobs: each row's candidates selected before
        // its additions (`Pick::Scored`).
        let scored = DeviceBuf::upload(&cl, &[0.0f32, 0.0, 0.0, 1.0].repeat(n));
        time("adjust (300 a row, scored)", &mut || {
            launch::adjust_rows(&cl, &io.logits, &many, &scored, vocab, wide);
            Ok(())
        })?;
        // Every row under a grammar mask that allows every token (each
        // bit read, no logit written).
        let w = StepIo::mask_words(vocab);
        let mask_off: Vec<u32> = (0..=n as u32).map(|r| r * w as u32).collect();
        let masked = bufs(&vec![0u32; n + 1], &[0u32], &mask_off, &vec![u32::MAX; n * w]);
        time("adjust (grammar mask)", &mut || {
            launch::adjust_rows(&cl, &io.logits, &masked, &io.pick, vocab, wide);
            Ok(())
        })?;
        // Each matmul kernel on the largest two (they give the same bits;
        // `MatmulKernel::for_rows` picks by speed), gate/up also over rows
        // not normed (the norm's cost inside it).
        for k in launch::MatmulKernel::ALL {
            time(&format!("gate_up {k:?}"), &mut || {
                launch::matmul_with(&cl, &l.w_gate_up, &io.x, ffn_norm, t, &io.gu, false, k);
                Ok(())
            })?;
            time(&format!("gate_up {k:?}, rows input"), &mut || {
                launch::matmul_with(&cl, &l.w_gate_up, &io.x, Input::Rows, t, &io.gu, false, k);
                Ok(())
            })?;
            time(&format!("lm_head {k:?}"), &mut || {
                let (m, x, out) = (&self.lm_head, &io.hl, &io.logits);
                launch::matmul_with(&cl, m, x, Input::Rows, n, out, false, k);
                Ok(())
            })?;
        }
        // The CPU's arithmetic (`kernels::q8` and `exact`, `GCS_GPU_EXACT=1`):
        // the norm with its quantizer, quantizing an input, the matmuls
        // over it, and the exact ops.
        let acts = launch::QActs::new(&cl, t * self.shape.inter.max(self.shape.hidden));
        let wide_fma = self.wide_fma();
        time("add_rms_norm + quantize q8 exact", &mut || {
            let (x, d, w) = (&io.x, Some(&scratch), &l.ffn_norm);
            launch::add_rms_norm_q8(&cl, x, d, w, &normed, &io.all, eps, &acts);
            Ok(())
        })?;
        // Both q8 kernels (the same bits; `matmul_q8` picks by rows).
        for (name, tiled) in [("q8", false), ("q8 tiled", true)] {
            time(&format!("gate_up {name}"), &mut || {
                launch::matmul_q8_with(&cl, &l.w_gate_up, &acts, t, &io.gu, wide_fma, tiled);
                Ok(())
            })?;
            time(&format!("lm_head {name}"), &mut || {
                let (m, out) = (&self.lm_head, &io.logits);
                launch::matmul_q8_with(&cl, m, &acts, n, out, wide_fma, tiled);
                Ok(())
            })?;
        }
        let exact = Some(wide_fma);
        time("rope_kv_store exact", &mut || {
            launch::rope_kv_store(&cl, sh, &io.qkv, pool, &self.cos, &self.sin, meta, exact);
            Ok(())
        })?;
        time("attention exact (+ quantize q8)", &mut || {
            let how = Attn::Exact { wide: wide_fma, acts: &acts, rope: None };
            launch::paged_attention(&cl, sh, &io.qkv, pool, &io.attn, meta, scale, 0, how);
            Ok(())
        })?;
        time("attention exact (+ quantize q8, + RoPE/K-V store)", &mut || {
            let how = Attn::Exact { wide: wide_fma, acts: &acts, rope: Some(rope) };
            launch::paged_attention(&cl, sh, &io.qkv, pool, &io.attn, meta, scale, 0, how);
            Ok(())
        })?;
        time("swiglu + quantize q8 exact", &mut || {
            launch::quantize_q8(&cl, &io.gu, t, c.intermediate, &acts, exact);
            Ok(())
        })?;
        // The same step as a recorded graph (the decode path's replay).
        cl.graph_prepare().map_err(GpuError::server)?;
        self.launch_step(&io)?;
        io.picked.ids.read(&cl)?;
        cl.start_capture().map_err(GpuError::server)?;
        let launched = self.launch_step(&io);
        let graph = cl.stop_capture().map_err(GpuError::server)?;
        launched?;
        #[allow(unsafe_code)]
        // SAFETY: the graph's buffers (`io`, the weights, the pools) outlive
        // it (it drops at the end of this function) and `STEP` is held.
        time("step, graph replay", &mut || unsafe { graph.replay() }.map_err(GpuError::server))?;
        Ok(Anatomy { launches, parts })
    }
}
