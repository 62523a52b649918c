//! One forward step's inputs and device buffers, shared by the two ways a
//! step runs: eagerly (buffers sized to the step, inputs uploaded) and as a
//! replayed graph (a bucket's buffers, allocated once, inputs written in
//! place: `graph.rs`).

use super::kernels::attention::HeadShape;
use super::kernels::top::TOP_STRIDE;
use super::launch::{AdjustBufs, Picked, QActs, RowMeta};
use super::DeviceBuf;
use crate::backend::rows::{HostRows, PICK_STRIDE};
use crate::llama::LlamaConfig;
use cubecl::client::Client;

/// The shapes a step's buffers follow.
#[derive(Debug, Clone, Copy)]
pub struct StepShape {
    pub hidden: usize,
    pub q_dim: usize,
    pub qkv: usize,
    pub inter: usize,
    pub vocab: usize,
    /// Every op in the CPU's arithmetic (`kernels::q8` and
    /// `kernels::exact`): the step keeps quantized matmul inputs.
    pub exact: bool,
    /// gemma3's post-norms: the O and down projections are written to
    /// [`StepIo::post`] and normed into the residual.
    pub post: bool,
    /// The matmuls over f16 copies of the weights (`super::dense`): the
    /// step keeps f16 matmul inputs ([`StepIo::dense`]).
    pub dense: bool,
}

impl StepShape {
    pub fn new(c: &LlamaConfig, sh: HeadShape, vocab: usize, exact: bool) -> Self {
        Self {
            hidden: c.hidden,
            q_dim: c.n_heads * c.head_dim,
            qkv: sh.width(),
            inter: c.intermediate,
            vocab,
            exact,
            post: c.gemma3.is_some(),
            dense: false,
        }
    }
}

/// Everything one step reads and writes besides the weights and the K/V
/// pools: `rows` batch rows of `seqs` sequences.
#[derive(Debug)]
pub struct StepIo {
    pub tok: DeviceBuf<u32>,
    pub meta: RowMeta,
    /// The identity over the rows (every row's norm).
    pub all: DeviceBuf<u32>,
    pub last: DeviceBuf<u32>,
    /// The residual stream (the float step's O and down projections add
    /// to it).
    pub x: DeviceBuf<f32>,
    pub qkv: DeviceBuf<f32>,
    pub attn: DeviceBuf<f32>,
    /// Gate and up rows; the down projection reads their SwiGLU.
    pub gu: DeviceBuf<f32>,
    /// The last rows, normed.
    pub hl: DeviceBuf<f32>,
    pub logits: DeviceBuf<f32>,
    /// Each sequence's `[temperature, uniform, candidates]`
    /// ([`HostRows::pick`]).
    pub pick: DeviceBuf<f32>,
    /// Each sequence's picked token, its logit and its candidates.
    pub picked: Picked,
    /// The exact step's own buffers, with [`StepShape::exact`].
    pub exact: Option<ExactIo>,
    /// The dense step's own buffers, with [`StepShape::dense`].
    pub dense: Option<DenseIo>,
    /// An O or down projection before its norm, with [`StepShape::post`].
    pub post: Option<DeviceBuf<f32>>,
    /// The grammar masks and the bias and penalty additions
    /// ([`HostRows::adj_off`], [`HostRows::mask_off`]): an eager step's
    /// where it has some (or scores a row), a bucket's always ([`StepIo::ADJUST_CAP`]
    /// additions at most, a mask a row).
    pub adjust: Option<AdjustBufs>,
}

/// What only a step in the CPU's arithmetic reads and writes: its
/// matmuls read quantized inputs, and its norms add the residual (the
/// float step's matmuls norm `x` as they read it and add to it).
#[derive(Debug)]
pub struct ExactIo {
    /// A matmul's quantized input.
    pub acts: QActs,
    /// The normed rows (`acts` holds them quantized; kept for the tests'
    /// bit-for-bit check).
    pub h: DeviceBuf<f32>,
    /// The O projection, added to `x` by the next norm.
    pub o: DeviceBuf<f32>,
    /// The down projection, added to `x` by the next norm.
    pub d: DeviceBuf<f32>,
}

/// What only a dense step reads and writes (`super::dense`).
#[derive(Debug)]
pub struct DenseIo {
    /// A matmul's input in f16: `rows × max(hidden, q_dim, inter)`.
    pub a16: DeviceBuf<half::f16>,
    /// The O or down projection, before it joins the residual.
    pub d: DeviceBuf<f32>,
}

