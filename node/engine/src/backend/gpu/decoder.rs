//! [`GpuDecoder`]: the llama decoder's paged forward step on a CubeCL
//! device. Weights are uploaded once (GGUF blocks, dequantized inside the
//! matmul kernel), the K/V pool lives on the device, and each step uploads
//! only the batch's token ids, positions and block tables and copies back
//! the logits of each sequence's last row. A decode step replays a
//! recorded graph of its bucket (`graph.rs`); other steps launch eagerly.

use std::sync::Mutex;

use burn::tensor::Tensor;
use cubecl::client::Client;

use super::graph::{self, Bucket, Graphs};
use super::kernels::attention::{HeadShape, BLOCK};
use super::kernels::exact;
use super::kernels::top::TOP_MAX_VOCAB;
use super::launch::{self, Attn, FusedRope, Input, KvElem, LayerPool};
use super::step::{ExactIo, StepIo, StepShape};
use super::weights::{check_model, rope_tables, GpuMatrix};
use super::{DeviceBuf, GpuError};
use crate::backend::rows::HostRows;
use crate::backend::{Adjust, BackendKind, PagedDecoder, Pick, StepLogits};
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
    /// gemma3's extra norms.
    gemma: Option<GemmaNorms>,
}

/// A gemma3 layer's Q and K head norms and its post-attention and
/// post-FFN norms (`crate::gemma3::Gemma3Norms`).
#[derive(Debug)]
struct GemmaNorms {
    q: DeviceBuf<f32>,
    k: DeviceBuf<f32>,
    post_attn: DeviceBuf<f32>,
    post_ffn: DeviceBuf<f32>,
}

/// gemma3's sliding-window layers: their RoPE tables (another base) and
/// the keys a query sees, itself included.
#[derive(Debug)]
struct LocalAttn {
    cos: DeviceBuf<f32>,
    sin: DeviceBuf<f32>,
    window: usize,
}

/// One GPU step at a time in the process: a graph is recorded in CUDA's
/// global capture mode, in which another thread's allocation would fail
/// the capture (and two decoders on one GPU gain nothing by overlapping).
static STEP: Mutex<()> = Mutex::new(());

/// The largest buffer a weight part takes on wgpu: half of wgpu's
/// default binding limit (lavapipe refused Gemma's 189 MB table whole).
const WGPU_MAX_PART_BYTES: usize = crate::backend::WGPU_MAX_BUFFER_BYTES / 2;

/// The largest part a matrix is uploaded in on a `kind` device
/// ([`WGPU_MAX_PART_BYTES`] on wgpu; whole on CUDA).
fn max_part_bytes(kind: BackendKind) -> usize {
    if kind == BackendKind::Wgpu {
        WGPU_MAX_PART_BYTES
    } else {
        usize::MAX
    }
}

mod anatomy;
mod dense_step;
mod read;
pub use anatomy::{Anatomy, StepPart};

/// The llama decoder on a CubeCL device (CUDA, or wgpu in the tests).
pub struct GpuDecoder {
    /// First, so the recorded graphs go before the buffers they use.
    graphs: Graphs,
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
    /// gemma3's sliding-window layers' attention.
    local: Option<LocalAttn>,
    /// The embedding's scale (gemma3: `sqrt(hidden)`; else 1).
    embed_scale: f32,
    /// Q's scale after its norm (gemma3) and the scores' scale.
    q_scale: f32,
    score_scale: f32,
    k_pool: DeviceBuf<KvElem>,
    v_pool: DeviceBuf<KvElem>,
    n_blocks: usize,
    shape: StepShape,
    /// Each step ends with each sequence's token picked on the device, its
    /// argmax or its draw (off with `GCS_GPU_ARGMAX=0`: every step copies
    /// its logits back, and the host picks).
    device_pick: bool,
    /// The last step's logits, where a sequence may need its row after
    /// all ([`Pick::Top`], [`PagedDecoder::last_logits`]).
    kept: Option<DeviceBuf<f32>>,
    /// f16 copies of the matrices, multiplied by cubek's routines instead
    /// of the quantized kernels in steps of this many rows or more
    /// ([`GpuDecoder::with_dense`]).
    dense: Option<(super::dense::DenseWeights, usize)>,
}

