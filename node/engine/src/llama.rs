//! Llama-architecture decoder as a burn [`Module`].
//!
//! Burn 0.22 tensors are backend-agnostic (`Tensor<D>`); the backend is
//! chosen by the [`Device`] at runtime (Flex on CPU, CUDA with the `cuda`
//! feature). Norms, RoPE, attention and activations run as burn ops; the
//! quantized projections run in [`crate::quant`]'s kernels because burn has
//! no matmul over GGUF blocks. The KV cache lives in [`KvCache`], outside the
//! immutable weights, so one model serves many sequences.

use std::sync::Arc;

use burn::module::{Module, Param};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Device, Tensor, TensorData};

use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
use crate::quant::QMatrix;

/// Hyper-parameters read from GGUF metadata (`llama.*`).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
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
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch = g.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(EngineError::Model {
                path: g.path.clone(),
                reason: format!("unsupported architecture {arch:?}"),
            });
        }
        let k = |s: &str| format!("{arch}.{s}");
        let hidden = g.get_u64(&k("embedding_length"))? as usize;
        let n_heads = g.get_u64(&k("attention.head_count"))? as usize;
        let n_kv_heads = g.get_u64(&k("attention.head_count_kv")).unwrap_or(n_heads as u64) as usize;
        let head_dim = g.get_u64(&k("rope.dimension_count")).map(|v| v as usize).unwrap_or(hidden / n_heads.max(1));
        let tok = g.tensor_info("token_embd.weight")?;
        let cfg = Self {
            n_layers: g.get_u64(&k("block_count"))? as usize,
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            intermediate: g.get_u64(&k("feed_forward_length"))? as usize,
            vocab: tok.dims.get(1).copied().unwrap_or(0) as usize,
            rope_base: g.get_f32(&k("rope.freq_base")).unwrap_or(10000.0),
            rms_eps: g.get_f32(&k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
            context_length: g.get_u64(&k("context_length")).unwrap_or(2048) as usize,
        };
        if cfg.n_heads == 0 || cfg.n_kv_heads == 0 || cfg.n_heads % cfg.n_kv_heads != 0 || cfg.head_dim % 2 != 0 {
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
    #[module(skip)]
    pub config: LlamaConfig,
    /// RoPE tables `[context, head_dim / 2]`.
    rope_cos: Tensor<2>,
    rope_sin: Tensor<2>,
}

/// Per-sequence key/value cache, kept outside the model weights.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Per layer: K and V, each `[n_kv_heads, len, head_dim]`.
    layers: Vec<Option<(Tensor<3>, Tensor<3>)>>,
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

/// One sequence's slice of a forward batch.
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
}

fn model_err(g: &GgufFile, reason: String) -> EngineError {
    EngineError::Model {
        path: g.path.clone(),
        reason,
    }
}

fn load_matrix(g: &GgufFile, name: &str) -> Result<QMatrix> {
    let info = g.tensor_info(name)?;
    if info.dims.len() != 2 {
        return Err(model_err(g, format!("{name}: expected 2 dims, got {:?}", info.dims)));
    }
    let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
    Ok(QMatrix::from_gguf(info.ggml_type, rows, cols, g.tensor_bytes(info)))
}

fn vec1(v: Vec<f32>, device: &Device) -> Param<Tensor<1>> {
    let n = v.len();
    Param::from_tensor(Tensor::from_data(TensorData::new(v, [n]), device))
}

fn fuse(g: &GgufFile, parts: Vec<QMatrix>, what: &str) -> Result<QMatrix> {
    let refs: Vec<&QMatrix> = parts.iter().collect();
    QMatrix::concat_rows(&refs).ok_or_else(|| model_err(g, format!("{what}: mixed quantization types")))
}

