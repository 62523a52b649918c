//! Decode rows: one new position of a sequence, in llama.cpp's single-row
//! order (`head_dim` a multiple of 64), the shape of every decode step.
//!
//! A row's work is two passes over its keys. [`scores`] reads each K block
//! once for all the query heads of its KV head; [`pv`] takes the softmax
//! and keeps four dimensions' P·V accumulators in registers across every
//! block instead of loading and storing them per block. K and V are read
//! straight from the f16 pool. Each value is the result of the same
//! operations in the same order as in the general path of
//! [`super::task`] (the accumulator of set `bi % 4` takes its blocks in
//! increasing order), so the two are bit-identical.
//!
//! When a step has fewer (sequence, KV head) pairs than two per thread
//! (one long stream), [`split`] runs the scores of a pair's key ranges and
//! the P·V of its dimension ranges as separate tasks, so every thread
//! works and each K/V block is still read once, where one task per query
//! head reads it once per head: at long contexts the K/V reads are most of
//! a step's memory traffic.

use std::ops::Range;

use half::f16;

use super::{
    lanes, lanes_mut, run_job, scores_single, softmax, Batch, Isa, Job, Kind, Scratch, Seq, L,
};
use crate::numerics::reduce16;

/// Query heads of one KV head a decode row takes (more: the general path).
pub(super) const MAX_HEADS: usize = 8;

/// Blocks of keys from which one pair's passes are split over threads.
const SPLIT_FROM: usize = 16;

/// Keys of one decode row: positions `lo..n`, blocks `rb0..nb`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Keys {
    n: usize,
    lo: usize,
    rb0: usize,
    nb: usize,
}

impl Keys {
    pub(super) fn of(b: &Batch<'_>, s: &Seq<'_>, i: usize) -> Self {
        let n = s.past + i + 1;
        let lo = n.saturating_sub(b.window);
        Keys { n, lo, rb0: lo / L, nb: n.div_ceil(L) }
    }

    fn span(&self) -> usize {
        (self.nb - self.rb0) * L
    }
}

/// One decode row's query heads `h0..h0 + nheads` of KV head `kvh`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Row {
    pub si: usize,
    /// Batch row.
    pub row: usize,
    pub kvh: usize,
    pub h0: usize,
    pub nheads: usize,
    pub keys: Keys,
}

/// A decode row's per-thread scratch, reused across layers and steps.
#[derive(Debug, Default)]
pub(super) struct RowScratch {
    /// One converted K block.
    kbuf: Vec<f32>,
    /// The probabilities, per head.
    pbuf: Vec<f32>,
    /// The row's block offsets in the pool.
    offs: Vec<usize>,
}

/// Whether row `i` of `s` takes this path with `nheads` query heads.
pub(super) fn eligible(b: &Batch<'_>, s: &Seq<'_>, i: usize, nheads: usize) -> bool {
    s.past + i >= s.decode_from && b.sh.head_dim.is_multiple_of(64) && nheads <= MAX_HEADS
}

#[inline(always)]
fn block(b: &Batch<'_>, r: &Row, bi: usize) -> Range<usize> {
    let bsz = b.sh.head_dim * L;
    let off = (b.seqs[r.si].table[bi] as usize * b.sh.n_kv_heads + r.kvh) * bsz;
    off..off + bsz
}

