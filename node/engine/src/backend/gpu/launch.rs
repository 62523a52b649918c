//! Launch wrappers: each kernel with its cube counts and dimensions, over
//! typed buffers (shared by the decoder and the tests).

use cubecl::client::Client;
use cubecl::prelude::*;

use super::kernels::attention::{self, HeadShape};
use super::kernels::top::{self, TOP_STRIDE};
use super::kernels::{exact, gemma, ops, pick, q8, q8_tiled, quant, tiled};
use super::weights::GpuMatrix;
use super::DeviceBuf;

thread_local! {
    static LAUNCHES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Kernels this thread has launched through this module so far: a step's
/// count is the difference across it (the device check's anatomy and the
/// decoder's test; at small batches each launch costs microseconds of the
/// step, replayed as a graph or not).
pub fn launches() -> usize {
    LAUNCHES.with(|l| l.get())
}

pub(crate) fn counted() {
    LAUNCHES.with(|l| l.set(l.get() + 1));
}

pub(crate) fn groups(n: usize, per: usize) -> u32 {
    n.div_ceil(per).max(1) as u32
}

/// Which matmul kernel runs: all three give the same bits
/// ([`quant`]'s summation order), so the choice is speed only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulKernel {
    /// [`quant::matmul_q`]: `NB` batch rows a cube, one weight row a unit.
    Narrow,
    /// [`quant::matmul_q_wide`]: `RPU` weight rows a unit.
    Wide,
    /// [`tiled::matmul_q_tiled`]: shared-memory tiles of `TM × TN`.
    Tiled,
}

impl MatmulKernel {
    pub const ALL: [MatmulKernel; 3] = [Self::Narrow, Self::Wide, Self::Tiled];

    /// The kernel for a batch of `n` rows: on the H200 the wide kernel
    /// beat the narrow one at every batch (lm_head at 1 row: 76 against
    /// 148 µs) and the tiled one from 8 rows (lm_head at 8: 221 µs, wide
    /// 271, narrow 922; at 64: 281, 2079, 7249). specs/figures.md, "GPU
    /// matmul kernels".
    pub fn for_rows(n: usize) -> Self {
        if n < TILED_FROM {
            Self::Wide
        } else {
            Self::Tiled
        }
    }
}

/// Batch rows a cube of the wide kernel takes for a batch of `n`: the
/// next power of two up to [`quant::NB`] (one kernel each; a lone
/// sequence's step reduces one row, not eight).
pub fn wide_batch_rows(n: usize) -> usize {
    n.next_power_of_two().clamp(1, quant::NB)
}

/// Batch rows from which the tiled kernel runs.
pub const TILED_FROM: usize = 8;

/// What a float matmul reads as its input rows ([`quant::InputKind`]).
#[derive(Debug, Clone, Copy)]
pub enum Input<'a> {
    /// The rows of `x`, `[n, m.cols]`.
    Rows,
    /// The SwiGLU of `x`'s `[gate | up]` rows, `[n, 2 · m.cols]`: what
    /// [`swiglu`] would write, computed as the kernel reads it.
    Glu,
    /// The GeGLU of `x`'s `[gate | up]` rows (gemma3's FFN).
    GeGlu,
    /// `x`'s rows RMS-normed with these weights and `eps`: what
    /// [`rms_norm`] would write, computed by each cube for its rows.
    Norm(&'a DeviceBuf<f32>, f32),
}

impl Input<'_> {
    fn kind(&self) -> quant::InputKind {
        match self {
            Input::Rows => quant::InputKind::Rows,
            Input::Glu => quant::InputKind::Glu,
            Input::GeGlu => quant::InputKind::GeGlu,
            Input::Norm(..) => quant::InputKind::Norm,
        }
    }
}

/// `out[n, m.rows] = x[n, m.cols] · mᵀ`, by [`MatmulKernel::for_rows`].
pub fn matmul(c: &Client, m: &GpuMatrix, x: &DeviceBuf<f32>, n: usize, out: &DeviceBuf<f32>) {
    matmul_in(c, m, x, Input::Rows, n, out, false);
}