/// A step's output, and its logits' buffer where they may be asked for
/// after it ([`GpuDecoder::read_out`]).
struct Read {
    out: StepLogits,
    kept: Option<DeviceBuf<f32>>,
}

impl std::fmt::Debug for GpuDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDecoder")
            .field("kind", &self.kind)
            .field("arch", &self.config.arch)
            .field("layers", &self.layers.len())
            .field("kv_blocks", &self.n_blocks)
            .field("graphs", &self.graphs.enabled)
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
    /// ([`check_model`]: weight types without a kernel, biases, a final
    /// soft-cap, architectures other than llama and gemma3). In float
    /// arithmetic, quantized weights ([`Self::with_exact`],
    /// [`Self::with_dense`] change that).
    pub fn new(
        client: Client,
        kind: BackendKind,
        model: &Llama,
        kv_blocks: usize,
    ) -> std::result::Result<Self, GpuError> {
        check_model(model)?;
        // Before any upload: the pools' 32-bit offsets, and on wgpu one
        // buffer a pool within the binding limit (`gpu_max_kv_blocks`).
        let most = crate::backend::gpu_max_kv_blocks(&model.config, kind);
        if kv_blocks > most {
            return Err(GpuError::Unsupported(format!(
                "{kv_blocks} K/V blocks (at most {most} on {kind:?}: 32-bit offsets, and on wgpu \
                 {} MiB a pool)",
                crate::backend::WGPU_MAX_BUFFER_BYTES >> 20
            )));
        }
        // Every upload, launch and read of this decoder on one stream, the
        // one of the thread creating it. CubeCL gives each thread its own
        // stream by default, and the batch engine steps on another thread
        // than the one that loads: then every launch reading a weight
        // written on the loading thread's stream raised a cross-stream
        // fence (milliseconds a step), and inside a graph capture that
        // fence invalidated the capture (the first device runs: no decode
        // graph was ever recorded on a worker).
        let mut client = client;
        // SAFETY: the stream exists (this thread's) and is used only
        // through this client, whose operations `STEP` serialises.
        #[allow(unsafe_code)]
        unsafe {
            client.set_stream(cubecl_environment::stream::StreamId::current());
        }
        let c = &model.config;
        let sh = HeadShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            // gemma3 rotates NEOX pairs (`Llama::load`'s RoPE layout).
            neox: c.gemma3.is_some(),
        };
        // A wgpu adapter refuses a buffer past its limit (lavapipe's is
        // 128 MiB binding): matrices are uploaded in parts below it.
        let max_part = max_part_bytes(kind);
        let up = |m| GpuMatrix::upload_parts(&client, m, max_part);
        let mut layers = Vec::with_capacity(c.n_layers);
        for b in &model.blocks {
            layers.push(GpuLayer {
                attn_norm: DeviceBuf::upload(&client, &host1(b.attn_norm.val())?),
                ffn_norm: DeviceBuf::upload(&client, &host1(b.ffn_norm.val())?),
                wqkv: up(&b.q.wqkv)?,
                wo: up(&b.q.wo)?,
                w_gate_up: up(&b.q.w_gate_up)?,
                w_down: up(&b.q.w_down)?,
                gemma: b.gemma3.as_ref().map(|g| GemmaNorms {
                    q: DeviceBuf::upload(&client, &g.q_norm),
                    k: DeviceBuf::upload(&client, &g.k_norm),
                    post_attn: DeviceBuf::upload(&client, &g.post_attn),
                    post_ffn: DeviceBuf::upload(&client, &g.post_ffn),
                }),
            });
        }
        if c.vocab > TOP_MAX_VOCAB {
            return Err(GpuError::Unsupported(format!("a vocabulary of {}", c.vocab)));
        }
        let embed = up(&model.embed)?;
        let lm_head = if std::sync::Arc::ptr_eq(&model.embed, &model.lm_head) {
            embed.clone()
        } else {
            up(&model.lm_head)?
        };
        let (cos, sin) = rope_tables(c.head_dim, c.rope_base, c.context_length);
        let local = c.gemma3.as_ref().map(|g| {
            let (cos, sin) = rope_tables(c.head_dim, g.rope_base_local, c.context_length);
            let (cos, sin) = (DeviceBuf::upload(&client, &cos), DeviceBuf::upload(&client, &sin));
            LocalAttn { cos, sin, window: g.sliding_window }
        });
        let inv_sqrt = 1.0 / (c.head_dim as f32).sqrt();
        // gemma3 scales Q after its norm, the scores by 1 (`gemma3_qk`).
        let (q_scale, score_scale) =
            c.gemma3.as_ref().map_or((1.0, inv_sqrt), |g| (g.attn_scale, 1.0));
        // One block more than the block manager hands out: the scratch
        // block a padded decode row writes and reads.
        let pool_len = c.n_layers * (kv_blocks + 1) * sh.block_len();
        let cuda = kind == BackendKind::Cuda;
        let graphs = Graphs::new(graph::graphs_enabled(cuda), c.context_length.div_ceil(BLOCK));
        let device_pick = std::env::var("GCS_GPU_ARGMAX").map_or(true, |v| v != "0");
        Ok(Self {
            device_pick,
            kept: None,
            dense: None,
            graphs,
            shape: StepShape::new(c, sh, lm_head.rows, false),
            local,
            embed_scale: if c.gemma3.is_some() { (c.hidden as f32).sqrt() } else { 1.0 },
            q_scale,
            score_scale,
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

    /// Compute every op in the CPU's arithmetic (`kernels::q8`: 8-bit
    /// matmul inputs and the CPU's float chains; `kernels::exact`: RoPE,
    /// f16 K/V, attention in llama.cpp's order, ggml's SiLU) or not (the
    /// default; a served worker: `GCS_GPU_EXACT=1`, `backend::exact_from_env`);
    /// before the first step. Refused for a
    /// head size the CPU's 16-lane orders do not cover, one that is not
    /// whole 32-element blocks (the attention quantizes each head's
    /// output), or one past the exact attention's units (each unit
    /// finishes one output dimension).
    pub fn with_exact(mut self, on: bool) -> std::result::Result<Self, GpuError> {
        let hd = self.sh.head_dim;
        let kinds = self
            .layers
            .iter()
            .flat_map(|l| [&l.wqkv, &l.wo, &l.w_gate_up, &l.w_down])
            .all(GpuMatrix::exact_kinds)
            && self.lm_head.exact_kinds();
        let embed = self.embed.exact_kinds() && self.embed.parts.len() == 1;
        if on && self.dense.is_some() {
            return Err(GpuError::Unsupported("exact arithmetic over dense f16 weights".into()));
        }
        if on && (self.config.gemma3.is_some() || !kinds || !embed) {
            return Err(GpuError::Unsupported(
                "exact arithmetic for gemma3 or weights other than Q4_0, Q4_1 and Q8_0".into(),
            ));
        }
        if on && (!hd.is_multiple_of(32) || hd > exact::EXACT_THREADS) {
            return Err(GpuError::Unsupported(format!(
                "exact arithmetic with head size {hd} (a multiple of 32 up to {} needed)",
                exact::EXACT_THREADS
            )));
        }
        self.shape.exact = on;
        self.graphs.buckets.clear();
        Ok(self)
    }

    /// The largest part this device's matrices are uploaded in.
    fn max_part_bytes(&self) -> usize {
        max_part_bytes(self.kind)
    }

    /// Whether the exact kernels take `fma`'s f64 stand-in: on wgpu, whose
    /// `fma` may round twice (`kernels::q8::fused`).
    fn wide_fma(&self) -> bool {
        self.kind == BackendKind::Wgpu
    }

    /// Whether steps run in the CPU's arithmetic ([`Self::with_exact`]).
    pub fn exact(&self) -> bool {
        self.shape.exact
    }

    /// Record decode graphs or not, whatever the default
    /// ([`graph::graphs_enabled`]); before the first step.
    pub fn with_graphs(mut self, on: bool) -> Self {
        self.graphs.enabled = on;
        self
    }

    /// The decode buckets whose graph is recorded, smallest first.
    pub fn recorded_buckets(&self) -> Vec<usize> {
        let mut b: Vec<usize> = self
            .graphs
            .buckets
            .iter()
            .filter(|(_, b)| b.graph.is_some())
            .map(|(&r, _)| r)
            .collect();
        b.sort_unstable();
        b
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| l.wqkv.nbytes() + l.wo.nbytes() + l.w_gate_up.nbytes() + l.w_down.nbytes())
            .sum();
        l + self.embed.nbytes() + self.dense.as_ref().map_or(0, |(d, _)| d.bytes())
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

    /// An eager step: buffers of the step's size, inputs uploaded.
    fn step(
        &self,
        seqs: &[PagedSeq<'_>],
        picks: &[Pick],
        adjust: &Adjust,
    ) -> std::result::Result<Read, GpuError> {
        let mut host = HostRows::new(seqs);
        host.set_picks(picks);
        if self.device_pick {
            host.set_adjust(adjust, picks, StepIo::mask_words(self.shape.vocab));
        }
        let io = StepIo::upload(&self.client, self.shape_for(host.rows()), &host);
        self.launch_step(&io)?;
        self.read_out(&io, &host, seqs.len(), picks)
    }

    /// A decode step (one new token per sequence) in its bucket: the
    /// bucket's graph replayed, or recorded on its first use. `None` when
    /// graphs are off, the batch is larger than any bucket, or recording
    /// failed (then graphs stay off for this decoder).
    fn decode_step(
        &mut self,
        seqs: &[PagedSeq<'_>],
        picks: &[Pick],
        adjust: &Adjust,
    ) -> Option<std::result::Result<Read, GpuError>> {
        let n = seqs.len();
        if !self.graphs.enabled || n > graph::MAX_BUCKET || seqs.iter().any(|s| s.tokens.len() != 1)
        {
            return None;
        }
        let rows = graph::bucket_of(n);
        let tables_len = self.graphs.tables_len(rows);
        let mut host = HostRows::new(seqs);
        if host.tables.len() + 1 > tables_len {
            return None;
        }
        host.set_picks(picks);
        if self.device_pick {
            host.set_adjust(adjust, picks, StepIo::mask_words(self.shape.vocab));
        }
        if host.adj_ids.len() > StepIo::ADJUST_CAP {
            return None;
        }
        host.pad_decode(rows, self.n_blocks as u32);
        let cl = self.client.clone();
        let mut bucket = match self.graphs.buckets.remove(&rows) {
            Some(b) => b,
            None => {
                let io = StepIo::bucket(&cl, self.shape_for(rows), rows, tables_len);
                Bucket { graph: None, io }
            }
        };
        bucket.io.write(&cl, &host);
        let res = match &bucket.graph {
            Some(g) => {
                // SAFETY: the graph's buffers are the bucket's, the
                // decoder's weights and its K/V pools, all alive as long as
                // the graph (`graphs` is dropped first); `STEP` keeps any
                // other step off the GPU while it runs, and the inputs were
                // written and the logits are read on this thread's stream.
                #[allow(unsafe_code)]
                let replayed = unsafe { g.replay() };
                let read = |()| self.read_out(&bucket.io, &host, n, picks);
                replayed.map_err(GpuError::server).and_then(read)
            }
            None => self.record(&mut bucket, &host, n, picks),
        };
        self.graphs.buckets.insert(rows, bucket);
        Some(res)
    }

    /// Run `bucket`'s step once for real (the warm-up the recording needs:
    /// every kernel compiled, every pool page in place), then record the
    /// same launches. The warm-up's output is this step's.
    fn record(
        &mut self,
        bucket: &mut Bucket,
        host: &HostRows,
        n: usize,
        picks: &[Pick],
    ) -> std::result::Result<Read, GpuError> {
        let cl = self.client.clone();
        let prepared = cl.graph_prepare().map_err(|e| format!("{e:?}"));
        let read = |()| self.read_out(&bucket.io, host, n, picks);
        let out = self.launch_step(&bucket.io).and_then(read);
        let graph = prepared.and_then(|()| {
            // Record only after a good warm-up; a prepared stream stays in
            // capture mode until `stop_capture`, so that ends it either way.
            let started = match &out {
                Ok(_) => cl.start_capture().map_err(|e| format!("{e:?}")),
                Err(e) => Err(format!("warm-up failed: {e}")),
            };
            let started =
                started.and_then(|()| self.launch_step(&bucket.io).map_err(|e| e.to_string()));
            let stopped = cl.stop_capture().map_err(|e| format!("{e:?}"));
            started.and(stopped)
        });
        match graph {
            Ok(g) => {
                tracing::info!(rows = bucket.io.rows(), "decode graph recorded");
                bucket.graph = Some(g);
            }
            Err(e) => {
                tracing::warn!(rows = bucket.io.rows(), error = %e, "no decode graph; decode steps launch eagerly");
                self.graphs.enabled = false;
            }
        }
        out
    }

    /// The step's kernels, in order, over `io` (a step's own buffers or a
    /// bucket's: the same launches either way).
    fn launch_step(&self, io: &StepIo) -> std::result::Result<(), GpuError> {
        let (cl, c, sh) = (&self.client, &self.config, self.sh);
        let exact = self.shape.exact.then_some(self.wide_fma());
        launch::embed(cl, &self.embed, &io.tok, &io.x, self.embed_scale, exact);
        let layer_len = (self.n_blocks + 1) * sh.block_len();
        // A decode step (each row its sequence's only one): RoPE and the
        // K/V store inside the attention, one launch fewer. Prefill rows
        // read keys other rows of their step write: a launch of their own.
        let decode = io.rows() == io.seqs();
        let dense = self.dense.as_ref().zip(io.dense.as_ref()).map(|((w, _), d)| (w, d));
        // The dense step's O or down projection waiting to join the residual.
        let mut pending = None;
        for (li, l) in self.layers.iter().enumerate() {
            let pool = LayerPool { k: &self.k_pool, v: &self.v_pool, off: li * layer_len };
            // gemma3's local layers: their own tables and window.
            let local =
                self.local.as_ref().filter(|_| c.gemma3.as_ref().is_some_and(|g| g.is_local(li)));
            let (rope, window) = match local {
                Some(a) => (FusedRope { cos: &a.cos, sin: &a.sin }, a.window),
                None => (FusedRope { cos: &self.cos, sin: &self.sin }, 0),
            };
            let fused = decode.then_some(rope);
            let layer = Layer { w: l, pool, scale: self.score_scale, rope, window, fused };
            match (dense, &io.exact) {
                (Some((w, d)), _) => pending = self.dense_layer(io, &layer, w, li, d, pending)?,
                (None, Some(e)) => self.exact_layer(io, e, &layer, li == 0),
                (None, None) => self.float_layer(io, &layer),
            }
        }
        if let Some((w, d)) = dense {
            return self.dense_head(io, w, d, pending);
        }
        // Only each sequence's last row: the output norm, the logits.
        let (n, eps) = (io.seqs(), c.rms_eps);
        match &io.exact {
            Some(e) => {
                let (x, w, acts) = (&io.x, &self.output_norm, &e.acts);
                launch::add_rms_norm_q8(cl, x, Some(&e.d), w, &io.hl, &io.last, eps, acts);
                launch::matmul_q8(cl, &self.lm_head, acts, n, &io.logits, self.wide_fma());
            }
            None => {
                launch::rms_norm(cl, &io.x, &self.output_norm, &io.hl, &io.last, eps);
                launch::matmul(cl, &self.lm_head, &io.hl, n, &io.logits);
            }
        }
        self.launch_pick(io);
        Ok(())
    }

    /// The step's last launches: each row's grammar mask, bias and
    /// penalties (a scored row's candidates between them), then its pick,
    /// where the device picks.
    fn launch_pick(&self, io: &StepIo) {
        let cl = &self.client;
        if self.device_pick {
            let vocab = self.shape.vocab;
            if let Some(a) = &io.adjust {
                launch::adjust_rows(cl, &io.logits, a, &io.pick, vocab, self.wide_fma());
            }
            launch::pick_rows(cl, &io.logits, &io.pick, &io.picked, vocab, self.wide_fma());
        }
    }

    /// A layer in float arithmetic, 6 launches (5 in a decode step): the
    /// norms are read inside the Q/K/V and gate/up matmuls, SwiGLU inside
    /// the down projection, the O and down projections add to the
    /// residual `x` themselves, and in a decode step the attention rotates
    /// Q and K and stores K/V.
    fn float_layer(&self, io: &StepIo, layer: &Layer<'_>) {
        let (cl, sh, eps) = (&self.client, self.sh, self.config.rms_eps);
        let (t, meta) = (io.rows(), &io.meta);
        let (x, qkv) = (&io.x, &io.qkv);
        let Layer { w: l, pool, scale, rope, window, fused } = *layer;
        launch::matmul_in(cl, &l.wqkv, x, Input::Norm(&l.attn_norm, eps), t, qkv, false);
        if let Some(g) = &l.gemma {
            launch::head_norm(cl, sh, qkv, t, &g.q, &g.k, self.q_scale, eps);
        }
        if fused.is_none() {
            launch::rope_kv_store(cl, sh, qkv, pool, rope.cos, rope.sin, meta, None);
        }
        let attn = Attn::Float(fused);
        launch::paged_attention(cl, sh, qkv, pool, &io.attn, meta, scale, window, attn);
        let Some(g) = &l.gemma else {
            launch::matmul_in(cl, &l.wo, &io.attn, Input::Rows, t, x, true);
            launch::matmul_in(cl, &l.w_gate_up, x, Input::Norm(&l.ffn_norm, eps), t, &io.gu, false);
            launch::matmul_in(cl, &l.w_down, &io.gu, Input::Glu, t, x, true);
            return;
        };
        // gemma3: the O and down projections are normed before they join
        // the residual, and the FFN is GeGLU. `post` is there whenever the
        // layers have gemma3's norms (`StepShape::post`, from the config).
        let Some(post) = &io.post else { return };
        launch::matmul_in(cl, &l.wo, &io.attn, Input::Rows, t, post, false);
        launch::add_normed(cl, x, post, &g.post_attn, t, eps);
        launch::matmul_in(cl, &l.w_gate_up, x, Input::Norm(&l.ffn_norm, eps), t, &io.gu, false);
        launch::matmul_in(cl, &l.w_down, &io.gu, Input::GeGlu, t, post, false);
        launch::add_normed(cl, x, post, &g.post_ffn, t, eps);
    }

    /// A layer in the CPU's arithmetic, 9 launches (8 in a decode step):
    /// each norm adds the residual and quantizes its output (the next
    /// matmul's input), as the attention does; the SwiGLU output is
    /// quantized by its own launch (SwiGLU computed there); in a decode
    /// step the attention rotates Q and K and stores K/V.
    fn exact_layer(&self, io: &StepIo, e: &ExactIo, layer: &Layer<'_>, first: bool) {
        let (cl, sh, eps, wide) = (&self.client, self.sh, self.config.rms_eps, self.wide_fma());
        let (t, meta, exact) = (io.rows(), &io.meta, Some(wide));
        let Layer { w: l, pool, scale, fused, .. } = *layer;
        let (acts, h) = (&e.acts, &e.h);
        // x += the previous layer's FFN output, fused with this norm.
        let prev = (!first).then_some(&e.d);
        launch::add_rms_norm_q8(cl, &io.x, prev, &l.attn_norm, h, &io.all, eps, acts);
        launch::matmul_q8(cl, &l.wqkv, acts, t, &io.qkv, wide);
        if fused.is_none() {
            launch::rope_kv_store(cl, sh, &io.qkv, pool, &self.cos, &self.sin, meta, exact);
        }
        // The attention quantizes its output for O itself.
        let how = Attn::Exact { wide, acts, rope: fused };
        launch::paged_attention(cl, sh, &io.qkv, pool, &io.attn, meta, scale, 0, how);
        launch::matmul_q8(cl, &l.wo, acts, t, &e.o, wide);
        launch::add_rms_norm_q8(cl, &io.x, Some(&e.o), &l.ffn_norm, h, &io.all, eps, acts);
        launch::matmul_q8(cl, &l.w_gate_up, acts, t, &io.gu, wide);
        // SwiGLU inside the down projection's quantizer.
        launch::quantize_q8(cl, &io.gu, t, l.w_down.cols, acts, exact);
        launch::matmul_q8(cl, &l.w_down, acts, t, &e.d, wide);
    }
}

/// One layer of a step: its weights, its K/V pool, the attention's scale,
/// its RoPE tables and window (0: every key), and RoPE inside the
/// attention in a decode step.
#[derive(Clone, Copy)]
struct Layer<'a> {
    w: &'a GpuLayer,
    pool: LayerPool<'a>,
    scale: f32,
    rope: FusedRope<'a>,
    window: usize,
    fused: Option<FusedRope<'a>>,
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
        // f16 K and V, as the CPU pool.
        let kv = std::mem::size_of::<KvElem>();
        2 * kv * self.config.n_layers * self.sh.n_kv_heads * self.sh.head_dim
    }
    fn copy_block(&mut self, src: u32, dst: u32) {
        let _one = STEP.lock().unwrap_or_else(|e| e.into_inner());
        let n = self.config.n_layers;
        launch::copy_block(&self.client, self.sh, &self.k_pool, &self.v_pool, src, dst, n);
    }
    fn picks_on_device(&self) -> bool {
        self.device_pick
    }
    fn forward_paged(&mut self, seqs: &[PagedSeq<'_>]) -> Result<Vec<f32>> {
        let none = Adjust::default();
        Ok(self.forward_select(seqs, &vec![Pick::Logits; seqs.len()], &none)?.logits)
    }
    fn forward_select(
        &mut self,
        seqs: &[PagedSeq<'_>],
        picks: &[Pick],
        adjust: &Adjust,
    ) -> Result<StepLogits> {
        self.check(seqs)?;
        if let Some(&id) = adjust.ids().iter().find(|&&id| id as usize >= self.shape.vocab) {
            return Err(EngineError::InvalidRequest(format!("logit addition to token {id}")));
        }
        let _one = STEP.lock().unwrap_or_else(|e| e.into_inner());
        self.kept = None;
        let res = match self.decode_step(seqs, picks, adjust) {
            Some(r) => r,
            None => self.step(seqs, picks, adjust),
        };
        let read = res.map_err(|e| EngineError::Backend(e.to_string()))?;
        self.kept = read.kept;
        Ok(read.out)
    }
    fn last_logits(&mut self, seqs: &[usize]) -> Result<Vec<f32>> {
        let Some(kept) = &self.kept else {
            return Err(EngineError::Backend(format!("no logits of rows {seqs:?} kept")));
        };
        let _one = STEP.lock().unwrap_or_else(|e| e.into_inner());
        kept.read_rows(&self.client, self.shape.vocab, seqs)
            .map_err(|e| EngineError::Backend(e.to_string()))
    }
}