/// Scaled and masked scores of `blocks` (some of the row's) into `probs`,
/// laid out `[block - blocks.start][head][16]`; `max[h]` is raised to each
/// head's largest score. `kbuf`: scratch for one converted K block.
#[inline(always)]
pub(super) fn scores<I: Isa>(
    b: &Batch<'_>,
    r: &Row,
    blocks: Range<usize>,
    probs: &mut [f32],
    max: &mut [f32; MAX_HEADS],
    scr: &mut RowScratch,
) {
    let kbuf = &mut scr.kbuf;
    let (nh, nkv, hd) = (b.sh.n_heads, b.sh.n_kv_heads, b.sh.head_dim);
    let g = nh / nkv;
    let width = (nh + 2 * nkv) * hd;
    let bsz = hd * L;
    let q = &b.qkv[r.row * width + (r.kvh * g + r.h0) * hd..][..r.nheads * hd];
    // Several heads share one f32 copy of each K block (an FMA takes its
    // operand from memory; a conversion is one more instruction).
    let shared = r.nheads > 1;
    kbuf.resize(if shared { bsz } else { 0 }, 0.0);
    let scale = I::splat(b.scale);
    let mut mx = [I::splat(f32::NEG_INFINITY); MAX_HEADS];
    let (n, lo) = (r.keys.n, r.keys.lo);
    for bi in blocks.clone() {
        let kb = &b.k[block(b, r, bi)];
        // Blocks are scattered over the pool, beyond the reach of the
        // hardware prefetcher.
        if bi + 1 < blocks.end {
            prefetch(&b.k[block(b, r, bi + 1)]);
        }
        if shared {
            super::convert::<I>(kb, kbuf);
        }
        // Lanes outside lo..n (the window's first block, the last block).
        let (l0, l1) = (lo.saturating_sub(bi * L), (n - bi * L).min(L));
        let out = &mut probs[(bi - blocks.start) * r.nheads * L..][..r.nheads * L];
        for (h, (m, o)) in mx.iter_mut().zip(out.chunks_exact_mut(L)).enumerate() {
            let qh = &q[h * hd..][..hd];
            let sc = if shared {
                let kr: &[[f32; L]] = kbuf[..bsz].as_chunks().0;
                scores_single::<I>(qh, hd, |e| I::ld(&kr[e]))
            } else {
                scores_single::<I>(qh, hd, |e| I::ld_f16(&kb[e * L..]))
            };
            let mut sc = I::mul(sc, scale);
            if l0 > 0 || l1 < L {
                let mut x = [0f32; L];
                I::st(sc, &mut x);
                x.iter_mut()
                    .enumerate()
                    .filter(|(l, _)| *l < l0 || *l >= l1)
                    .for_each(|(_, v)| *v = f32::NEG_INFINITY);
                sc = I::ld(&x);
            }
            *m = I::max(*m, sc);
            I::st(sc, lanes_mut(o));
        }
    }
    for (m, v) in max.iter_mut().zip(&mx[..r.nheads]) {
        let mut x = [0f32; L];
        I::st(*v, &mut x);
        *m = x.iter().fold(*m, |a, &v| a.max(v));
    }
}

/// The softmax of every head (its scores in `probs`, all the row's blocks,
/// laid out as [`scores`] writes them; `max` from there) and P·V for
/// dimensions `dims` (a multiple of 4 wide) into `out`
/// (`[head][dims.len()]`). `pbuf`: scratch for the probabilities.
#[inline(always)]
pub(super) fn pv<I: Isa>(
    b: &Batch<'_>,
    r: &Row,
    max: &[f32; MAX_HEADS],
    probs: &[f32],
    dims: Range<usize>,
    out: &mut [f32],
    scr: &mut RowScratch,
) {
    let RowScratch { pbuf, offs, .. } = scr;
    let keys = &r.keys;
    let span = keys.span();
    let nheads = r.nheads;
    offs.clear();
    offs.extend((keys.rb0..keys.nb).map(|bi| block(b, r, bi).start));
    pbuf.resize(nheads * span, 0.0);
    // Each head's probabilities contiguous, as the softmax takes them.
    for (h, p) in pbuf.chunks_exact_mut(span).enumerate() {
        for (blk, dst) in p.chunks_exact_mut(L).enumerate() {
            dst.copy_from_slice(&probs[(blk * nheads + h) * L..][..L]);
        }
        softmax::<I>(p, max[h]);
    }
    let w = dims.len();
    // Query heads in groups that share each converted V vector; the
    // group's accumulators (heads x dims x 4 sets) fill most registers.
    let mut h0 = 0;
    while h0 < nheads {
        let hs = (nheads - h0).min(4);
        let pr = &pbuf[h0 * span..];
        let o = &mut out[h0 * w..];
        match hs {
            1 => pv_group::<I, 1, 16>(b, keys, offs, pr, dims.clone(), o),
            2 => pv_group::<I, 2, 8>(b, keys, offs, pr, dims.clone(), o),
            3 => pv_group::<I, 3, 8>(b, keys, offs, pr, dims.clone(), o),
            _ => pv_group::<I, 4, 4>(b, keys, offs, pr, dims.clone(), o),
        }
        h0 += hs;
    }
}