/// `out[n, m.rows] = input(x) · mᵀ` ([`Input`]), or with `add`
/// `out += …` (the O and down projections add to the residual stream,
/// one add each as the separate kernels did), by
/// [`MatmulKernel::for_rows`].
pub fn matmul_in(
    c: &Client,
    m: &GpuMatrix,
    x: &DeviceBuf<f32>,
    input: Input<'_>,
    n: usize,
    out: &DeviceBuf<f32>,
    add: bool,
) {
    matmul_with(c, m, x, input, n, out, add, MatmulKernel::for_rows(n));
}

/// [`matmul_in`] with the kernel chosen by the caller (the tests and the
/// device check's anatomy compare them).
#[allow(clippy::too_many_arguments)]
pub fn matmul_with(
    c: &Client,
    m: &GpuMatrix,
    x: &DeviceBuf<f32>,
    input: Input<'_>,
    n: usize,
    out: &DeviceBuf<f32>,
    add: bool,
    kernel: MatmulKernel,
) {
    let width = if matches!(input, Input::Glu | Input::GeGlu) { 2 * m.cols } else { m.cols };
    debug_assert!(x.len() >= n * width && out.len() >= n * m.rows);
    // Without a norm the kernels never read its weights; `x` stands in
    // (read-only, as `x`).
    let (nw, eps) = match input {
        Input::Norm(w, eps) => (w, eps),
        _ => (x, 0.0),
    };
    let kind = input.kind();
    let mut off = 0;
    for p in &m.parts {
        counted();
        // The three kernels take the same arguments after their shape (the
        // wide one one more).
        macro_rules! launch {
            ($kernel:path, $count:expr, $dim:expr $(, $more:expr)?) => {
                $kernel(
                    c,
                    $count,
                    $dim,
                    p.words.arg(),
                    x.arg(),
                    nw.arg(),
                    out.arg(),
                    p.rows,
                    m.cols,
                    n,
                    m.rows,
                    off,
                    eps,
                    p.kind,
                    kind,
                    add,
                    $($more)?
                )
            };
        }
        let quant_dim = CubeDim::new_2d(quant::LANES as u32, quant::ROWS as u32);
        let batch = groups(n, quant::NB);
        match kernel {
            MatmulKernel::Narrow => launch!(
                quant::matmul_q::launch,
                CubeCount::Static(groups(p.rows, quant::ROWS), batch, 1),
                quant_dim
            ),
            MatmulKernel::Wide => {
                let nb = wide_batch_rows(n);
                launch!(
                    quant::matmul_q_wide::launch,
                    CubeCount::Static(groups(p.rows, quant::ROWS * quant::RPU), groups(n, nb), 1),
                    quant_dim,
                    nb
                )
            }
            MatmulKernel::Tiled => launch!(
                tiled::matmul_q_tiled::launch,
                CubeCount::Static(groups(p.rows, tiled::TM), groups(n, tiled::TN), 1),
                CubeDim::new_2d(tiled::UX as u32, tiled::UY as u32)
            ),
        }
        off += p.rows;
    }
}

/// Inputs quantized to 8 bits a 32-element block on the device
/// ([`q8::quantize_q8`]): the CPU's `QActs`.
#[derive(Debug)]
pub struct QActs {
    pub qs: DeviceBuf<u32>,
    pub d: DeviceBuf<f32>,
    pub s: DeviceBuf<f32>,
    pub sum_q: DeviceBuf<i32>,
}

impl QActs {
    /// Buffers for `elements` inputs (a multiple of 32).
    pub fn new(c: &Client, elements: usize) -> Self {
        let blocks = elements / 32;
        Self {
            qs: DeviceBuf::uninit(c, blocks * 8),
            d: DeviceBuf::uninit(c, blocks),
            s: DeviceBuf::uninit(c, blocks),
            sum_q: DeviceBuf::uninit(c, blocks),
        }
    }
}

