//! Llama-architecture decoder as a burn [`Module`]; `general.architecture`
//! selects `llama`, `qwen2` or `gemma3` (their additions are in
//! [`crate::qwen2`] and [`crate::gemma3`]).
//!
//! Burn 0.22 tensors are backend-agnostic (`Tensor<D>`); the backend is
//! chosen by the [`Device`] at runtime (Flex on CPU, CUDA with the `cuda`
//! feature). The module holds the norm weights as burn `Param`s and keeps
//! the residual stream and final row selection as burn tensors. The
//! quantized projections run in [`crate::quant`]'s kernels, because burn has
//! no matmul over GGUF blocks. RMSNorm, RoPE, attention and SwiGLU run as
//! host kernels ([`crate::attn`], [`crate::numerics`]) that follow
//! llama.cpp's float arithmetic, so that greedy outputs agree with it.
//! The KV cache lives in [`KvCache`], outside the immutable weights, so one
//! model serves many sequences.

use std::sync::Arc;

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor, TensorData};

use crate::attn::{attend, AttnShape, KvPool, LayerKv, PagedSeqRef, Rope};

use crate::error::{EngineError, Result};
use crate::gemma3::{geglu_rows, Gemma3Config, Gemma3Norms};
use crate::gguf::GgufFile;
use crate::numerics::{rms_norm_rows, swiglu_rows};
use crate::quant::profile::{self as prof, Op};
use crate::quant::QMatrix;
use crate::qwen2::{add_rows, output_bias, BlockBiases};

/// The architectures this decoder runs (`general.architecture`).
pub const ARCHITECTURES: [&str; 3] = ["llama", "qwen2", "gemma3"];

/// Gemma 3's RoPE tables are sized by the context; its files declare 32k,
/// which would cost 64 MiB of tables, so the served context is capped.
const GEMMA3_MAX_CONTEXT: usize = 8192;

/// Hyper-parameters read from GGUF metadata (`<arch>.*`).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// `general.architecture`: one of [`ARCHITECTURES`].
    pub arch: String,
    /// Set for gemma3 files.
    pub gemma3: Option<Gemma3Config>,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub context_length: usize,
}

impl LlamaConfig {
    /// Bytes of K/V one position takes in the paged pool (f16 K and V of
    /// every layer and KV head): what a shared KV budget is divided by.
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * 2 * self.n_layers * self.n_kv_heads * self.head_dim
    }

    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch = g.get_str("general.architecture")?;
        if !ARCHITECTURES.contains(&arch) {
            return Err(EngineError::Model {
                path: g.path.clone(),
                reason: format!(
                    "unsupported architecture {arch:?} (supported: {})",
                    ARCHITECTURES.join(", ")
                ),
            });
        }
        let k = |s: &str| format!("{arch}.{s}");
        let hidden = g.get_u64(&k("embedding_length"))? as usize;
        let n_heads = g.get_u64(&k("attention.head_count"))? as usize;
        let n_kv_heads =
            g.get_u64(&k("attention.head_count_kv")).unwrap_or(n_heads as u64) as usize;
        let head_dim = g
            .get_u64(&k("attention.key_length"))
            .or_else(|_| g.get_u64(&k("rope.dimension_count")))
            .map(|v| v as usize)
            .unwrap_or(hidden / n_heads.max(1));
        let tok = g.tensor_info("token_embd.weight")?;
        let gemma3 =
            if arch == "gemma3" { Some(Gemma3Config::from_gguf(g, head_dim)?) } else { None };
        let mut context_length = g.get_u64(&k("context_length")).unwrap_or(2048) as usize;
        if gemma3.is_some() {
            context_length = context_length.min(GEMMA3_MAX_CONTEXT);
        }
        let cfg = Self {
            arch: arch.to_string(),
            gemma3,
            n_layers: g.get_u64(&k("block_count"))? as usize,
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            intermediate: g.get_u64(&k("feed_forward_length"))? as usize,
            vocab: tok.dims.get(1).copied().unwrap_or(0) as usize,
            rope_base: g.get_f32(&k("rope.freq_base")).unwrap_or(10000.0),
            rms_eps: g.get_f32(&k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
            context_length,
        };
        if cfg.n_heads == 0
            || cfg.n_kv_heads == 0
            || !cfg.n_heads.is_multiple_of(cfg.n_kv_heads)
            || !cfg.head_dim.is_multiple_of(2)
        {
            return Err(EngineError::Model {
                path: g.path.clone(),
                reason: format!("inconsistent head configuration {cfg:?}"),
            });
        }
        Ok(cfg)
    }
}