/// P·V of `H` heads (probabilities `pr`: `[head][span]`) for `dims`, `D`
/// dimensions at a time, into `out` (`[head][dims.len()]`).
///
/// Set by set (set `bi % 4` as in the general path: each set's blocks in
/// increasing order), so one set's accumulators (`H * D` vectors) stay in
/// registers over all its blocks and each converted V vector serves `H`
/// heads.
#[inline(always)]
fn pv_group<I: Isa, const H: usize, const D: usize>(
    b: &Batch<'_>,
    keys: &Keys,
    offs: &[usize],
    pr: &[f32],
    dims: Range<usize>,
    out: &mut [f32],
) {
    let (n, rb0, nb, span) = (keys.n, keys.rb0, keys.nb, keys.span());
    let bsz = b.sh.head_dim * L;
    let w = dims.len();
    for d0 in dims.clone().step_by(D) {
        let mut sets = [[[I::zero(); D]; H]; 4];
        for (set, res) in sets.iter_mut().enumerate() {
            let mut acc = [[I::zero(); D]; H];
            // This set's first block at or after rb0.
            let mut bi = rb0 - rb0 % 4 + set;
            if bi < rb0 {
                bi += 4;
            }
            while bi < nb {
                let vb = &b.v[offs[bi - rb0]..][..bsz];
                // Each block's lines of these dims are scattered over the
                // pool: ask for a later block's now.
                if let Some(&ahead) = offs.get(bi + 8 - rb0) {
                    prefetch(&b.v[ahead + d0 * L..][..D * L]);
                }
                let p: [I::V; H] =
                    std::array::from_fn(|h| I::ld(lanes(&pr[h * span + (bi - rb0) * L..])));
                // Lanes at or past n hold later rows' or stale values.
                let valid = n - bi * L;
                for dd in 0..D {
                    let mut v = I::ld_f16(&vb[(d0 + dd) * L..]);
                    if valid < L {
                        v = I::keep(v, valid);
                    }
                    for h in 0..H {
                        acc[h][dd] = I::fma(v, p[h], acc[h][dd]);
                    }
                }
                bi += 4;
            }
            *res = acc;
        }
        for h in 0..H {
            for dd in 0..D {
                let at = |set: usize| sets[set][h][dd];
                let mut xs = [0f32; L];
                I::st(I::add(I::add(at(0), at(2)), I::add(at(1), at(3))), &mut xs);
                out[h * w + d0 - dims.start + dd] = reduce16(&xs);
            }
        }
    }
}

/// A whole decode row on this thread: `out` is `[head][head_dim]`.
#[inline(always)]
pub(super) fn row<I: Isa>(b: &Batch<'_>, r: &Row, out: &mut [f32], s: &mut Scratch) {
    let keys = r.keys;
    let len = r.nheads * keys.span();
    s.main.resize(len, 0.0);
    let mut max = [f32::NEG_INFINITY; MAX_HEADS];
    scores::<I>(b, r, keys.rb0..keys.nb, &mut s.main[..len], &mut max, &mut s.row);
    pv::<I>(b, r, &max, &s.main[..len], 0..b.sh.head_dim, out, &mut s.row);
}

/// Whether [`split`] takes this batch: every row a decode row of this
/// path, too few (sequence, KV head) pairs for the threads, and some row
/// with enough keys to be worth two passes.
pub(super) fn wants_split(b: &Batch<'_>, threads: usize) -> bool {
    let g = b.sh.n_heads / b.sh.n_kv_heads;
    threads > 1
        && b.seqs.len() * b.sh.n_kv_heads < 2 * threads
        && b.seqs.iter().all(|s| s.t == 1 && eligible(b, s, 0, g))
        && b.seqs.iter().any(|s| {
            let k = Keys::of(b, s, 0);
            k.nb - k.rb0 >= SPLIT_FROM
        })
}

