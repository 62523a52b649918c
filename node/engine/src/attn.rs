//! CPU attention with RoPE and an f16 KV cache.
//!
//! Burn ops cost several microseconds each, and a decode step at batch 1 is
//! dominated by such fixed costs, so RoPE + cache append + attention run here
//! as one host kernel per layer. The numerics follow llama.cpp's default CPU
//! path (f16 K/V cache, Q and softmax probabilities rounded to f16 before the
//! f16 dot products, f32 accumulation) so that greedy decoding agrees with it.

use half::f16;

use crate::attn_paged;
use crate::numerics::{
    dot16, ggml_expf, reduce16, vec_dot_f16_order, vec_dot_f16_order_zero_padded,
};

/// Q·K for one score in llama.cpp's order. ggml's CPU matmul with an f16
/// operand takes llamafile's tinyBLAS when the batch has >= 2 rows
/// (prefill: 16 FMA lanes, tree reduction = [`dot16`]) and
/// `ggml_vec_dot_f16` for a single row (decode: [`vec_dot_f16_order`]).
#[inline(always)]
fn qk_dot(single_row: bool, q: &[f32], k: &[f32]) -> f32 {
    // Head dim 64 (SmolLM2) as fixed-size arrays so the loops unroll: this
    // runs once per (key, head, layer).
    if let (Ok(q64), Ok(k64)) = (<&[f32; 64]>::try_from(q), <&[f32; 64]>::try_from(k)) {
        return if single_row { vec_dot_f16_order(q64, k64) } else { dot16(q64, k64) };
    }
    if single_row {
        vec_dot_f16_order(q, k)
    } else if q.len().is_multiple_of(16) {
        dot16(q, k)
    } else {
        q.iter().zip(k).map(|(x, y)| x * y).sum()
    }
}

/// P·V for one output, same kernel choice as [`qk_dot`]. Lengths are
/// multiples of 16, and llama.cpp's KV length (a multiple of 256) only adds
/// masked positions: exact zeros, which neither order needs to visit.
#[inline(always)]
fn pv_dot(single_row: bool, v: &[f32], p: &[f32]) -> f32 {
    if single_row {
        vec_dot_f16_order_zero_padded(v, p)
    } else {
        dot16(v, p)
    }
}

/// RoPE cos/sin tables `[context, head_dim / 2]`, computed with llama.cpp's
/// recurrence (`theta *= base^(-2/d)`) for bit-compatible angles, plus the
/// rest of a layer's positional treatment: rotation mode, sliding window and
/// score scale (Gemma 3's local and global layers differ in all three).
#[derive(Debug, Clone)]
pub struct Rope {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// NEOX mode: rotate `(x[i], x[i + d/2])` instead of adjacent pairs.
    neox: bool,
    /// A query at position p sees keys at p - window < j <= p
    /// (llama.cpp's LLAMA_SWA_TYPE_STANDARD); `usize::MAX`: all.
    window: usize,
    /// Score scale; `None`: 1/sqrt(head_dim).
    kq_scale: Option<f32>,
}

impl Rope {
    pub fn new(head_dim: usize, base: f32, context: usize) -> Self {
        let half = head_dim / 2;
        let theta_scale = base.powf(-2.0 / head_dim as f32);
        let mut cos = Vec::with_capacity(context * half);
        let mut sin = Vec::with_capacity(context * half);
        for p in 0..context {
            let mut theta = p as f32;
            for _ in 0..half {
                cos.push(theta.cos());
                sin.push(theta.sin());
                theta *= theta_scale;
            }
        }
        Self { half, cos, sin, neox: false, window: usize::MAX, kq_scale: None }
    }

    /// The same angles in NEOX mode with a sliding window (`None`: global)
    /// and an explicit score scale (Gemma 3 pre-scales Q and uses 1.0).
    pub fn with_layout(mut self, neox: bool, window: Option<usize>, kq_scale: f32) -> Self {
        self.neox = neox;
        self.window = window.unwrap_or(usize::MAX).max(1);
        self.kq_scale = Some(kq_scale);
        self
    }

    fn scale(&self) -> f32 {
        self.kq_scale.unwrap_or(1.0 / ((2 * self.half) as f32).sqrt())
    }