impl StepIo {
    /// Buffers for `host`'s rows, its inputs uploaded (the eager step).
    pub fn upload(cl: &Client, s: StepShape, host: &HostRows) -> Self {
        let all: Vec<u32> = (0..host.rows() as u32).collect();
        let meta = RowMeta {
            pos: DeviceBuf::upload(cl, &host.pos),
            slot: DeviceBuf::upload(cl, &host.slot),
            table: DeviceBuf::upload(cl, &host.table),
            tables: DeviceBuf::upload(cl, &host.tables),
            single: DeviceBuf::upload(cl, &host.single),
        };
        let tok = DeviceBuf::upload(cl, &host.tokens);
        let (all, last) = (DeviceBuf::upload(cl, &all), DeviceBuf::upload(cl, &host.last));
        let pick = DeviceBuf::upload(cl, &host.pick);
        // A buffer is never empty: a row's range may be.
        let some = |v: &[u32]| DeviceBuf::upload(cl, if v.is_empty() { &[0] } else { v });
        let adds = if host.adj_adds.is_empty() { &[0.0][..] } else { &host.adj_adds };
        let touched = !host.adj_ids.is_empty() || !host.mask_words.is_empty() || host.scores();
        let adjust = touched.then(|| AdjustBufs {
            off: DeviceBuf::upload(cl, &host.adj_off),
            ids: some(&host.adj_ids),
            adds: DeviceBuf::upload(cl, adds),
            raw: DeviceBuf::uninit(cl, adds.len()),
            mask_off: DeviceBuf::upload(cl, &host.mask_off),
            words: some(&host.mask_words),
            scored: DeviceBuf::uninit(cl, host.last.len() * TOP_STRIDE),
        });
        Self { adjust, ..Self::with_inputs(cl, s, tok, meta, all, last, pick) }
    }

    /// Additions a bucket holds (1 MiB of them): a step of 256 sequences
    /// with the 300 biases a request may carry and 200 penalised tokens
    /// each; a step with more runs eagerly.
    pub const ADJUST_CAP: usize = 1 << 17;

    /// Words of a row's grammar mask: a bit a token of the vocabulary.
    pub fn mask_words(vocab: usize) -> usize {
        vocab.div_ceil(32)
    }

    /// Buffers of a decode bucket: `rows` rows, one per sequence, inputs
    /// zeroed until [`StepIo::write`] fills them; `tables_len` entries of
    /// block tables.
    pub fn bucket(cl: &Client, s: StepShape, rows: usize, tables_len: usize) -> Self {
        let ids: Vec<u32> = (0..rows as u32).collect();
        let meta = RowMeta {
            pos: DeviceBuf::zeros(cl, rows),
            slot: DeviceBuf::zeros(cl, rows),
            table: DeviceBuf::zeros(cl, rows),
            tables: DeviceBuf::zeros(cl, tables_len),
            single: DeviceBuf::zeros(cl, rows),
        };
        let tok = DeviceBuf::zeros(cl, rows);
        let (all, last) = (DeviceBuf::upload(cl, &ids), DeviceBuf::upload(cl, &ids));
        let pick = DeviceBuf::zeros(cl, PICK_STRIDE * rows);
        let words = rows * Self::mask_words(s.vocab);
        let adjust = Some(AdjustBufs::zeros(cl, rows, Self::ADJUST_CAP, words));
        Self { adjust, ..Self::with_inputs(cl, s, tok, meta, all, last, pick) }
    }

    fn with_inputs(
        cl: &Client,
        s: StepShape,
        tok: DeviceBuf<u32>,
        meta: RowMeta,
        all: DeviceBuf<u32>,
        last: DeviceBuf<u32>,
        pick: DeviceBuf<f32>,
    ) -> Self {
        let (t, n) = (tok.len(), last.len());
        let buf = |len| DeviceBuf::<f32>::uninit(cl, len);
        let widest = s.hidden.max(s.q_dim).max(s.inter);
        Self {
            exact: s.exact.then(|| ExactIo {
                acts: QActs::new(cl, t * widest),
                h: buf(t * s.hidden),
                o: buf(t * s.hidden),
                d: buf(t * s.hidden),
            }),
            dense: s
                .dense
                .then(|| DenseIo { a16: DeviceBuf::uninit(cl, t * widest), d: buf(t * s.hidden) }),
            post: s.post.then(|| buf(t * s.hidden)),
            x: buf(t * s.hidden),
            qkv: buf(t * s.qkv),
            attn: buf(t * s.q_dim),
            gu: buf(t * 2 * s.inter),
            hl: buf(n * s.hidden),
            logits: buf(n * s.vocab),
            picked: Picked::new(cl, n),
            tok,
            meta,
            all,
            last,
            pick,
            adjust: None,
        }
    }

    /// Write a bucket's inputs in place (`host` padded to its rows).
    pub fn write(&self, cl: &Client, host: &HostRows) {
        debug_assert_eq!(host.rows(), self.tok.len());
        self.tok.write(cl, &host.tokens);
        self.meta.pos.write(cl, &host.pos);
        self.meta.slot.write(cl, &host.slot);
        self.meta.table.write(cl, &host.table);
        self.meta.tables.write(cl, &host.tables);
        self.meta.single.write(cl, &host.single);
        self.pick.write(cl, &host.pick);
        if let Some(a) = &self.adjust {
            debug_assert!(host.adj_ids.len() <= a.ids.len());
            debug_assert!(host.mask_words.len() <= a.words.len());
            a.off.write(cl, &host.adj_off);
            a.mask_off.write(cl, &host.mask_off);
            if !host.adj_ids.is_empty() {
                a.ids.write(cl, &host.adj_ids);
                a.adds.write(cl, &host.adj_adds);
            }
            if !host.mask_words.is_empty() {
                a.words.write(cl, &host.mask_words);
            }
        }
    }

    /// Batch rows.
    pub fn rows(&self) -> usize {
        self.tok.len()
    }

    /// Sequences (rows whose logits come back).
    pub fn seqs(&self) -> usize {
        self.last.len()
    }
}