/// Quantize `n · cols` inputs into `acts` ([`q8::quantize_q8`]): the
/// first `n · cols` elements of `x`, or with `glu = Some(wide)` the SwiGLU
/// of `x`'s `[gate | up]` rows in the CPU's arithmetic
/// ([`exact::swiglu_quantize_q8`]: what [`swiglu`] with `exact` writes,
/// quantized without writing it; the down projection's input).
pub fn quantize_q8(
    c: &Client,
    x: &DeviceBuf<f32>,
    n: usize,
    cols: usize,
    acts: &QActs,
    glu: Exact,
) {
    let blocks = n * cols / 32;
    let width = if glu.is_some() { 2 * cols } else { cols };
    debug_assert!(x.len() >= n * width && acts.d.len() >= blocks && cols.is_multiple_of(32));
    counted();
    let (count, dim) = (CubeCount::Static(groups(blocks, 64), 1, 1), CubeDim::new_1d(64));
    let (qs, d, s, sum_q) = (acts.qs.arg(), acts.d.arg(), acts.s.arg(), acts.sum_q.arg());
    match glu {
        Some(wide) => exact::swiglu_quantize_q8::launch(
            c,
            count,
            dim,
            x.arg(),
            qs,
            d,
            s,
            sum_q,
            blocks,
            cols,
            wide,
        ),
        None => q8::quantize_q8::launch(c, count, dim, x.arg(), qs, d, s, sum_q, blocks),
    }
}

/// `out[n, m.rows] = x · mᵀ` in the CPU's arithmetic over `acts` (`x`
/// quantized by [`quantize_q8`]): the CPU decoder's matmul, bit for bit;
/// [`q8::matmul_q8`] below [`TILED_FROM`] rows, [`q8_tiled::matmul_q8_tiled`]
/// from there (the same bits). `wide_fma` on wgpu, whose `fma` may round
/// twice ([`q8`]'s `fused`).
pub fn matmul_q8(
    c: &Client,
    m: &GpuMatrix,
    acts: &QActs,
    n: usize,
    out: &DeviceBuf<f32>,
    wide_fma: bool,
) {
    matmul_q8_with(c, m, acts, n, out, wide_fma, n >= TILED_FROM);
}

/// [`matmul_q8`] with the kernel chosen by the caller (`tiled` or not:
/// the tests and the device check's anatomy compare them).
pub fn matmul_q8_with(
    c: &Client,
    m: &GpuMatrix,
    acts: &QActs,
    n: usize,
    out: &DeviceBuf<f32>,
    wide_fma: bool,
    tiled: bool,
) {
    debug_assert!(out.len() >= n * m.rows);
    let mut off = 0;
    for p in &m.parts {
        counted();
        // The two kernels take the same arguments after their shape.
        macro_rules! launch {
            ($kernel:path, $count:expr, $dim:expr) => {
                $kernel(
                    c,
                    $count,
                    $dim,
                    p.words.arg(),
                    acts.qs.arg(),
                    acts.d.arg(),
                    acts.s.arg(),
                    acts.sum_q.arg(),
                    out.arg(),
                    p.rows,
                    m.cols,
                    n,
                    m.rows,
                    off,
                    p.kind,
                    wide_fma,
                )
            };
        }
        if tiled {
            launch!(
                q8_tiled::matmul_q8_tiled::launch,
                CubeCount::Static(groups(p.rows, tiled::TM), groups(n, tiled::TN), 1),
                CubeDim::new_2d(tiled::UX as u32, tiled::UY as u32)
            );
        } else {
            launch!(
                q8::matmul_q8::launch,
                CubeCount::Static(groups(p.rows, 64), n.max(1) as u32, 1),
                CubeDim::new_1d(64)
            );
        }
        off += p.rows;
    }
}

