//! [`GpuDecoder`]: the llama decoder's paged forward step on a CubeCL
//! device. Weights are uploaded once (GGUF blocks, dequantized inside the
//! matmul kernel), the K/V pool lives on the device, and each step uploads
//! only the batch's token ids, positions and block tables and copies back
//! the logits of each sequence's last row.

use burn::tensor::Tensor;
use cubecl::client::Client;

use super::kernels::attention::{HeadShape, BLOCK};
use super::launch::{self, LayerPool, RowMeta};
use super::weights::{check_model, rope_tables, GpuMatrix};
use super::{DeviceBuf, GpuError};
use crate::backend::{BackendKind, PagedDecoder};
use crate::error::{EngineError, Result};
use crate::llama::{Llama, LlamaConfig, PagedSeq};

#[derive(Debug)]
struct GpuLayer {
    attn_norm: DeviceBuf<f32>,
    ffn_norm: DeviceBuf<f32>,
    wqkv: GpuMatrix,
    wo: GpuMatrix,
    w_gate_up: GpuMatrix,
    w_down: GpuMatrix,
}

/// The llama decoder on a CubeCL device (CUDA, or wgpu in the tests).
pub struct GpuDecoder {
    client: Client,
    kind: BackendKind,
    config: LlamaConfig,
    sh: HeadShape,
    layers: Vec<GpuLayer>,
    output_norm: DeviceBuf<f32>,
    embed: GpuMatrix,
    lm_head: GpuMatrix,
    cos: DeviceBuf<f32>,
    sin: DeviceBuf<f32>,
    k_pool: DeviceBuf<f32>,
    v_pool: DeviceBuf<f32>,
    n_blocks: usize,
}

impl std::fmt::Debug for GpuDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDecoder")
            .field("kind", &self.kind)
            .field("arch", &self.config.arch)
            .field("layers", &self.layers.len())
            .field("kv_blocks", &self.n_blocks)
            .finish_non_exhaustive()
    }
}

fn host1(t: Tensor<1>) -> std::result::Result<Vec<f32>, GpuError> {
    t.into_data()
        .try_into_vec::<f32>()
        .map_err(|e| GpuError::Unsupported(format!("norm weights: {e:?}")))
}