    /// Rotate adjacent pairs `(x[2i], x[2i+1])` of every head in `x`
    /// (llama.cpp "normal" mode; GGUF q/k weights are permuted for it).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("fma") {
            // SAFETY: FMA support was detected above.
            return unsafe { self.apply_fma(x, pos) };
        }
        self.apply_impl(x, pos)
    }

    /// Same code compiled with FMA so `mul_add` is one instruction.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "fma")]
    unsafe fn apply_fma(&self, x: &mut [f32], pos: usize) {
        self.apply_impl(x, pos)
    }

    #[inline(always)]
    fn apply_impl(&self, x: &mut [f32], pos: usize) {
        let c = &self.cos[pos * self.half..][..self.half];
        let s = &self.sin[pos * self.half..][..self.half];
        if self.neox {
            // ggml's rotate_pairs with stride d/2, contracted the same way.
            for head in x.chunks_exact_mut(2 * self.half) {
                let (a, b) = head.split_at_mut(self.half);
                for i in 0..self.half {
                    let (x0, x1) = (a[i], b[i]);
                    a[i] = x0.mul_add(c[i], -(x1 * s[i]));
                    b[i] = x0.mul_add(s[i], x1 * c[i]);
                }
            }
            return;
        }
        for head in x.chunks_exact_mut(2 * self.half) {
            for i in 0..self.half {
                let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                // GCC contracts ggml's `x0*cos - x1*sin` and `x0*sin + x1*cos`
                // into these FMAs (checked bit for bit against its rope
                // output). K goes to the f16 cache, so one ulp here matters.
                head[2 * i] = x0.mul_add(c[i], -(x1 * s[i]));
                head[2 * i + 1] = x0.mul_add(s[i], x1 * c[i]);
            }
        }
    }
}

/// One layer's cached keys and values. Values are rounded to f16 precision
/// (llama.cpp's default cache type) but kept as f32 so the hot loop does no
/// conversions.
#[derive(Debug, Clone, Default)]
pub struct LayerKv {
    /// Keys `[len, n_kv_heads, head_dim]`.
    k: Vec<f32>,
    /// Values transposed, `[n_kv_heads * head_dim, cap]`: each row runs
    /// over positions, so the probability-weighted sum is contiguous (the
    /// layout llama.cpp uses without flash attention).
    v_t: Vec<f32>,
    cap: usize,
    len: usize,
}

impl LayerKv {
    /// Append one position's values (`[n_kv_heads * head_dim]`).
    fn push_v(&mut self, v: &[f32]) {
        if self.len == self.cap {
            // Grow in multiples of 16 so padded 16-lane loops stay in bounds.
            let cap = (self.cap * 2).max(64);
            let mut nv = vec![0f32; v.len() * cap];
            if self.cap > 0 {
                for (dst, src) in nv.chunks_exact_mut(cap).zip(self.v_t.chunks_exact(self.cap)) {
                    dst[..self.cap].copy_from_slice(src);
                }
            }
            self.v_t = nv;
            self.cap = cap;
        }
        for (row, &x) in v.iter().enumerate() {
            self.v_t[row * self.cap + self.len] = r16(x);
        }
        self.len += 1;
    }
}

fn r16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// Shapes needed by the kernel.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// RoPE, append to the cache, and causal attention for `t` new rows of one
/// sequence whose cache already holds `past` positions.
///
/// `qkv`: `[t, (n_heads + 2 n_kv_heads) * head_dim]` (modified in place by
/// RoPE); `out`: `[t, n_heads * head_dim]`.
pub fn attend(
    sh: AttnShape,
    rope: &Rope,
    qkv: &mut [f32],
    past: usize,
    kv: &mut LayerKv,
    out: &mut [f32],
) {
    let (nh, nkv, hd) = (sh.n_heads, sh.n_kv_heads, sh.head_dim);
    let (qd, kvd) = (nh * hd, nkv * hd);
    let width = qd + 2 * kvd;
    let t = qkv.len() / width;
    debug_assert_eq!(out.len(), t * qd);
    for (i, row) in qkv.chunks_exact_mut(width).enumerate() {
        let (q, rest) = row.split_at_mut(qd);
        let (k, v) = rest.split_at_mut(kvd);
        rope.apply(q, past + i);
        rope.apply(k, past + i);
        // Q is rounded to f16 because llama.cpp converts it for the f16 K dot.
        q.iter_mut().for_each(|x| *x = r16(*x));
        kv.k.extend(k.iter().map(|&x| r16(x)));
        kv.push_v(v);
    }
    let len = past + t;
    #[cfg(target_arch = "x86_64")]
    let fma = std::is_x86_feature_detected!("fma");
    let ctx = HeadCtx {
        qkv: &*qkv,
        k: &kv.k,
        v_t: &kv.v_t,
        cap: kv.cap,
        sh,
        past,
        single: t == 1,
        scale: rope.scale(),
        window: rope.window,
    };
    let work = |(idx, o): (usize, &mut [f32])| {
        #[cfg(target_arch = "x86_64")]
        if fma {
            // SAFETY: FMA support was detected above.
            return unsafe { head_fma(&ctx, idx, o) };
        }
        head(&ctx, idx, o)
    };
    // out rows are [t, nh, hd]: one chunk per (row, head).
    if t * len * nh >= 2048 {
        crate::par::for_each_chunk_mut(out, hd, |i, o| work((i, o)));
    } else {
        out.chunks_mut(hd).enumerate().for_each(work);
    }
    debug_assert_eq!(kv.k.len(), len * kvd);
}