/// `x[i] = m[tokens[i]] · scale`, one launch a part of `m`. With `exact`,
/// [`exact::embed_exact`] (the CPU's rounding of Q4_1; one part, the
/// scale 1).
pub fn embed(
    c: &Client,
    m: &GpuMatrix,
    tokens: &DeviceBuf<u32>,
    x: &DeviceBuf<f32>,
    scale: f32,
    exact: Exact,
) {
    if let (Some(wide), Some(p)) = (exact, m.parts.first()) {
        debug_assert!(scale == 1.0 && m.parts.len() == 1);
        counted();
        let n = tokens.len();
        return exact::embed_exact::launch(
            c,
            CubeCount::Static(groups(n * m.cols, 256), 1, 1),
            CubeDim::new_1d(256),
            p.words.arg(),
            tokens.arg(),
            x.arg(),
            m.cols,
            n,
            p.kind,
            wide,
        );
    }
    let nb = m.cols / 32;
    let mut row0 = 0;
    for p in &m.parts {
        counted();
        quant::embed_q::launch(
            c,
            CubeCount::Static(tokens.len() as u32, groups(nb, 64), 1),
            CubeDim::new_1d(64),
            p.words.arg(),
            tokens.arg(),
            x.arg(),
            m.cols,
            scale,
            row0,
            p.rows,
            p.kind,
        );
        row0 += p.rows;
    }
}

/// `h = RMSNorm(x) · w` over the rows `idx` ([`ops::rms_norm`]; the
/// output norm of the float step, whose layer norms are read inside their
/// matmuls, [`Input::Norm`]).
pub fn rms_norm(
    c: &Client,
    x: &DeviceBuf<f32>,
    w: &DeviceBuf<f32>,
    h: &DeviceBuf<f32>,
    idx: &DeviceBuf<u32>,
    eps: f32,
) {
    counted();
    ops::rms_norm::launch::<f32>(
        c,
        CubeCount::Static(idx.len() as u32, 1, 1),
        CubeDim::new_1d(ops::ROW_THREADS as u32),
        x.arg(),
        w.arg(),
        h.arg(),
        idx.arg(),
        w.len(),
        eps,
    );
}

/// gemma3's per-head norms of `qkv`'s Q and K heads, in place, Q then
/// times `q_scale` ([`gemma::head_norm`]).
#[allow(clippy::too_many_arguments)]
pub fn head_norm(
    c: &Client,
    sh: HeadShape,
    qkv: &DeviceBuf<f32>,
    rows: usize,
    q_norm: &DeviceBuf<f32>,
    k_norm: &DeviceBuf<f32>,
    q_scale: f32,
    eps: f32,
) {
    counted();
    gemma::head_norm::launch(
        c,
        CubeCount::Static(rows as u32, (sh.n_heads + sh.n_kv_heads) as u32, 1),
        CubeDim::new_1d(ops::ROW_THREADS as u32),
        qkv.arg(),
        q_norm.arg(),
        k_norm.arg(),
        q_scale,
        eps,
        sh.n_heads,
        sh.n_kv_heads,
        sh.head_dim,
    );
}

/// `x[r] += RMSNorm(d[r]) · w` for the first `rows` rows
/// ([`gemma::add_normed`]: gemma3's post-attention and post-FFN norms).
pub fn add_normed(
    c: &Client,
    x: &DeviceBuf<f32>,
    d: &DeviceBuf<f32>,
    w: &DeviceBuf<f32>,
    rows: usize,
    eps: f32,
) {
    counted();
    gemma::add_normed::launch(
        c,
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(ops::ROW_THREADS as u32),
        x.arg(),
        d.arg(),
        w.arg(),
        w.len(),
        eps,
    );
}

/// `x += delta` (if any), `h = RMSNorm(x) · w` over the rows `idx` and `h`
/// quantized into `acts` ([`q8::add_rms_norm_exact`]: the CPU's
/// arithmetic, the next q8 matmul's input).
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_q8(
    c: &Client,
    x: &DeviceBuf<f32>,
    delta: Option<&DeviceBuf<f32>>,
    w: &DeviceBuf<f32>,
    h: &DeviceBuf<f32>,
    idx: &DeviceBuf<u32>,
    eps: f32,
    acts: &QActs,
) {
    debug_assert!(acts.d.len() * 32 >= idx.len() * w.len() && w.len().is_multiple_of(32));
    // Without a delta the kernel never reads it; `w` stands in (read-only,
    // so no buffer is bound twice as writable).
    let d = delta.unwrap_or(w);
    counted();
    q8::add_rms_norm_exact::launch(
        c,
        CubeCount::Static(idx.len() as u32, 1, 1),
        CubeDim::new_1d(ops::ROW_THREADS as u32),
        x.arg(),
        d.arg(),
        w.arg(),
        h.arg(),
        idx.arg(),
        acts.qs.arg(),
        acts.d.arg(),
        acts.s.arg(),
        acts.sum_q.arg(),
        eps,
        w.len(),
        delta.is_some(),
    );
}

