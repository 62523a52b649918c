//! BERT sentence embeddings (all-MiniLM-L6-v2): encoder forward, mean
//! pooling over the attention mask and L2 normalisation, batched with padding.

use std::path::{Path, PathBuf};

use burn::module::{Module, Param};
use burn::tensor::activation::{gelu, softmax};
use burn::tensor::{Device, Int, Tensor, TensorData};
use safetensors::SafeTensors;
use serde::Deserialize;
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

use crate::error::{EngineError, Result};

#[derive(Debug, Clone, Deserialize)]
pub struct BertConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
}

fn default_eps() -> f64 {
    1e-12
}

/// Dense layer with weight stored `[in, out]` so `y = x · W + b`.
#[derive(Module, Debug)]
pub struct Dense {
    pub weight: Param<Tensor<2>>,
    pub bias: Param<Tensor<1>>,
}

impl Dense {
    /// `x`: `[n, in]` -> `[n, out]`
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        x.matmul(self.weight.val()) + self.bias.val().unsqueeze::<2>()
    }
}

#[derive(Module, Debug)]
pub struct Norm {
    pub gamma: Param<Tensor<1>>,
    pub beta: Param<Tensor<1>>,
}

#[derive(Module, Debug)]
pub struct BertLayer {
    pub query: Dense,
    pub key: Dense,
    pub value: Dense,
    pub attn_out: Dense,
    pub attn_norm: Norm,
    pub inter: Dense,
    pub out: Dense,
    pub out_norm: Norm,
}

#[derive(Module, Debug)]
pub struct Bert {
    /// `[vocab, hidden]`
    pub word: Param<Tensor<2>>,
    /// `[max_pos, hidden]`
    pub position: Param<Tensor<2>>,
    /// `[2, hidden]`
    pub token_type: Param<Tensor<2>>,
    pub emb_norm: Norm,
    pub layers: Vec<BertLayer>,
    #[module(skip)]
    pub n_heads: usize,
    #[module(skip)]
    pub eps: f32,
}

/// Tokenizer + encoder for sentence embeddings.
pub struct Embedder {
    pub model: Bert,
    tokenizer: Tokenizer,
    device: Device,
    pub dim: usize,
}

impl std::fmt::Debug for Embedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedder").field("dim", &self.dim).finish()
    }
}

fn model_err(path: &Path, reason: impl std::fmt::Display) -> EngineError {
    EngineError::Model { path: path.to_path_buf(), reason: reason.to_string() }
}

struct Loader<'a> {
    st: SafeTensors<'a>,
    path: PathBuf,
    device: Device,
}

impl Loader<'_> {
    fn raw(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let t = self.st.tensor(name).map_err(|e| model_err(&self.path, format!("{name}: {e}")))?;
        if t.dtype() != safetensors::Dtype::F32 {
            return Err(model_err(
                &self.path,
                format!("{name}: expected F32, got {:?}", t.dtype()),
            ));
        }
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok((v, t.shape().to_vec()))
    }
    fn t1(&self, name: &str) -> Result<Param<Tensor<1>>> {
        let (v, s) = self.raw(name)?;
        if s.len() != 1 {
            return Err(model_err(&self.path, format!("{name}: expected 1 dim, got {s:?}")));
        }
        Ok(Param::from_tensor(Tensor::from_data(TensorData::new(v, [s[0]]), &self.device)))
    }
    fn t2(&self, name: &str) -> Result<Tensor<2>> {
        let (v, s) = self.raw(name)?;
        if s.len() != 2 {
            return Err(model_err(&self.path, format!("{name}: expected 2 dims, got {s:?}")));
        }
        Ok(Tensor::from_data(TensorData::new(v, [s[0], s[1]]), &self.device))
    }
    fn dense(&self, p: &str) -> Result<Dense> {
        // PyTorch stores [out, in]; transpose once at load time.
        let w = self.t2(&format!("{p}.weight"))?.transpose();
        let w = Tensor::from_data(w.into_data(), &self.device);
        Ok(Dense { weight: Param::from_tensor(w), bias: self.t1(&format!("{p}.bias"))? })
    }
    fn norm(&self, p: &str) -> Result<Norm> {
        Ok(Norm { gamma: self.t1(&format!("{p}.weight"))?, beta: self.t1(&format!("{p}.bias"))? })
    }
}