/// Quantized projections of one block, fused where possible so that each
/// layer reads its weights in as few passes as possible.
#[derive(Debug, Clone)]
pub struct BlockWeights {
    /// `[q_dim + 2 * kv_dim, hidden]`: q, k, v stacked.
    pub wqkv: Arc<QMatrix>,
    /// `[hidden, q_dim]`
    pub wo: Arc<QMatrix>,
    /// `[2 * intermediate, hidden]`: gate then up.
    pub w_gate_up: Arc<QMatrix>,
    /// `[hidden, intermediate]`
    pub w_down: Arc<QMatrix>,
}

#[derive(Module, Debug)]
pub struct LlamaBlock {
    /// `[hidden]`
    pub attn_norm: Param<Tensor<1>>,
    /// `[hidden]`
    pub ffn_norm: Param<Tensor<1>>,
    #[module(skip)]
    pub q: BlockWeights,
    /// gemma3's QK and post norms.
    #[module(skip)]
    pub gemma3: Option<Gemma3Norms>,
    /// Q/K/V and output-projection biases (qwen2; optional in llama files).
    #[module(skip)]
    pub biases: BlockBiases,
}

#[derive(Module, Debug)]
pub struct Llama {
    pub blocks: Vec<LlamaBlock>,
    /// `[hidden]`
    pub output_norm: Param<Tensor<1>>,
    /// `[vocab, hidden]` token embeddings (quantized, looked up row-wise).
    #[module(skip)]
    pub embed: Arc<QMatrix>,
    /// `[vocab, hidden]`; the same matrix as `embed` when tied.
    #[module(skip)]
    pub lm_head: Arc<QMatrix>,
    /// `[vocab]` `output.bias` (some qwen2 files).
    #[module(skip)]
    pub lm_head_bias: Option<Vec<f32>>,
    #[module(skip)]
    pub config: LlamaConfig,
    #[module(skip)]
    rope: Arc<Rope>,
    /// gemma3's sliding-window layers' RoPE (another base, a window).
    #[module(skip)]
    rope_local: Option<Arc<Rope>>,
}

/// Per-sequence key/value cache, kept outside the model weights.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Per layer: keys `[len, n_kv_heads, head_dim]` and values (transposed).
    layers: Vec<LayerKv>,
    len: usize,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }
    /// Number of positions already cached.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// One sequence's slice of a paged forward batch.
#[derive(Debug, Clone, Copy)]
pub struct PagedSeq<'a> {
    pub tokens: &'a [u32],
    /// Positions already in the pool for this sequence.
    pub past: usize,
    /// Block table covering at least `past + tokens.len()` positions.
    pub table: &'a [u32],
    /// First position computed in decode (single-row) order; see
    /// [`PagedSeqRef::decode_from`].
    pub decode_from: usize,
}

/// One sequence's slice of a forward batch.
#[derive(Debug)]
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
}

fn model_err(g: &GgufFile, reason: String) -> EngineError {
    EngineError::Model { path: g.path.clone(), reason }
}