/// `ids[r]` = row `r`'s token of `logits[rows, vocab]`: its argmax, or its
/// draw at the `[temperature, uniform, candidates, _]` of `pick[4r..]`,
/// and `chosen[r]` its logit; with `candidates` 1 also its best
/// candidates and masses in `top[r * TOP_STRIDE..]` ([`pick::pick_rows`];
/// `wide_fma` on wgpu, whose `fma` may round twice).
pub fn pick_rows(
    c: &Client,
    logits: &DeviceBuf<f32>,
    pick: &DeviceBuf<f32>,
    out: &Picked,
    vocab: usize,
    wide_fma: bool,
) {
    let Picked { ids, chosen, top } = out;
    debug_assert!(top.len() >= ids.len() * TOP_STRIDE && vocab <= top::TOP_MAX_VOCAB);
    debug_assert!(chosen.len() >= ids.len());
    counted();
    pick::pick_rows::launch(
        c,
        CubeCount::Static(ids.len() as u32, 1, 1),
        CubeDim::new_1d(pick::PICK_THREADS as u32),
        logits.arg(),
        pick.arg(),
        ids.arg(),
        chosen.arg(),
        top.arg(),
        vocab,
        wide_fma,
    );
}

/// What a step's pick writes, a row a sequence ([`pick::pick_rows`]).
#[derive(Debug)]
pub struct Picked {
    /// Each sequence's picked token: its argmax, or its draw.
    pub ids: DeviceBuf<u32>,
    /// The picked token's logit (of the adjusted row).
    pub chosen: DeviceBuf<f32>,
    /// Each sequence's candidates, where it asks for them
    /// ([`crate::backend::Pick::Top`]): `TOP_STRIDE` floats a sequence.
    pub top: DeviceBuf<f32>,
}

impl Picked {
    /// Buffers for `n` sequences.
    pub fn new(c: &Client, n: usize) -> Self {
        Self {
            ids: DeviceBuf::uninit(c, n),
            chosen: DeviceBuf::uninit(c, n),
            top: DeviceBuf::uninit(c, n * TOP_STRIDE),
        }
    }
}

/// A step's grammar masks and bias and penalty additions on the device
/// ([`crate::backend::Adjust`]): row `r`'s additions are
/// `(ids, adds)[off[r]..off[r + 1]]`, its mask `words[mask_off[r]..mask_off[r + 1]]`;
/// `raw[i]`: the logit of `ids[i]` before the additions, `scored[r * TOP_STRIDE..]`
/// the candidates of a scored row before them (both written by
/// [`adjust_rows`]).
#[derive(Debug)]
pub struct AdjustBufs {
    pub off: DeviceBuf<u32>,
    pub ids: DeviceBuf<u32>,
    pub adds: DeviceBuf<f32>,
    pub raw: DeviceBuf<f32>,
    pub mask_off: DeviceBuf<u32>,
    pub words: DeviceBuf<u32>,
    pub scored: DeviceBuf<f32>,
}

impl AdjustBufs {
    /// Zeroed buffers for `rows` rows, `adds` additions and `words` mask
    /// words (a decode bucket's).
    pub fn zeros(c: &Client, rows: usize, adds: usize, words: usize) -> Self {
        AdjustBufs {
            off: DeviceBuf::zeros(c, rows + 1),
            ids: DeviceBuf::zeros(c, adds),
            adds: DeviceBuf::zeros(c, adds),
            raw: DeviceBuf::zeros(c, adds),
            mask_off: DeviceBuf::zeros(c, rows + 1),
            words: DeviceBuf::zeros(c, words),
            scored: DeviceBuf::zeros(c, rows * TOP_STRIDE),
        }
    }
}