struct HeadCtx<'a> {
    qkv: &'a [f32],
    k: &'a [f32],
    v_t: &'a [f32],
    cap: usize,
    sh: AttnShape,
    past: usize,
    /// One new row: llama.cpp's decode kernels (see [`qk_dot`]).
    single: bool,
    scale: f32,
    window: usize,
}

/// Same code compiled with FMA so `mul_add` is one instruction, not a libm call.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma,avx2")]
unsafe fn head_fma(c: &HeadCtx<'_>, idx: usize, o: &mut [f32]) {
    head(c, idx, o)
}

/// Attention output of one (row, head) pair into `o` (`[head_dim]`).
#[inline(always)]
#[allow(clippy::expect_used)] // the expect guards an invariant of the code right here
fn head(c: &HeadCtx<'_>, idx: usize, o: &mut [f32]) {
    let (nh, nkv, hd) = (c.sh.n_heads, c.sh.n_kv_heads, c.sh.head_dim);
    let width = (nh + 2 * nkv) * hd;
    let (i, h) = (idx / nh, idx % nh);
    let q = &c.qkv[i * width + h * hd..][..hd];
    let kvh = h / (nh / nkv);
    let n = c.past + i + 1; // causal: keys 0..=past+i
    let lo = n.saturating_sub(c.window); // sliding window: earlier keys masked
                                         // Scores padded to a multiple of 16 with exact zeros after softmax,
                                         // mirroring llama.cpp's padded, masked KV rows.
    let padded = n.div_ceil(16) * 16;
    let mut p = vec![0f32; padded];
    p[..lo].iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
    let mut max = f32::NEG_INFINITY;
    for (j, pj) in p[..n].iter_mut().enumerate().skip(lo) {
        let kj = &c.k[(j * nkv + kvh) * hd..][..hd];
        *pj = qk_dot(c.single, q, kj) * c.scale;
        max = max.max(*pj);
    }
    softmax_f16(&mut p, n, max);
    // out[d] = Σ_j p_j v_j[d] in llama.cpp's order for this batch shape.
    // Padding keys have p = 0 and zeroed V, adding exact zeros.
    for (dd, od) in o.iter_mut().enumerate() {
        let row = &c.v_t[(kvh * hd + dd) * c.cap..][..padded];
        *od = pv_dot(c.single, row, &p);
    }
}

/// Paged K/V storage: a pool of fixed-size f16 blocks per layer, shared by
/// all sequences and addressed through each sequence's block table (see
/// [`crate::paged`]). Per block and KV head, keys and values are both
/// transposed, `[head_dim, 16 pos]` (one contiguous run of `16 * head_dim`
/// halves), so the kernel ([`crate::attn_paged`]) puts a block's 16
/// positions in 16 SIMD lanes.
#[derive(Debug, Clone)]
pub struct KvPool {
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
    n_blocks: usize,
    sh: AttnShape,
}