/// Load a `[rows, cols]` matrix, checking its shape against the config so a
/// corrupt file is an error here rather than a panic in a kernel.
fn load_matrix(g: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<QMatrix> {
    let info = g.tensor_info(name)?;
    if info.dims.len() != 2 || info.dims[0] as usize != cols || info.dims[1] as usize != rows {
        return Err(model_err(
            g,
            format!("{name}: expected [{cols}, {rows}], got {:?}", info.dims),
        ));
    }
    Ok(QMatrix::from_gguf(info.ggml_type, rows, cols, g.tensor_bytes(info)))
}

fn load_norm(g: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>> {
    let v = g.tensor_f32(name)?;
    if v.len() != n {
        return Err(model_err(g, format!("{name}: expected {n} values, got {}", v.len())));
    }
    Ok(v)
}

fn vec1(v: Vec<f32>, device: &Device) -> Param<Tensor<1>> {
    let n = v.len();
    Param::from_tensor(Tensor::from_data(TensorData::new(v, [n]), device))
}

/// One matrix from row-stacked parts: fused when their types agree, else
/// stacked (K-quant files mix types within a layer's q/k/v).
fn fuse(g: &GgufFile, parts: Vec<QMatrix>, what: &str) -> Result<QMatrix> {
    let refs: Vec<&QMatrix> = parts.iter().collect();
    if let Some(m) = QMatrix::concat_rows(&refs) {
        return Ok(m);
    }
    QMatrix::stack(parts).ok_or_else(|| model_err(g, format!("{what}: parts of unequal width")))
}

/// Copy a float tensor to host memory.
#[allow(clippy::expect_used)] // the expect guards an invariant of the code right here
fn host<const D: usize>(x: Tensor<D>) -> Vec<f32> {
    // The model only ever creates f32 tensors, so the cast cannot fail.
    x.into_data().try_into_vec::<f32>().expect("f32 activations")
}

/// RMSNorm over the last dim, `x / sqrt(mean(x²) + eps) * w`, returned on
/// the host (it feeds a quantized matmul). Computed with llama.cpp's exact
/// arithmetic (f64 sum) rather than burn ops: greedy parity depends on it.
fn rms_norm(x: Tensor<2>, w: &Param<Tensor<1>>, eps: f32) -> Vec<f32> {
    let mut v = host(x);
    rms_norm_rows(&mut v, &host(w.val()), eps);
    v
}

impl Llama {
    pub fn from_gguf(g: &GgufFile, device: &Device) -> Result<Self> {
        Self::from_gguf_capped(g, device, None)
    }

    /// [`Llama::from_gguf`] serving at most `max_context` positions (the
    /// operator's `--ctx`): the RoPE tables and every length check follow
    /// the capped context.
    pub fn from_gguf_capped(
        g: &GgufFile,
        device: &Device,
        max_context: Option<usize>,
    ) -> Result<Self> {
        let mut config = LlamaConfig::from_gguf(g)?;
        if let Some(cap) = max_context {
            config.context_length = config.context_length.min(cap.max(1));
        }
        let mut blocks = Vec::with_capacity(config.n_layers);
        for i in 0..config.n_layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let (h, qd, kvd, ff) = (
                config.hidden,
                config.n_heads * config.head_dim,
                config.n_kv_heads * config.head_dim,
                config.intermediate,
            );
            let wqkv = fuse(
                g,
                vec![
                    load_matrix(g, &p("attn_q"), qd, h)?,
                    load_matrix(g, &p("attn_k"), kvd, h)?,
                    load_matrix(g, &p("attn_v"), kvd, h)?,
                ],
                "qkv",
            )?;
            let w_gate_up = fuse(
                g,
                vec![load_matrix(g, &p("ffn_gate"), ff, h)?, load_matrix(g, &p("ffn_up"), ff, h)?],
                "gate/up",
            )?;
            let gemma3 = match config.gemma3 {
                None => None,
                Some(_) => Some(Gemma3Norms {
                    q_norm: load_norm(g, &p("attn_q_norm"), config.head_dim)?,
                    k_norm: load_norm(g, &p("attn_k_norm"), config.head_dim)?,
                    post_attn: load_norm(g, &p("post_attention_norm"), h)?,
                    post_ffn: load_norm(g, &p("post_ffw_norm"), h)?,
                }),
            };
            blocks.push(LlamaBlock {
                gemma3,
                biases: BlockBiases::load(g, i, qd, kvd, h)?,
                attn_norm: vec1(load_norm(g, &p("attn_norm"), h)?, device),
                ffn_norm: vec1(load_norm(g, &p("ffn_norm"), h)?, device),
                q: BlockWeights {
                    wqkv: Arc::new(wqkv),
                    wo: Arc::new(load_matrix(g, &p("attn_output"), h, qd)?),
                    w_gate_up: Arc::new(w_gate_up),
                    w_down: Arc::new(load_matrix(g, &p("ffn_down"), h, ff)?),
                },
            });
        }
        let embed = Arc::new(load_matrix(g, "token_embd.weight", config.vocab, config.hidden)?);
        let lm_head = match g.tensor_info("output.weight") {
            Ok(_) => Arc::new(load_matrix(g, "output.weight", config.vocab, config.hidden)?),
            Err(_) => embed.clone(),
        };
        let (hd, ctx) = (config.head_dim, config.context_length);
        let mut rope = Rope::new(hd, config.rope_base, ctx);
        let mut rope_local = None;
        if let Some(gc) = &config.gemma3 {
            // Q is pre-scaled by attn_scale, so scores are scaled by 1.
            rope = rope.with_layout(true, None, 1.0);
            rope_local = Some(Arc::new(Rope::new(hd, gc.rope_base_local, ctx).with_layout(
                true,
                Some(gc.sliding_window),
                1.0,
            )));
        }
        if config.arch == "qwen2" {
            rope = rope.with_layout(true, None, 1.0 / (hd as f32).sqrt());
        }
        let rope = Arc::new(rope);
        tracing::info!(path = %g.path.display(), arch = %config.arch, layers = config.n_layers, hidden = config.hidden, "loaded model");
        Ok(Self {
            blocks,
            output_norm: vec1(load_norm(g, "output_norm.weight", config.hidden)?, device),
            lm_head_bias: output_bias(g, config.vocab)?,
            embed,
            lm_head,
            config,
            rope,
            rope_local,
        })
    }

    /// RoPE (and window) of layer `li`.
    fn rope_for(&self, li: usize) -> &Rope {
        match (&self.rope_local, &self.config.gemma3) {
            (Some(local), Some(gc)) if gc.is_local(li) => local,
            _ => &self.rope,
        }
    }

    /// Bytes of quantized weights held.
    pub fn weight_bytes(&self) -> usize {
        let b: usize = self
            .blocks
            .iter()
            .map(|b| {
                b.q.wqkv.nbytes() + b.q.wo.nbytes() + b.q.w_gate_up.nbytes() + b.q.w_down.nbytes()
            })
            .sum();
        b + self.embed.nbytes()
            + if Arc::ptr_eq(&self.embed, &self.lm_head) { 0 } else { self.lm_head.nbytes() }
    }

    /// Run a batch of sequences. Each sequence contributes `tokens.len()`
    /// new positions after what its cache already holds (prefill: many
    /// tokens; decode: one token per sequence, many sequences).
    ///
    /// Returns logits `[n_seqs, vocab]` for the last new token of each sequence.
    pub fn forward(&self, seqs: &mut [SeqInput<'_>]) -> Result<Tensor<2>> {
        let c = &self.config;
        for s in seqs.iter() {
            self.check_len(s.cache.len, s.tokens.len())?;
        }
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let lens: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
        for s in seqs.iter_mut() {
            if s.cache.layers.len() < c.n_layers {
                s.cache.layers.resize(c.n_layers, LayerKv::default());
            }
        }
        let sh = self.shape();
        let (qd, width) = (c.n_heads * c.head_dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim);
        let logits = self.forward_core(&tokens, &lens, &|| false, |li, qkv, attn| {
            let mut row = 0;
            for s in seqs.iter_mut() {
                let t = s.tokens.len();
                let past = s.cache.len;
                attend(
                    sh,
                    self.rope_for(li),
                    &mut qkv[row * width..(row + t) * width],
                    past,
                    &mut s.cache.layers[li],
                    &mut attn[row * qd..(row + t) * qd],
                );
                row += t;
            }
        })?;
        for s in seqs.iter_mut() {
            s.cache.len += s.tokens.len();
        }
        let device = self.output_norm.val().device();
        let n = seqs.len();
        Ok(Tensor::from_data(TensorData::new(logits, [n, self.lm_head.rows]), &device))
    }

    /// Like [`Llama::forward`], with K/V in a shared paged [`KvPool`]
    /// addressed by each sequence's block table. Returns host logits
    /// `[n_seqs * vocab]` for the last new token of each sequence.
    pub fn forward_paged(&self, pool: &mut KvPool, seqs: &[PagedSeq<'_>]) -> Result<Vec<f32>> {
        self.forward_paged_until(pool, seqs, &|| false)
    }

    /// [`Llama::forward_paged`] that gives up with [`EngineError::Yielded`]
    /// at a layer boundary once `stop()` holds. What it wrote to the pool
    /// lies at positions no sequence has committed; the same step run
    /// again overwrites them.
    pub fn forward_paged_until(
        &self,
        pool: &mut KvPool,
        seqs: &[PagedSeq<'_>],
        stop: &dyn Fn() -> bool,
    ) -> Result<Vec<f32>> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if pool.n_layers() != self.config.n_layers {
            return bad(format!("KV pool has {} layers", pool.n_layers()));
        }
        for s in seqs {
            self.check_len(s.past, s.tokens.len())?;
            let need = (s.past + s.tokens.len()).div_ceil(crate::paged::BLOCK_SIZE);
            if s.table.len() < need || s.table.iter().any(|&b| b as usize >= pool.n_blocks()) {
                return bad(format!("block table {:?} cannot hold {need} blocks", s.table));
            }
        }
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let lens: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
        let refs: Vec<PagedSeqRef<'_>> = seqs
            .iter()
            .map(|s| PagedSeqRef {
                past: s.past,
                t: s.tokens.len(),
                table: s.table,
                decode_from: s.decode_from,
            })
            .collect();
        self.forward_core(&tokens, &lens, stop, |li, qkv, attn| {
            pool.attend(li, self.rope_for(li), qkv, &refs, attn);
        })
    }

    /// Attention shape of this model.
    pub fn shape(&self) -> AttnShape {
        let c = &self.config;
        AttnShape { n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim }
    }

    /// A paged K/V pool of `n_blocks` blocks for this model.
    pub fn new_kv_pool(&self, n_blocks: usize) -> KvPool {
        KvPool::new(self.config.n_layers, self.shape(), n_blocks)
    }

    fn check_len(&self, past: usize, t: usize) -> Result<()> {
        let ctx = self.config.context_length;
        if t == 0 {
            return Err(EngineError::InvalidRequest("empty token batch".into()));
        }
        if past + t > ctx {
            return Err(EngineError::InvalidRequest(format!(
                "sequence of {} tokens exceeds context length {ctx}",
                past + t
            )));
        }
        Ok(())
    }

    /// The layer stack over `tokens` (all sequences' new tokens, `lens`
    /// per sequence); `attend_layer(li, qkv, attn_out)` does RoPE, K/V
    /// storage and attention. Returns host logits of each sequence's last row.
    fn forward_core(
        &self,
        tokens: &[u32],
        lens: &[usize],
        stop: &dyn Fn() -> bool,
        mut attend_layer: impl FnMut(usize, &mut [f32], &mut [f32]),
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let device = self.output_norm.val().device();
        let total = tokens.len();
        if total == 0 || lens.contains(&0) {
            return Err(EngineError::InvalidRequest("empty token batch".into()));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab) {
            return Err(EngineError::InvalidRequest(format!("token id {t} out of range")));
        }
        let t = prof::start();
        // Embedding lookup straight from the quantized table.
        let mut emb = vec![0f32; total * c.hidden];
        for (i, &t) in tokens.iter().enumerate() {
            self.embed.row_f32(t as usize, &mut emb[i * c.hidden..(i + 1) * c.hidden]);
        }
        if c.gemma3.is_some() {
            let s = (c.hidden as f32).sqrt();
            emb.iter_mut().for_each(|v| *v *= s);
        }
        let mut x: Tensor<2> = Tensor::from_data(TensorData::new(emb, [total, c.hidden]), &device);
        prof::stop(t, Op::Embed);
        let (qd, width) = (c.n_heads * c.head_dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim);
        let mut attn = vec![0f32; total * qd];
        for (li, blk) in self.blocks.iter().enumerate() {
            if li > 0 && stop() {
                return Err(EngineError::Yielded);
            }
            // Attention: x += Wo · attn(rope(Wqkv · norm(x)))
            let t = prof::start();
            let h = rms_norm(x.clone(), &blk.attn_norm, c.rms_eps);
            prof::stop(t, Op::Norm);
            let mut qkv = vec![0f32; total * width];
            blk.q.wqkv.matmul(&h, total, &mut qkv);
            let t = prof::start();
            if let Some(b) = &blk.biases.qkv {
                add_rows(&mut qkv, b);
            }
            if let (Some(gn), Some(gc)) = (&blk.gemma3, &c.gemma3) {
                gemma3_qk(&mut qkv, width, qd, gn, gc.attn_scale, c.rms_eps);
            }
            prof::stop(t, Op::QkNorm);
            let t = prof::start();
            attend_layer(li, &mut qkv, &mut attn);
            prof::stop(t, Op::Attention);
            let mut o = vec![0f32; total * c.hidden];
            blk.q.wo.matmul(&attn, total, &mut o);
            let t = prof::start();
            if let Some(b) = &blk.biases.attn_out {
                add_rows(&mut o, b);
            }
            if let Some(gn) = &blk.gemma3 {
                rms_norm_rows(&mut o, &gn.post_attn, c.rms_eps);
            }
            prof::stop(t, Op::Norm);
            let t = prof::start();
            x = x + Tensor::from_data(TensorData::new(o, [total, c.hidden]), &device);
            prof::stop(t, Op::Residual);

            // Feed-forward: x += W_down · (silu(W_gate · h) * (W_up · h))
            let t = prof::start();
            let h = rms_norm(x.clone(), &blk.ffn_norm, c.rms_eps);
            prof::stop(t, Op::Norm);
            let mut gu = vec![0f32; total * 2 * c.intermediate];
            blk.q.w_gate_up.matmul(&h, total, &mut gu);
            let t = prof::start();
            let mut act = vec![0f32; total * c.intermediate];
            let inter = c.intermediate;
            let glu = if c.gemma3.is_some() { geglu_rows } else { swiglu_rows };
            // Rows in parallel in a prefill (each element alone: same bits).
            let per = if total >= 8 { total.div_ceil(crate::par::threads()) } else { total }.max(1);
            crate::par::for_each_chunk_mut(&mut act, per * inter, |i, a| {
                glu(&gu[i * per * 2 * inter..][..2 * a.len()], a, inter)
            });
            prof::stop(t, Op::Act);
            let mut d = vec![0f32; total * c.hidden];
            blk.q.w_down.matmul(&act, total, &mut d);
            let t = prof::start();
            if let Some(gn) = &blk.gemma3 {
                rms_norm_rows(&mut d, &gn.post_ffn, c.rms_eps);
            }
            prof::stop(t, Op::Norm);
            let t = prof::start();
            x = x + Tensor::from_data(TensorData::new(d, [total, c.hidden]), &device);
            prof::stop(t, Op::Residual);
        }
        let t = prof::start();
        // Only the last row of each sequence needs logits.
        let mut last = Vec::with_capacity(lens.len());
        let mut off = 0i64;
        for &l in lens {
            off += l as i64;
            last.push(off - 1);
        }
        let n = last.len();
        let idx = Tensor::<1, burn::tensor::Int>::from_data(TensorData::new(last, [n]), &device);
        let x = x.select(0, idx);
        let h = rms_norm(x, &self.output_norm, c.rms_eps);
        prof::stop(t, Op::OutputNorm);
        let mut logits = vec![0f32; n * self.lm_head.rows];
        prof::lm_head(|| self.lm_head.matmul(&h, n, &mut logits));
        let t = prof::start();
        if let Some(b) = &self.lm_head_bias {
            add_rows(&mut logits, b);
        }
        if let Some(cap) = c.gemma3.as_ref().and_then(|gc| gc.final_softcap) {
            // ggml_scale(1/cap), tanh, ggml_scale(cap).
            let inv = 1.0 / cap;
            logits.iter_mut().for_each(|l| *l = (*l * inv).tanh() * cap);
        }
        prof::stop(t, Op::Logits);
        Ok(logits)
    }
}

/// gemma3: RMS-normalise every Q and K head of each `qkv` row and scale Q
/// (before RoPE, which commutes with a power-of-two scale exactly).
fn gemma3_qk(qkv: &mut [f32], width: usize, qd: usize, gn: &Gemma3Norms, scale: f32, eps: f32) {
    let hd = gn.q_norm.len();
    for row in qkv.chunks_exact_mut(width) {
        let (q, rest) = row.split_at_mut(qd);
        let kvd = (width - qd) / 2;
        rms_norm_rows(q, &gn.q_norm, eps);
        rms_norm_rows(&mut rest[..kvd], &gn.k_norm, eps);
        q.iter_mut().for_each(|v| *v *= scale);
        debug_assert_eq!(q.len() % hd, 0);
    }
}