impl GpuDecoder {
    /// Upload `model` to `client`'s device with a pool of `kv_blocks`
    /// K/V blocks. Refuses what the kernels do not cover yet
    /// ([`check_model`]: gemma3's extra norms, biases, weight types other
    /// than Q4_0/Q4_1/Q8_0).
    pub fn new(
        client: Client,
        kind: BackendKind,
        model: &Llama,
        kv_blocks: usize,
    ) -> std::result::Result<Self, GpuError> {
        check_model(model)?;
        let c = &model.config;
        let sh = HeadShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            neox: false,
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for b in &model.blocks {
            let up = |m| GpuMatrix::upload(&client, m);
            layers.push(GpuLayer {
                attn_norm: DeviceBuf::upload(&client, &host1(b.attn_norm.val())?),
                ffn_norm: DeviceBuf::upload(&client, &host1(b.ffn_norm.val())?),
                wqkv: up(&b.q.wqkv)?,
                wo: up(&b.q.wo)?,
                w_gate_up: up(&b.q.w_gate_up)?,
                w_down: up(&b.q.w_down)?,
            });
        }
        let embed = GpuMatrix::upload(&client, &model.embed)?;
        if embed.parts.len() != 1 {
            return Err(GpuError::Unsupported("a stacked embedding table".into()));
        }
        let lm_head = if std::sync::Arc::ptr_eq(&model.embed, &model.lm_head) {
            embed.clone()
        } else {
            GpuMatrix::upload(&client, &model.lm_head)?
        };
        let (cos, sin) = rope_tables(c.head_dim, c.rope_base, c.context_length);
        let pool_len = c.n_layers * kv_blocks * sh.block_len();
        if pool_len > i32::MAX as usize {
            return Err(GpuError::Unsupported(format!(
                "{kv_blocks} K/V blocks ({pool_len} elements a pool; the kernels' offsets are 32-bit)"
            )));
        }
        Ok(Self {
            output_norm: DeviceBuf::upload(&client, &host1(model.output_norm.val())?),
            cos: DeviceBuf::upload(&client, &cos),
            sin: DeviceBuf::upload(&client, &sin),
            // Uninitialised: attention reads only positions already written
            // (keys below the row's own), and a zeroed pool would cost a
            // host buffer of its size.
            k_pool: DeviceBuf::uninit(&client, pool_len),
            v_pool: DeviceBuf::uninit(&client, pool_len),
            n_blocks: kv_blocks,
            config: c.clone(),
            layers,
            embed,
            lm_head,
            sh,
            kind,
            client,
        })
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| l.wqkv.nbytes() + l.wo.nbytes() + l.w_gate_up.nbytes() + l.w_down.nbytes())
            .sum();
        l + self.embed.nbytes()
    }

    fn check(&self, seqs: &[PagedSeq<'_>]) -> Result<()> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if seqs.is_empty() {
            return bad("empty token batch".into());
        }
        for s in seqs {
            let t = s.tokens.len();
            if t == 0 {
                return bad("empty token batch".into());
            }
            if s.past + t > self.config.context_length {
                return bad(format!(
                    "sequence of {} tokens exceeds context length {}",
                    s.past + t,
                    self.config.context_length
                ));
            }
            let need = (s.past + t).div_ceil(BLOCK);
            if s.table.len() < need || s.table.iter().any(|&b| b as usize >= self.n_blocks) {
                return bad(format!("block table {:?} cannot hold {need} blocks", s.table));
            }
            if let Some(&tok) = s.tokens.iter().find(|&&tok| tok as usize >= self.config.vocab) {
                return bad(format!("token id {tok} out of range"));
            }
        }
        Ok(())
    }

    fn step(&self, seqs: &[PagedSeq<'_>]) -> std::result::Result<Vec<f32>, GpuError> {
        let (cl, c, sh) = (&self.client, &self.config, self.sh);
        let (mut tokens, mut pos, mut slot, mut table, mut tables, mut last) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        for s in seqs {
            let toff = tables.len() as u32;
            tables.extend_from_slice(s.table);
            for (i, &tok) in s.tokens.iter().enumerate() {
                let p = s.past + i;
                tokens.push(tok);
                pos.push(p as u32);
                slot.push(s.table[p / BLOCK] * BLOCK as u32 + (p % BLOCK) as u32);
                table.push(toff);
            }
            last.push(tokens.len() as u32 - 1);
        }
        let total = tokens.len();
        let meta = RowMeta {
            pos: DeviceBuf::upload(cl, &pos),
            slot: DeviceBuf::upload(cl, &slot),
            table: DeviceBuf::upload(cl, &table),
            tables: DeviceBuf::upload(cl, &tables),
        };
        let all: Vec<u32> = (0..total as u32).collect();
        let (all, last) = (DeviceBuf::upload(cl, &all), DeviceBuf::upload(cl, &last));
        let tok = DeviceBuf::upload(cl, &tokens);
        let (hid, qd) = (c.hidden, c.n_heads * c.head_dim);
        let buf = |n| DeviceBuf::<f32>::uninit(cl, n);
        let (x, h, qkv, attn, o) = (
            buf(total * hid),
            buf(total * hid),
            buf(total * sh.width()),
            buf(total * qd),
            buf(total * hid),
        );
        let (gu, act, d) =
            (buf(total * 2 * c.intermediate), buf(total * c.intermediate), buf(total * hid));
        launch::embed(cl, &self.embed, &tok, &x);
        let layer_len = self.n_blocks * sh.block_len();
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        for (li, l) in self.layers.iter().enumerate() {
            // x += previous layer's FFN output, fused with this norm.
            let prev = (li > 0).then_some(&d);
            launch::add_rms_norm(cl, &x, prev, &l.attn_norm, &h, &all, c.rms_eps);
            launch::matmul(cl, &l.wqkv, &h, total, &qkv);
            let pool = LayerPool { k: &self.k_pool, v: &self.v_pool, off: li * layer_len };
            launch::rope_kv_store(cl, sh, &qkv, pool, &self.cos, &self.sin, &meta);
            launch::paged_attention(cl, sh, &qkv, pool, &attn, &meta, scale, 0);
            launch::matmul(cl, &l.wo, &attn, total, &o);
            launch::add_rms_norm(cl, &x, Some(&o), &l.ffn_norm, &h, &all, c.rms_eps);
            launch::matmul(cl, &l.w_gate_up, &h, total, &gu);
            launch::swiglu(cl, &gu, &act, c.intermediate);
            launch::matmul(cl, &l.w_down, &act, total, &d);
        }
        // Only each sequence's last row: its residual, the output norm, logits.
        let n = seqs.len();
        let hl = buf(n * hid);
        launch::add_rms_norm(cl, &x, Some(&d), &self.output_norm, &hl, &last, c.rms_eps);
        let logits = buf(n * self.lm_head.rows);
        launch::matmul(cl, &self.lm_head, &hl, n, &logits);
        logits.read(cl)
    }
}

impl PagedDecoder for GpuDecoder {
    fn kind(&self) -> BackendKind {
        self.kind
    }
    fn config(&self) -> &LlamaConfig {
        &self.config
    }
    fn vocab(&self) -> usize {
        self.lm_head.rows
    }
    fn kv_blocks(&self) -> usize {
        self.n_blocks
    }
    fn kv_bytes_per_token(&self) -> usize {
        // f32 K and V (the CPU pool holds f16).
        2 * 4 * self.config.n_layers * self.sh.n_kv_heads * self.sh.head_dim
    }
    fn copy_block(&mut self, src: u32, dst: u32) {
        let n = self.config.n_layers;
        launch::copy_block(&self.client, self.sh, &self.k_pool, &self.v_pool, src, dst, n);
    }
    fn forward_paged(&mut self, seqs: &[PagedSeq<'_>]) -> Result<Vec<f32>> {
        self.check(seqs)?;
        self.step(seqs).map_err(|e| EngineError::Backend(e.to_string()))
    }
}