/// One sequence's part of a paged attention batch.
#[derive(Debug, Clone, Copy)]
pub struct PagedSeqRef<'a> {
    /// Positions already in the pool.
    pub past: usize,
    /// New rows of this sequence in the batch.
    pub t: usize,
    pub table: &'a [u32],
    /// Rows at positions >= this use the single-row (decode) order, the
    /// rest the multi-row (prefill) order, whatever the batch shape: a
    /// position's K/V then depend only on the sequence, not on how its rows
    /// were batched, so a recomputed or resumed sequence is bit-identical.
    pub decode_from: usize,
}

const BS: usize = crate::paged::BLOCK_SIZE;

impl KvPool {
    pub fn new(n_layers: usize, sh: AttnShape, n_blocks: usize) -> Self {
        let per_layer = n_blocks * sh.n_kv_heads * BS * sh.head_dim;
        Self {
            k: vec![vec![f16::ZERO; per_layer]; n_layers],
            v: vec![vec![f16::ZERO; per_layer]; n_layers],
            n_blocks,
            sh,
        }
    }

    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    pub fn n_layers(&self) -> usize {
        self.k.len()
    }

    /// Bytes of K/V storage per cached position.
    pub fn bytes_per_token(&self) -> usize {
        2 * 2 * self.k.len() * self.sh.n_kv_heads * self.sh.head_dim
    }

    fn block_len(&self) -> usize {
        self.sh.n_kv_heads * BS * self.sh.head_dim
    }

    /// Layer `layer`'s K and V: block by block, each KV head's
    /// `head_dim × 16` values dimension-major (`[d · 16 + pos % 16]`).
    pub fn layer(&self, layer: usize) -> (&[f16], &[f16]) {
        (&self.k[layer], &self.v[layer])
    }

    /// Copy block `src` into `dst` in every layer (copy-on-write).
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let n = self.block_len();
        let (s, d) = (src as usize * n, dst as usize * n);
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.copy_within(s..s + n, d);
        }
    }

    /// RoPE, write the new rows' K/V into their blocks, and causal
    /// attention for a batch of sequences in layer `li`. Bit-identical to
    /// [`attend`] on a contiguous cache: the same per-head arithmetic, and
    /// blocks of 16 positions line up with its 16-lane accumulators.
    ///
    /// `qkv`: `[rows, (n_heads + 2 n_kv_heads) * head_dim]` for all
    /// sequences in order; `out`: `[rows, n_heads * head_dim]`.
    pub fn attend(
        &mut self,
        li: usize,
        rope: &Rope,
        qkv: &mut [f32],
        seqs: &[PagedSeqRef<'_>],
        out: &mut [f32],
    ) {
        let (nh, nkv, hd) = (self.sh.n_heads, self.sh.n_kv_heads, self.sh.head_dim);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let width = qd + 2 * kvd;
        let bl = self.block_len();
        let (kl, vl) = (&mut self.k[li], &mut self.v[li]);
        let mut chunks = qkv.chunks_exact_mut(width);
        for s in seqs {
            for i in 0..s.t {
                let Some(row) = chunks.next() else { break };
                let pos = s.past + i;
                let (q, rest) = row.split_at_mut(qd);
                let (k, v) = rest.split_at_mut(kvd);
                rope.apply(q, pos);
                rope.apply(k, pos);
                q.iter_mut().for_each(|x| *x = r16(*x));
                let (b, off) = (s.table[pos / BS] as usize, pos % BS);
                for h in 0..nkv {
                    let base = b * bl + h * BS * hd;
                    for d in 0..hd {
                        kl[base + d * BS + off] = f16::from_f32(k[h * hd + d]);
                        vl[base + d * BS + off] = f16::from_f32(v[h * hd + d]);
                    }
                }
            }
        }
        let kseqs: Vec<attn_paged::Seq<'_>> = seqs
            .iter()
            .map(|s| attn_paged::Seq {
                past: s.past,
                t: s.t,
                table: s.table,
                decode_from: s.decode_from,
            })
            .collect();
        let batch = attn_paged::Batch {
            qkv: &*qkv,
            k: kl,
            v: vl,
            sh: attn_paged::Shape { n_heads: nh, n_kv_heads: nkv, head_dim: hd },
            seqs: &kseqs,
            scale: rope.scale(),
            window: rope.window,
        };
        attn_paged::attend(&batch, out);
    }
}