fn layer_norm(x: Tensor<2>, n: &Norm, eps: f32) -> Tensor<2> {
    let mean = x.clone().mean_dim(1);
    let xc = x - mean;
    let var = xc.clone().square().mean_dim(1);
    xc.div(var.add_scalar(eps).sqrt()) * n.gamma.val().unsqueeze::<2>()
        + n.beta.val().unsqueeze::<2>()
}

impl Bert {
    /// `ids`, `mask`: `[b, l]` (mask 1 for real tokens). Returns hidden
    /// states `[b * l, hidden]`.
    pub fn forward(&self, ids: Tensor<2, Int>, mask: Tensor<2>) -> Tensor<2> {
        let [b, l] = ids.dims();
        let hidden = self.word.val().dims()[1];
        let flat = ids.reshape([b * l]);
        let word = self.word.val().select(0, flat);
        let pos = self
            .position
            .val()
            .slice([0..l, 0..hidden])
            .unsqueeze::<3>()
            .repeat_dim(0, b)
            .reshape([b * l, hidden]);
        let tt = self.token_type.val().slice([0..1, 0..hidden]);
        let mut x = layer_norm(word + pos + tt, &self.emb_norm, self.eps);

        let nh = self.n_heads;
        let hd = hidden / nh;
        // Additive mask [b, 1, 1, l]: padded keys get a large negative score.
        let bias = (mask.ones_like() - mask).mul_scalar(-1e9f32).reshape([b, 1, 1, l]);
        let scale = 1.0 / (hd as f32).sqrt();
        for layer in &self.layers {
            let heads = |t: Tensor<2>| t.reshape([b, l, nh, hd]).swap_dims(1, 2); // [b, nh, l, hd]
            let q = heads(layer.query.forward(x.clone()));
            let k = heads(layer.key.forward(x.clone()));
            let v = heads(layer.value.forward(x.clone()));
            let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale) + bias.clone();
            let ctx = softmax(scores, 3).matmul(v).swap_dims(1, 2).reshape([b * l, hidden]);
            x = layer_norm(x + layer.attn_out.forward(ctx), &layer.attn_norm, self.eps);
            let h = gelu(layer.inter.forward(x.clone()));
            x = layer_norm(x + layer.out.forward(h), &layer.out_norm, self.eps);
        }
        x
    }
}