/// Every row of a [`wants_split`] batch, its scores split by key ranges
/// and its P·V by dimension ranges over the threads.
pub(super) fn split(k: Kind, b: &Batch<'_>, out: &mut [f32], threads: usize) {
    let (nh, nkv, hd) = (b.sh.n_heads, b.sh.n_kv_heads, b.sh.head_dim);
    let g = nh / nkv;
    // One row per sequence: batch row si.
    let pairs: Vec<Row> = (0..b.seqs.len())
        .flat_map(|si| {
            let keys = Keys::of(b, &b.seqs[si], 0);
            (0..nkv).map(move |kvh| Row { si, row: si, kvh, h0: 0, nheads: g, keys })
        })
        .collect();
    let parts = (2 * threads).div_ceil(pairs.len()).max(1);
    // Pass 1: scores, each pair's blocks in `parts` ranges.
    let mut probs: Vec<Vec<f32>> = pairs.iter().map(|r| vec![0f32; g * r.keys.span()]).collect();
    let mut jobs = Vec::new();
    for (r, p) in pairs.iter().zip(probs.iter_mut()) {
        let (rb0, nb) = (r.keys.rb0, r.keys.nb);
        let per = (nb - rb0).div_ceil(parts);
        let mut rest: &mut [f32] = p;
        for b0 in (rb0..nb).step_by(per) {
            let b1 = (b0 + per).min(nb);
            let (mine, tail) = rest.split_at_mut((b1 - b0) * g * L);
            rest = tail;
            jobs.push((r, b0..b1, mine, [f32::NEG_INFINITY; MAX_HEADS]));
        }
    }
    crate::par::for_each_chunk_mut(&mut jobs, 1, |_, j| {
        let (r, blocks, probs, max) = &mut j[0];
        run_job(k, b, Job::Scores { r, blocks: blocks.clone(), probs, max })
    });
    let mut maxes = vec![[f32::NEG_INFINITY; MAX_HEADS]; pairs.len()];
    for (r, _, _, m) in &jobs {
        let pi = r.si * nkv + r.kvh;
        for (a, &v) in maxes[pi].iter_mut().zip(m) {
            *a = a.max(v);
        }
    }
    drop(jobs);
    // Pass 2: softmax and P·V, each pair's dimensions in `parts` ranges
    // (multiples of 16).
    let per = (hd / 16).div_ceil(parts) * 16;
    let jobs: Vec<(usize, Range<usize>)> = (0..pairs.len())
        .flat_map(|pi| (0..hd).step_by(per).map(move |d0| (pi, d0..(d0 + per).min(hd))))
        .collect();
    let results: Vec<Vec<f32>> = crate::par::map_indices(jobs.len(), |i| {
        let (pi, dims) = &jobs[i];
        let mut o = vec![0f32; g * dims.len()];
        let (max, probs) = (&maxes[*pi], &probs[*pi]);
        run_job(k, b, Job::Pv { r: &pairs[*pi], max, probs, dims: dims.clone(), out: &mut o });
        o
    });
    let qd = nh * hd;
    for ((pi, dims), o) in jobs.iter().zip(&results) {
        let r = &pairs[*pi];
        for (h, src) in o.chunks_exact(dims.len()).enumerate() {
            let at = r.row * qd + (r.kvh * g + h) * hd + dims.start;
            out[at..at + dims.len()].copy_from_slice(src);
        }
    }
}

/// Asks for every cache line of `x` (part of a K or V block).
#[inline(always)]
fn prefetch(x: &[f16]) {
    #[cfg(target_arch = "x86_64")]
    for line in x.chunks(32) {
        // SAFETY: a prefetch has no effect but on the caches, and the
        // address is in bounds (SSE: every x86_64).
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(line.as_ptr() as *const i8);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}