/// Softmax of the scores `p[..n]` in place, as ggml computes it: ggml's
/// `expf` in f32, a 16-lane sum in f64, one reciprocal. The probabilities
/// are rounded to f16 for llama.cpp's f16 V product. `p.len()` is a
/// multiple of 16 and `p[n..]` holds zeros.
#[allow(clippy::expect_used)] // chunks_exact(16) yields 16 lanes
fn softmax_f16(p: &mut [f32], n: usize, max: f32) {
    for pj in p[..n].iter_mut() {
        *pj = ggml_expf(*pj - max);
    }
    let mut sum = 0f64;
    for ch in p.chunks_exact(16) {
        sum += reduce16(ch.try_into().expect("16 lanes")) as f64;
    }
    let inv = (1.0 / sum) as f32;
    p[..n].iter_mut().for_each(|x| *x = r16(*x * inv));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_equals_incremental_decode() {
        let sh = AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 8 };
        let rope = Rope::new(8, 10000.0, 64);
        let width = (4 + 4) * 8;
        let t = 5;
        let data: Vec<f32> = (0..t * width).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
        let mut a = data.clone();
        let mut kv = LayerKv::default();
        let mut out_a = vec![0f32; t * 32];
        attend(sh, &rope, &mut a, 0, &mut kv, &mut out_a);
        let mut kv2 = LayerKv::default();
        for i in 0..t {
            let mut row = data[i * width..(i + 1) * width].to_vec();
            let mut o = vec![0f32; 32];
            attend(sh, &rope, &mut row, i, &mut kv2, &mut o);
            for (x, y) in o.iter().zip(&out_a[i * 32..(i + 1) * 32]) {
                assert!((x - y).abs() < 1e-5, "row {i}: {x} vs {y}");
            }
        }
        // First row attends only to itself: output is its own (f16) value.
        let v0 = &data[(32 + 16)..(32 + 24)];
        for (o, v) in out_a[..8].iter().zip(v0) {
            assert!((o - v).abs() < 1e-2);
        }
    }

    #[test]
    fn paged_equals_contiguous() {
        let sh = AttnShape { n_heads: 6, n_kv_heads: 2, head_dim: 64 };
        let rope = Rope::new(64, 10000.0, 128);
        let width = (6 + 4) * 64;
        let qd = 6 * 64;
        let t = 37; // over two block boundaries
        let data: Vec<f32> =
            (0..t * width).map(|i| ((i * 7919 % 2003) as f32 / 1000.0) - 1.0).collect();
        let mut a = data.clone();
        let mut kv = LayerKv::default();
        let mut want = vec![0f32; t * qd];
        attend(sh, &rope, &mut a, 0, &mut kv, &mut want);
        // Paged: scattered blocks, prefill in two chunks, stale junk in the pool.
        let mut pool = KvPool::new(1, sh, 8);
        pool.v[0].iter_mut().for_each(|x| *x = f16::from_f32(3.0));
        let table = [5u32, 2, 7];
        let mut got = vec![0f32; t * qd];
        for (start, end) in [(0, 20), (20, t)] {
            let mut rows = data[start * width..end * width].to_vec();
            let seqs = [PagedSeqRef { past: start, t: end - start, table: &table, decode_from: t }];
            pool.attend(0, &rope, &mut rows, &seqs, &mut got[start * qd..end * qd]);
        }
        assert_eq!(got, want);
        // Copy-on-write copies keep the contents.
        pool.copy_block(2, 0);
        assert_eq!(
            pool.k[0][..pool.block_len()],
            pool.k[0][2 * pool.block_len()..3 * pool.block_len()]
        );
    }

    /// Prefill rows then decode rows in ONE paged batch (per-row order from
    /// `decode_from`) equal a multi-row prefill followed by one-row decode
    /// steps on the contiguous cache, bit for bit: how a resumed sequence
    /// rebuilds the K/V of tokens another worker decoded one at a time.
    #[test]
    fn paged_mixed_order_batch_equals_prefill_then_decode() {
        let sh = AttnShape { n_heads: 6, n_kv_heads: 2, head_dim: 64 };
        let rope = Rope::new(64, 10000.0, 128);
        let width = (6 + 4) * 64;
        let qd = 6 * 64;
        let (prompt, t) = (21, 45);
        let data: Vec<f32> =
            (0..t * width).map(|i| ((i * 7919 % 2003) as f32 / 1000.0) - 1.0).collect();
        let mut kv = LayerKv::default();
        let mut want = vec![0f32; t * qd];
        let mut a = data[..prompt * width].to_vec();
        attend(sh, &rope, &mut a, 0, &mut kv, &mut want[..prompt * qd]);
        for i in prompt..t {
            let mut row = data[i * width..(i + 1) * width].to_vec();
            attend(sh, &rope, &mut row, i, &mut kv, &mut want[i * qd..(i + 1) * qd]);
        }
        let table = [3u32, 0, 6];
        let mut got = vec![0f32; t * qd];
        let mut pool = KvPool::new(1, sh, 8);
        // Two chunks, the second straddling the prompt's end.
        for (start, end) in [(0, 17), (17, t)] {
            let mut rows = data[start * width..end * width].to_vec();
            let seqs =
                [PagedSeqRef { past: start, t: end - start, table: &table, decode_from: prompt }];
            pool.attend(0, &rope, &mut rows, &seqs, &mut got[start * qd..end * qd]);
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want));
        // The same rows all in prefill order differ: the order matters.
        let mut pool = KvPool::new(1, sh, 8);
        let mut rows = data.clone();
        let mut all_prefill = vec![0f32; t * qd];
        let seqs = [PagedSeqRef { past: 0, t, table: &table, decode_from: t }];
        pool.attend(0, &rope, &mut rows, &seqs, &mut all_prefill);
        assert_eq!(bits(&all_prefill[..prompt * qd]), bits(&want[..prompt * qd]));
        assert_ne!(bits(&all_prefill[prompt * qd..]), bits(&want[prompt * qd..]));
    }
    /// Long decode rows equal the contiguous cache's one-row decode steps
    /// bit for bit: one sequence alone (its passes split over the threads
    /// when it has few KV heads) and two together, with and without a
    /// sliding window, over scattered blocks.
    #[test]
    fn long_paged_decode_equals_contiguous() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (sh, window) in [
            (AttnShape { n_heads: 9, n_kv_heads: 3, head_dim: 64 }, None),
            (AttnShape { n_heads: 4, n_kv_heads: 1, head_dim: 256 }, Some(300)),
        ] {
            let (nh, nkv, hd) = (sh.n_heads, sh.n_kv_heads, sh.head_dim);
            let (width, qd) = ((nh + 2 * nkv) * hd, nh * hd);
            let rope =
                Rope::new(hd, 10000.0, 1024).with_layout(false, window, 1.0 / (hd as f32).sqrt());
            // Two sequences: prompts of 500 and 333 tokens, 12 decode steps each.
            let (prompts, steps) = ([500usize, 333], 12);
            let data: Vec<Vec<f32>> = (0..2)
                .map(|q| {
                    let len = (prompts[q] + steps) * width;
                    (0..len)
                        .map(|i| (((i * (7919 + 2 * q)) % 2003) as f32 / 1000.0) - 1.0)
                        .collect()
                })
                .collect();
            let row = |q: usize, i: usize| data[q][i * width..(i + 1) * width].to_vec();
            // Contiguous: the prompt at once, then one row at a time.
            let mut want = vec![Vec::new(); 2];
            for q in 0..2 {
                let mut kv = LayerKv::default();
                let mut rows = data[q][..prompts[q] * width].to_vec();
                let mut out = vec![0f32; prompts[q] * qd];
                attend(sh, &rope, &mut rows, 0, &mut kv, &mut out);
                for i in prompts[q]..prompts[q] + steps {
                    let mut o = vec![0f32; qd];
                    attend(sh, &rope, &mut row(q, i), i, &mut kv, &mut o);
                    want[q].push(o);
                }
            }
            // Paged: scattered blocks; prefill in chunks, then decode steps
            // with both sequences, or each alone, in turn.
            let nb = |q: usize| (prompts[q] + steps).div_ceil(16);
            let mut pool = KvPool::new(1, sh, nb(0) + nb(1));
            let perm: Vec<u32> =
                (0..(nb(0) + nb(1)) as u32).map(|b| (b * 17) % (nb(0) + nb(1)) as u32).collect();
            let tables = [&perm[..nb(0)], &perm[nb(0)..]];
            for q in 0..2 {
                for c0 in (0..prompts[q]).step_by(256) {
                    let c1 = (c0 + 256).min(prompts[q]);
                    let mut rows = data[q][c0 * width..c1 * width].to_vec();
                    let seqs = [PagedSeqRef {
                        past: c0,
                        t: c1 - c0,
                        table: tables[q],
                        decode_from: prompts[q],
                    }];
                    let mut out = vec![0f32; (c1 - c0) * qd];
                    pool.attend(0, &rope, &mut rows, &seqs, &mut out);
                }
            }
            let mut pos = prompts;
            for step in 0..steps {
                let groups: Vec<Vec<usize>> =
                    if step % 2 == 0 { vec![vec![0, 1]] } else { vec![vec![0], vec![1]] };
                for g in groups {
                    let mut rows: Vec<f32> = g.iter().flat_map(|&q| row(q, pos[q])).collect();
                    let seqs: Vec<PagedSeqRef<'_>> = g
                        .iter()
                        .map(|&q| PagedSeqRef {
                            past: pos[q],
                            t: 1,
                            table: tables[q],
                            decode_from: prompts[q],
                        })
                        .collect();
                    let mut out = vec![0f32; g.len() * qd];
                    pool.attend(0, &rope, &mut rows, &seqs, &mut out);
                    for (k, &q) in g.iter().enumerate() {
                        let got = &out[k * qd..(k + 1) * qd];
                        let w = &want[q][pos[q] - prompts[q]];
                        assert_eq!(
                            bits(got),
                            bits(w),
                            "heads {nh}/{nkv}, sequence {q}, position {}",
                            pos[q]
                        );
                        pos[q] += 1;
                    }
                }
            }
        }
    }

    #[test]
    fn sliding_window_masks_keys_before_it() {
        let sh = AttnShape { n_heads: 2, n_kv_heads: 1, head_dim: 8 };
        let (width, qd, t) = (4 * 8, 16, 6);
        let data: Vec<f32> = (0..t * width).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
        let run = |rope: &Rope| {
            let mut a = data.clone();
            let mut out = vec![0f32; t * qd];
            attend(sh, rope, &mut a, 0, &mut LayerKv::default(), &mut out);
            out
        };
        let scale = 1.0 / 8f32.sqrt();
        let full = run(&Rope::new(8, 1e4, 16));
        // A window as long as the sequence masks nothing.
        assert_eq!(run(&Rope::new(8, 1e4, 16).with_layout(false, Some(t), scale)), full);
        // Window 1: each row sees only itself, so it gets its own (f16) V.
        let own = run(&Rope::new(8, 1e4, 16).with_layout(false, Some(1), scale));
        for i in 0..t {
            let v = &data[i * width + 24..i * width + 32];
            for h in 0..2 {
                let o = &own[i * qd + h * 8..i * qd + h * 8 + 8];
                assert!(o.iter().zip(v).all(|(a, b)| *a == r16(*b)), "row {i} head {h}");
            }
        }
        // Window 2 changes rows that had more than 2 keys, and the paged
        // kernel masks the same keys.
        let rope2 = Rope::new(8, 1e4, 16).with_layout(false, Some(2), scale);
        let w2 = run(&rope2);
        assert_eq!(w2[..2 * qd], full[..2 * qd]);
        assert_ne!(w2[3 * qd..], full[3 * qd..]);
        let mut pool = KvPool::new(1, sh, 2);
        let mut rows = data.clone();
        let mut paged = vec![0f32; t * qd];
        let seqs = [PagedSeqRef { past: 0, t, table: &[1], decode_from: t }];
        pool.attend(0, &rope2, &mut rows, &seqs, &mut paged);
        assert_eq!(paged, w2);
    }

    #[test]
    fn neox_rotates_halves() {
        let rope = Rope::new(4, 100.0, 4).with_layout(true, None, 1.0);
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        rope.apply(&mut x, 1);
        // Pairs (0, 2) at angle 1 and (1, 3) at angle 100^(-1/2) = 0.1.
        let (c0, s0, c1, s1) = (1f32.cos(), 1f32.sin(), 0.1f32.cos(), 0.1f32.sin());
        let want =
            [1.0 * c0 - 3.0 * s0, 2.0 * c1 - 4.0 * s1, 1.0 * s0 + 3.0 * c0, 2.0 * s1 + 4.0 * c1];
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{x:?} vs {want:?}");
        }
    }
}