impl Embedder {
    /// Load from a sentence-transformers directory (config.json,
    /// model.safetensors, tokenizer.json).
    pub fn load(dir: impl AsRef<Path>, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read(&p).map_err(|source| EngineError::Io { path: p, source })
        };
        let cfg_path = dir.join("config.json");
        let cfg: BertConfig =
            serde_json::from_slice(&read("config.json")?).map_err(|e| model_err(&cfg_path, e))?;
        let st_path = dir.join("model.safetensors");
        let bytes = read("model.safetensors")?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| model_err(&st_path, e))?;
        let ld = Loader { st, path: st_path, device: device.clone() };
        // Some exports prefix every name with "bert.".
        let pre =
            if ld.st.tensor("embeddings.word_embeddings.weight").is_ok() { "" } else { "bert." };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("{pre}encoder.layer.{i}");
            layers.push(BertLayer {
                query: ld.dense(&format!("{p}.attention.self.query"))?,
                key: ld.dense(&format!("{p}.attention.self.key"))?,
                value: ld.dense(&format!("{p}.attention.self.value"))?,
                attn_out: ld.dense(&format!("{p}.attention.output.dense"))?,
                attn_norm: ld.norm(&format!("{p}.attention.output.LayerNorm"))?,
                inter: ld.dense(&format!("{p}.intermediate.dense"))?,
                out: ld.dense(&format!("{p}.output.dense"))?,
                out_norm: ld.norm(&format!("{p}.output.LayerNorm"))?,
            });
        }
        let model = Bert {
            word: Param::from_tensor(ld.t2(&format!("{pre}embeddings.word_embeddings.weight"))?),
            position: Param::from_tensor(
                ld.t2(&format!("{pre}embeddings.position_embeddings.weight"))?,
            ),
            token_type: Param::from_tensor(
                ld.t2(&format!("{pre}embeddings.token_type_embeddings.weight"))?,
            ),
            emb_norm: ld.norm(&format!("{pre}embeddings.LayerNorm"))?,
            layers,
            n_heads: cfg.num_attention_heads,
            eps: cfg.layer_norm_eps as f32,
        };

        let tok_path = dir.join("tokenizer.json");
        let mut tokenizer =
            Tokenizer::from_bytes(read("tokenizer.json")?).map_err(|e| model_err(&tok_path, e))?;
        // sentence-transformers truncates at max_seq_length (256 for this
        // model) and pads per batch, not to the fixed 128 in tokenizer.json.
        let max_len = std::fs::read(dir.join("sentence_bert_config.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| v.get("max_seq_length").and_then(|m| m.as_u64()))
            .map(|m| m as usize)
            .unwrap_or(cfg.max_position_embeddings)
            .min(cfg.max_position_embeddings);
        tokenizer
            .with_truncation(Some(TruncationParams { max_length: max_len, ..Default::default() }))
            .map_err(|e| model_err(&tok_path, e))?;
        tokenizer.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            ..Default::default()
        }));
        tracing::info!(dir = %dir.display(), layers = cfg.num_hidden_layers, "loaded bert embedder");
        Ok(Self { model, tokenizer, device: device.clone(), dim: cfg.hidden_size })
    }

    /// Embed a batch of texts: mean-pooled, L2-normalised vectors.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        self.embed_counted(texts).map(|(v, _)| v)
    }

    /// [`Embedder::embed`], and the tokens the encoder read (after
    /// truncation, with the special tokens, without padding): the usage
    /// of the request.
    pub fn embed_counted(&self, texts: &[&str]) -> Result<(Vec<Vec<f32>>, usize)> {
        if texts.is_empty() {
            return Ok((Vec::new(), 0));
        }
        let encs = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        let b = encs.len();
        let l = encs[0].len();
        let mut ids = Vec::with_capacity(b * l);
        let mut mask = Vec::with_capacity(b * l);
        let mut tokens = 0;
        for e in &encs {
            ids.extend(e.get_ids().iter().map(|&i| i as i64));
            mask.extend(e.get_attention_mask().iter().map(|&m| m as f32));
            tokens += e.get_attention_mask().iter().filter(|&&m| m != 0).count();
        }
        let ids_t = Tensor::<2, Int>::from_data(TensorData::new(ids, [b, l]), &self.device);
        let mask_t = Tensor::<2>::from_data(TensorData::new(mask, [b, l]), &self.device);
        let h = self.model.forward(ids_t, mask_t.clone()).reshape([b, l, self.dim]);
        let m = mask_t.reshape([b, l, 1]);
        let summed = (h * m.clone()).sum_dim(1).reshape([b, self.dim]);
        let counts = m.sum_dim(1).reshape([b, 1]).clamp_min(1e-9);
        let mean = summed / counts;
        let norm = mean.clone().square().sum_dim(1).sqrt().clamp_min(1e-12);
        let out = (mean / norm)
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| EngineError::InvalidRequest(format!("embedding output: {e:?}")))?;
        Ok((out.chunks(self.dim).map(<[f32]>::to_vec).collect(), tokens))
    }
}