/// `y[n, rows] = x[n, cols] · Wᵀ` through the quantized CPU kernel.
fn qlinear(x: Tensor<2>, w: &QMatrix) -> Tensor<2> {
    let device = x.device();
    let [n, cols] = x.dims();
    debug_assert_eq!(cols, w.cols);
    let xd = x.into_data().try_into_vec::<f32>().expect("f32 activations");
    let mut out = vec![0f32; n * w.rows];
    w.matmul(&xd, n, &mut out);
    Tensor::from_data(TensorData::new(out, [n, w.rows]), &device)
}

/// RMSNorm over the last dim: `x / sqrt(mean(x²) + eps) * w`.
fn rms_norm(x: Tensor<2>, w: &Param<Tensor<1>>, eps: f32) -> Tensor<2> {
    let inv = x.clone().square().mean_dim(1).add_scalar(eps).sqrt().recip();
    x.mul(inv).mul(w.val().unsqueeze::<2>())
}

impl Llama {
    pub fn from_gguf(g: &GgufFile, device: &Device) -> Result<Self> {
        let config = LlamaConfig::from_gguf(g)?;
        let mut blocks = Vec::with_capacity(config.n_layers);
        for i in 0..config.n_layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let wqkv = fuse(g, vec![load_matrix(g, &p("attn_q"))?, load_matrix(g, &p("attn_k"))?, load_matrix(g, &p("attn_v"))?], "qkv")?;
            let w_gate_up = fuse(g, vec![load_matrix(g, &p("ffn_gate"))?, load_matrix(g, &p("ffn_up"))?], "gate/up")?;
            blocks.push(LlamaBlock {
                attn_norm: vec1(g.tensor_f32(&p("attn_norm"))?, device),
                ffn_norm: vec1(g.tensor_f32(&p("ffn_norm"))?, device),
                q: BlockWeights {
                    wqkv: Arc::new(wqkv),
                    wo: Arc::new(load_matrix(g, &p("attn_output"))?),
                    w_gate_up: Arc::new(w_gate_up),
                    w_down: Arc::new(load_matrix(g, &p("ffn_down"))?),
                },
            });
        }
        let embed = Arc::new(load_matrix(g, "token_embd.weight")?);
        let lm_head = match g.tensor_info("output.weight") {
            Ok(_) => Arc::new(load_matrix(g, "output.weight")?),
            Err(_) => embed.clone(),
        };
        let (rope_cos, rope_sin) = rope_tables(&config, device);
        tracing::info!(path = %g.path.display(), layers = config.n_layers, hidden = config.hidden, "loaded llama model");
        Ok(Self {
            blocks,
            output_norm: vec1(g.tensor_f32("output_norm.weight")?, device),
            embed,
            lm_head,
            config,
            rope_cos,
            rope_sin,
        })
    }

    /// Bytes of quantized weights held.
    pub fn weight_bytes(&self) -> usize {
        let b: usize = self
            .blocks
            .iter()
            .map(|b| b.q.wqkv.nbytes() + b.q.wo.nbytes() + b.q.w_gate_up.nbytes() + b.q.w_down.nbytes())
            .sum();
        b + self.embed.nbytes() + if Arc::ptr_eq(&self.embed, &self.lm_head) { 0 } else { self.lm_head.nbytes() }
    }

    /// Run a batch of sequences. Each sequence contributes `tokens.len()`
    /// new positions after what its cache already holds (prefill: many
    /// tokens; decode: one token per sequence, many sequences).
    ///
    /// Returns logits `[n_seqs, vocab]` for the last new token of each sequence.
    pub fn forward(&self, seqs: &mut [SeqInput<'_>]) -> Result<Tensor<2>> {
        let c = &self.config;
        let device = self.output_norm.val().device();
        let total: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        if total == 0 || seqs.iter().any(|s| s.tokens.is_empty()) {
            return Err(EngineError::InvalidRequest("empty token batch".into()));
        }
        for s in seqs.iter() {
            if s.cache.len + s.tokens.len() > c.context_length {
                return Err(EngineError::InvalidRequest(format!(
                    "sequence of {} tokens exceeds context length {}",
                    s.cache.len + s.tokens.len(),
                    c.context_length
                )));
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= c.vocab) {
                return Err(EngineError::InvalidRequest(format!("token id {t} out of range")));
            }
        }
        // Embedding lookup straight from the quantized table.
        let mut emb = vec![0f32; total * c.hidden];
        for (i, &t) in seqs.iter().flat_map(|s| s.tokens.iter()).enumerate() {
            self.embed.row_f32(t as usize, &mut emb[i * c.hidden..(i + 1) * c.hidden]);
        }
        let mut x: Tensor<2> = Tensor::from_data(TensorData::new(emb, [total, c.hidden]), &device);
        // Positions of every row, for RoPE.
        let positions: Vec<i64> = seqs
            .iter()
            .flat_map(|s| (s.cache.len..s.cache.len + s.tokens.len()).map(|p| p as i64))
            .collect();
        let pos = Tensor::<1, burn::tensor::Int>::from_data(TensorData::new(positions, [total]), &device);
        let cos = self.rope_cos.clone().select(0, pos.clone()); // [total, head_dim/2]
        let sin = self.rope_sin.clone().select(0, pos);

        for (li, blk) in self.blocks.iter().enumerate() {
            let h = rms_norm(x.clone(), &blk.attn_norm, c.rms_eps);
            let qkv = qlinear(h, &blk.q.wqkv);
            let attn = self.attention(li, qkv, &cos, &sin, seqs);
            x = x + qlinear(attn, &blk.q.wo);
            let h = rms_norm(x.clone(), &blk.ffn_norm, c.rms_eps);
            let gu = qlinear(h, &blk.q.w_gate_up);
            let g = gu.clone().slice([0..total, 0..c.intermediate]);
            let u = gu.slice([0..total, c.intermediate..2 * c.intermediate]);
            x = x + qlinear(silu(g) * u, &blk.q.w_down);
        }
        for s in seqs.iter_mut() {
            s.cache.len += s.tokens.len();
        }
        // Only the last row of each sequence needs logits.
        let mut last = Vec::with_capacity(seqs.len());
        let mut off = 0i64;
        for s in seqs.iter() {
            off += s.tokens.len() as i64;
            last.push(off - 1);
        }
        let n = last.len();
        let idx = Tensor::<1, burn::tensor::Int>::from_data(TensorData::new(last, [n]), &device);
        let x = x.select(0, idx);
        let x = rms_norm(x, &self.output_norm, c.rms_eps);
        Ok(qlinear(x, &self.lm_head))
    }

    /// Self-attention for all sequences of the batch at layer `li`.
    ///
    /// `qkv`: `[total, q_dim + 2 kv_dim]`; `cos`/`sin`: `[total, head_dim/2]`.
    /// Returns `[total, q_dim]`.
    fn attention(&self, li: usize, qkv: Tensor<2>, cos: &Tensor<2>, sin: &Tensor<2>, seqs: &mut [SeqInput<'_>]) -> Tensor<2> {
        let c = &self.config;
        let (hd, nh, nkv) = (c.head_dim, c.n_heads, c.n_kv_heads);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let total = qkv.dims()[0];
        let q = qkv.clone().slice([0..total, 0..qd]).reshape([total, nh, hd]);
        let k = qkv.clone().slice([0..total, qd..qd + kvd]).reshape([total, nkv, hd]);
        let v = qkv.slice([0..total, qd + kvd..qd + 2 * kvd]).reshape([total, nkv, hd]);
        let q = rope(q, cos, sin);
        let k = rope(k, cos, sin);
        let group = nh / nkv;
        let scale = 1.0 / (hd as f32).sqrt();
        let device = q.device();

        let mut outs = Vec::with_capacity(seqs.len());
        let mut row = 0;
        for s in seqs.iter_mut() {
            let t = s.tokens.len();
            let past = s.cache.len;
            // [t, nkv, hd] -> [nkv, t, hd]
            let kn = k.clone().slice([row..row + t, 0..nkv, 0..hd]).swap_dims(0, 1);
            let vn = v.clone().slice([row..row + t, 0..nkv, 0..hd]).swap_dims(0, 1);
            if s.cache.layers.len() < c.n_layers {
                s.cache.layers.resize(c.n_layers, None);
            }
            let (kc, vc) = match s.cache.layers[li].take() {
                Some((kc, vc)) => (Tensor::cat(vec![kc, kn], 1), Tensor::cat(vec![vc, vn], 1)),
                None => (kn, vn),
            };
            s.cache.layers[li] = Some((kc.clone(), vc.clone()));
            let l = past + t;
            // Heads sharing a KV head are stacked along the row axis:
            // q [t, nh, hd] -> [t, nkv, group, hd] -> [nkv, group*t, hd].
            let qs = q
                .clone()
                .slice([row..row + t, 0..nh, 0..hd])
                .reshape([t, nkv, group, hd])
                .permute([1, 2, 0, 3])
                .reshape([nkv, group * t, hd]);
            let scores = qs.matmul(kc.swap_dims(1, 2)).mul_scalar(scale); // [nkv, group*t, l]
            let scores = if t > 1 {
                // Causal mask: query i (absolute past+i) sees keys 0..=past+i.
                let mut m = vec![0f32; group * t * l];
                for gi in 0..group {
                    for i in 0..t {
                        for j in past + i + 1..l {
                            m[(gi * t + i) * l + j] = f32::NEG_INFINITY;
                        }
                    }
                }
                let mask = Tensor::<2>::from_data(TensorData::new(m, [group * t, l]), &device);
                scores + mask.unsqueeze::<3>()
            } else {
                scores
            };
            let probs = softmax(scores, 2);
            let o = probs.matmul(vc); // [nkv, group*t, hd]
            let o = o.reshape([nkv, group, t, hd]).permute([2, 0, 1, 3]).reshape([t, qd]);
            outs.push(o);
            row += t;
        }
        if outs.len() == 1 {
            outs.pop().expect("one output")
        } else {
            Tensor::cat(outs, 0)
        }
    }
}

/// Precompute RoPE cos/sin `[context, head_dim/2]`.
fn rope_tables(c: &LlamaConfig, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let half = c.head_dim / 2;
    let n = c.context_length;
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for p in 0..n {
        for i in 0..half {
            let freq = c.rope_base.powf(-2.0 * i as f32 / c.head_dim as f32);
            let a = p as f32 * freq;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (
        Tensor::from_data(TensorData::new(cos, [n, half]), device),
        Tensor::from_data(TensorData::new(sin, [n, half]), device),
    )
}

/// Rotary embedding in llama.cpp's "normal" style: adjacent pairs
/// `(x[2i], x[2i+1])` rotate together. GGUF conversion permuted the q/k
/// weights so that this matches the HF "rotate half" formulation.
///
/// `x`: `[t, heads, hd]`; `cos`/`sin`: `[t, hd/2]`.
fn rope(x: Tensor<3>, cos: &Tensor<2>, sin: &Tensor<2>) -> Tensor<3> {
    let [t, h, hd] = x.dims();
    let half = hd / 2;
    let x = x.reshape([t, h, half, 2]);
    let x0 = x.clone().slice([0..t, 0..h, 0..half, 0..1]);
    let x1 = x.slice([0..t, 0..h, 0..half, 1..2]);
    let c = cos.clone().reshape([t, 1, half, 1]);
    let s = sin.clone().reshape([t, 1, half, 1]);
    let o0 = x0.clone() * c.clone() - x1.clone() * s.clone();
    let o1 = x0 * s + x1 * c;
    Tensor::cat(vec![o0, o1], 3).reshape([t, h, hd])
}