/// Each of the first `off.len() − 1` rows of `logits` masked and added
/// to, a scored row's candidates selected between ([`pick::adjust_rows`];
/// `wide_fma` as [`pick_rows`]).
pub fn adjust_rows(
    c: &Client,
    logits: &DeviceBuf<f32>,
    a: &AdjustBufs,
    pick: &DeviceBuf<f32>,
    vocab: usize,
    wide_fma: bool,
) {
    let rows = a.off.len() - 1;
    debug_assert!(logits.len() >= rows * vocab && a.mask_off.len() == rows + 1);
    debug_assert!(a.raw.len() >= a.adds.len() && a.scored.len() >= rows * TOP_STRIDE);
    debug_assert!(pick.len() >= rows * pick::PICK_STRIDE);
    counted();
    pick::adjust_rows::launch(
        c,
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(pick::ADJUST_THREADS as u32),
        logits.arg(),
        a.off.arg(),
        a.ids.arg(),
        a.adds.arg(),
        a.raw.arg(),
        a.mask_off.arg(),
        a.words.arg(),
        pick.arg(),
        a.scored.arg(),
        f32::NEG_INFINITY,
        vocab,
        wide_fma,
    );
}

// One candidate per unit of the picking cube (`top::select_top`'s sort),
// as many as the host's sampler takes.
const _: () = assert!(top::TOP_N == pick::PICK_THREADS);
// A draw's ranges of ids, as the host's `sampling::draw_temperature` sums them.
const _: () = assert!(crate::sampling::DRAW_RANGES == pick::PICK_THREADS);
const _: () = assert!(top::TOP_N == crate::sampling::TOP_CANDIDATES);
const _: () = assert!(pick::PICK_STRIDE == crate::backend::rows::PICK_STRIDE);

/// `act[n, inter] = silu(gate) · up` of `gu[n, 2 · inter]` (with
/// `exact`: ggml's SiLU, [`exact::swiglu_exact`]).
pub fn swiglu(c: &Client, gu: &DeviceBuf<f32>, act: &DeviceBuf<f32>, inter: usize, exact: Exact) {
    let (count, dim) = (CubeCount::Static(groups(act.len(), 256), 1, 1), CubeDim::new_1d(256));
    counted();
    match exact {
        Some(wide) => exact::swiglu_exact::launch(c, count, dim, gu.arg(), act.arg(), inter, wide),
        None => {
            ops::glu::launch::<f32>(c, count, dim, gu.arg(), act.arg(), inter, act.len(), false)
        }
    }
}

/// Per batch row: its position, its K/V slot (`block · 16 + pos % 16`),
/// the offset of its block table in `tables`, and whether it takes the
/// decode order of the CPU's attention (`HostRows::single`; read by the
/// exact attention only).
#[derive(Debug, Clone)]
pub struct RowMeta {
    pub pos: DeviceBuf<u32>,
    pub slot: DeviceBuf<u32>,
    pub table: DeviceBuf<u32>,
    pub tables: DeviceBuf<u32>,
    pub single: DeviceBuf<u32>,
}

impl RowMeta {
    pub fn rows(&self) -> usize {
        self.pos.len()
    }
}

/// What the K/V pools hold: f16, as the CPU's pool (half the bytes of
/// f32 and of each attention's reads; the kernels compute in f32). The
/// CPU's arithmetic rounds K and V to f16 before it stores them, so the
/// exact kernels lose nothing to it.
pub type KvElem = half::f16;

/// A layer's K and V pools (views into the all-layer buffers).
#[derive(Debug, Clone, Copy)]
pub struct LayerPool<'a> {
    pub k: &'a DeviceBuf<KvElem>,
    pub v: &'a DeviceBuf<KvElem>,
    /// Element offset of the layer in both.
    pub off: usize,
}

/// The CPU's arithmetic ([`exact`]), and on wgpu the f64 stand-in for
/// its `fma` ([`q8::fused`]); `None`: the float kernels.
pub type Exact = Option<bool>;

/// [`attention::rope_kv_store`] for every batch row (in the CPU's
/// arithmetic with `exact`).
#[allow(clippy::too_many_arguments)]
pub fn rope_kv_store(
    c: &Client,
    sh: HeadShape,
    qkv: &DeviceBuf<f32>,
    pool: LayerPool<'_>,
    cos: &DeviceBuf<f32>,
    sin: &DeviceBuf<f32>,
    meta: &RowMeta,
    exact: Exact,
) {
    let (count, dim) = (CubeCount::Static(meta.rows() as u32, 1, 1), CubeDim::new_1d(128));
    let (q, k, v) = (qkv.arg(), pool.k.arg(), pool.v.arg());
    let (cs, sn, pos, slot) = (cos.arg(), sin.arg(), meta.pos.arg(), meta.slot.arg());
    let (on, wide) = (exact.is_some(), exact.unwrap_or(false));
    counted();
    attention::rope_kv_store::launch::<KvElem>(
        c, count, dim, q, k, v, cs, sn, pos, slot, pool.off, sh, on, wide,
    );
}

/// Units per attention cube: keys scored per chunk, at least `head_dim`.
pub fn attention_threads(sh: HeadShape) -> usize {
    sh.head_dim.next_power_of_two().max(128)
}

/// Which form of the float attention runs ([`attention::paged_attention`]'s
/// `per_kv_head`): both give the same bits (every head's arithmetic in the
/// same order), so the choice is speed only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// A cube per (row, query head).
    Head,
    /// A cube per (row, KV head), its K/V read once for the query heads
    /// that share it.
    KvHead,
}

/// Batch rows from which the float attention takes a cube per KV head: a
/// cube per query head keeps more cubes busy in small batches (SmolLM2 at
/// one row: 9 cubes, not 3); from here there are cubes enough, and each K/V
/// read serves the group. Not yet measured on a GPU (the anatomy times
/// both).
pub const KV_HEAD_FROM: usize = 64;

impl AttentionKernel {
    pub fn for_rows(rows: usize, sh: HeadShape) -> Self {
        if rows >= KV_HEAD_FROM && sh.n_heads > sh.n_kv_heads {
            Self::KvHead
        } else {
            Self::Head
        }
    }
}

/// RoPE and the K/V store done by the float attention itself
/// ([`attention::paged_attention`]'s `rope`) with these tables: for a
/// step in which every row is its sequence's only one (a decode step; a
/// prefill row reads keys other rows of the step write).
#[derive(Debug, Clone, Copy)]
pub struct FusedRope<'a> {
    pub cos: &'a DeviceBuf<f32>,
    pub sin: &'a DeviceBuf<f32>,
}

/// The attention's arithmetic.
#[derive(Debug, Clone, Copy)]
pub enum Attn<'a> {
    /// The float kernel ([`attention::paged_attention`]), with RoPE and
    /// the K/V store inside when given.
    Float(Option<FusedRope<'a>>),
    /// The CPU's ([`exact::paged_attention_exact`]; `wide`: [`Exact`]'s
    /// f64 `fma`), its output also quantized into `acts`, the O
    /// projection's input; with RoPE and the K/V store inside when given.
    Exact { wide: bool, acts: &'a QActs, rope: Option<FusedRope<'a>> },
}

/// [`attention::paged_attention`] or [`exact::paged_attention_exact`]
/// for every batch row and query head (the float kernel the form
/// [`AttentionKernel::for_rows`] picks).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    c: &Client,
    sh: HeadShape,
    qkv: &DeviceBuf<f32>,
    pool: LayerPool<'_>,
    out: &DeviceBuf<f32>,
    meta: &RowMeta,
    scale: f32,
    window: usize,
    how: Attn<'_>,
) {
    let kernel = AttentionKernel::for_rows(meta.rows(), sh);
    paged_attention_with(c, sh, qkv, pool, out, meta, scale, window, how, kernel);
}

/// [`paged_attention`] with the float kernel's form chosen by the caller
/// (the tests and the device check's anatomy compare them; the exact
/// kernel has one form).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_with(
    c: &Client,
    sh: HeadShape,
    qkv: &DeviceBuf<f32>,
    pool: LayerPool<'_>,
    out: &DeviceBuf<f32>,
    meta: &RowMeta,
    scale: f32,
    window: usize,
    how: Attn<'_>,
    kernel: AttentionKernel,
) {
    match how {
        Attn::Exact { wide, acts, rope } => {
            let count = CubeCount::Static(meta.rows() as u32, sh.n_heads as u32, 1);
            let (q, k, v, o) = (qkv.arg(), pool.k.arg(), pool.v.arg(), out.arg());
            let (pos, table, tables) = (meta.pos.arg(), meta.table.arg(), meta.tables.arg());
            counted();
            debug_assert!(acts.d.len() * 32 >= meta.rows() * sh.n_heads * sh.head_dim);
            // Without `rope` the tables are never read; the positions stand
            // in (read-only, as `row_pos`).
            let (cos, sin) = match rope {
                Some(r) => (r.cos.arg(), r.sin.arg()),
                None => (meta.pos.arg(), meta.pos.arg()),
            };
            exact::paged_attention_exact::launch::<KvElem>(
                c,
                count,
                CubeDim::new_1d(exact::EXACT_THREADS as u32),
                q,
                k,
                v,
                o,
                cos,
                sin,
                pos,
                meta.slot.arg(),
                table,
                meta.single.arg(),
                tables,
                acts.qs.arg(),
                acts.d.arg(),
                acts.s.arg(),
                acts.sum_q.arg(),
                pool.off,
                scale,
                window,
                sh,
                wide,
                rope.is_some(),
            )
        }
        Attn::Float(rope) => {
            float_attention(c, sh, qkv, pool, out, meta, scale, window, rope, kernel)
        }
    }
}

/// The float [`attention::paged_attention`] in `kernel`'s form, its
/// output in `O` (f32; the dense step's f16, `super::dense`), with RoPE
/// and the K/V store inside when given.
#[allow(clippy::too_many_arguments)]
pub fn float_attention<O: Float + CubeElement>(
    c: &Client,
    sh: HeadShape,
    qkv: &DeviceBuf<f32>,
    pool: LayerPool<'_>,
    out: &DeviceBuf<O>,
    meta: &RowMeta,
    scale: f32,
    window: usize,
    rope: Option<FusedRope<'_>>,
    kernel: AttentionKernel,
) {
    let t = attention_threads(sh);
    let per_kv = kernel == AttentionKernel::KvHead;
    let heads = if per_kv { sh.n_kv_heads } else { sh.n_heads };
    let count = CubeCount::Static(meta.rows() as u32, heads as u32, 1);
    // Without `rope` the tables are never read; `qkv` stands in.
    let (cos, sin) = rope.map_or((qkv, qkv), |r| (r.cos, r.sin));
    counted();
    attention::paged_attention::launch::<KvElem, O>(
        c,
        count,
        CubeDim::new_1d(t as u32),
        qkv.arg(),
        pool.k.arg(),
        pool.v.arg(),
        out.arg(),
        cos.arg(),
        sin.arg(),
        meta.pos.arg(),
        meta.slot.arg(),
        meta.table.arg(),
        meta.tables.arg(),
        pool.off,
        scale,
        window,
        sh,
        t,
        per_kv,
        rope.is_some(),
    )
}

/// Copy block `src` to `dst` in all `n_layers` layers of both pools.
pub fn copy_block(
    c: &Client,
    sh: HeadShape,
    k: &DeviceBuf<KvElem>,
    v: &DeviceBuf<KvElem>,
    src: u32,
    dst: u32,
    n_layers: usize,
) {
    let bl = sh.block_len();
    let layer_len = k.len() / n_layers.max(1);
    counted();
    attention::copy_block::launch::<KvElem>(
        c,
        CubeCount::Static(groups(n_layers * bl, 256), 1, 1),
        CubeDim::new_1d(256),
        k.arg(),
        v.arg(),
        src as usize,
        dst as usize,
        bl,
        layer_len,
        n_layers,
    );
}
