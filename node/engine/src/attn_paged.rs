//! Vectorised causal attention over the paged f16 K/V pool, in llama.cpp's
//! float order (the kernel behind [`crate::attn::KvPool::attend`]).
//!
//! A pool block holds, per KV head, K and V both transposed to
//! `[head_dim, 16 positions]`, so a block's 16 positions are the 16 SIMD
//! lanes: one load gives the same dimension of 16 keys. Every score is still
//! computed in exactly the order of llama.cpp's kernel for its row (see
//! [`crate::attn`]): lane `p` of an accumulator holds what the scalar dot
//! product's accumulator `i` holds for key `p`, and the 16-lane tree
//! reduction is done across accumulators instead of across lanes. The
//! results are therefore bit-identical to the contiguous [`crate::attn::attend`]
//! (tested there) while running 16 keys per instruction.
//!
//! Work is split into tasks of (sequence, KV head, up to 16 rows): a task
//! converts each f16 block it needs to f32 once and all its rows and query
//! heads share it (a prefill of n rows used to convert Σ(1..n) blocks).
//! Decode rows (one new position) take their own kernel, [`decode`]: K and
//! V read once per KV head for all its query heads, P·V accumulated in
//! registers, and a lone long row's keys and dimensions split over the
//! threads. Other single rows, when the batch is too small to keep every
//! thread busy, become one task per query head.

use std::cell::RefCell;

use half::f16;

use crate::numerics::{dot16, ggml_expf, reduce16, vec_dot_f16_order};

mod decode;
mod isa;
pub mod weights;

use isa::{Isa, Scalar};

/// Positions per block = SIMD lanes.
const L: usize = crate::paged::BLOCK_SIZE;
/// Rows of one sequence per prefill task (they share converted blocks).
const TILE: usize = 16;

/// Head counts and size.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// One sequence's rows in the batch.
#[derive(Debug, Clone, Copy)]
pub struct Seq<'a> {
    pub past: usize,
    pub t: usize,
    pub table: &'a [u32],
    /// Rows at positions >= this use the decode (single-row) order.
    pub decode_from: usize,
}

/// One layer's attention inputs. `qkv` rows have Q already rotated and
/// rounded to f16 precision, and the new rows' K/V are in the pool.
#[derive(Debug)]
pub struct Batch<'a> {
    pub qkv: &'a [f32],
    pub k: &'a [f16],
    pub v: &'a [f16],
    pub sh: Shape,
    pub seqs: &'a [Seq<'a>],
    pub scale: f32,
    /// Sliding window (`usize::MAX`: none).
    pub window: usize,
}

#[derive(Debug, Clone, Copy)]
struct Task {
    si: usize,
    /// Batch row of the sequence's row 0.
    row0: usize,
    /// Rows `i0..i1` of the sequence.
    i0: usize,
    i1: usize,
    kvh: usize,
    /// Query heads `h0..h1` of the KV head's group.
    h0: usize,
    h1: usize,
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::isa::x86::{Avx2, Avx512};

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn job_avx512(
        b: &super::Batch<'_>,
        j: super::Job<'_>,
        s: &mut super::Scratch,
    ) {
        super::job::<Avx512>(b, j, s)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn job_avx2(b: &super::Batch<'_>, j: super::Job<'_>, s: &mut super::Scratch) {
        super::job::<Avx2>(b, j, s)
    }
}

/// Which kernel this CPU runs (`ISA_*`); detected once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

fn kind() -> Kind {
    #[cfg(target_arch = "x86_64")]
    {
        let base = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        if base && std::is_x86_feature_detected!("avx512f") {
            return Kind::Avx512;
        }
        if base {
            return Kind::Avx2;
        }
    }
    Kind::Scalar
}

/// One unit of work on one thread.
enum Job<'a> {
    /// Rows of a sequence (see [`task`]); `out`: `[rows, heads, head_dim]`.
    Task(&'a Task, &'a mut [f32]),
    /// A decode row's scores over some of its blocks ([`decode::scores`]).
    Scores {
        r: &'a decode::Row,
        blocks: std::ops::Range<usize>,
        probs: &'a mut [f32],
        max: &'a mut [f32; decode::MAX_HEADS],
    },
    /// A decode row's softmax and P·V of some dims ([`decode::pv`]).
    Pv {
        r: &'a decode::Row,
        max: &'a [f32; decode::MAX_HEADS],
        probs: &'a [f32],
        dims: std::ops::Range<usize>,
        out: &'a mut [f32],
    },
}

/// Per-thread scratch, reused across layers and steps.
#[derive(Default)]
struct Scratch {
    /// Probabilities, accumulators, converted blocks.
    main: Vec<f32>,
    /// A decode row's.
    row: decode::RowScratch,
}

fn run_job(k: Kind, b: &Batch<'_>, j: Job<'_>) {
    // The scratch is borrowed out here: code inside `with`'s closure would
    // be compiled without the target features (`mul_add` as a libm call).
    SCRATCH.with(|s| {
        let s = &mut s.borrow_mut();
        match k {
            Kind::Scalar => job::<Scalar>(b, j, s),
            // SAFETY: the features were detected by `kind`.
            #[cfg(target_arch = "x86_64")]
            Kind::Avx2 => unsafe { x86::job_avx2(b, j, s) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Kind::Avx512 => unsafe { x86::job_avx512(b, j, s) },
        }
    })
}

#[inline(always)]
fn job<I: Isa>(b: &Batch<'_>, j: Job<'_>, s: &mut Scratch) {
    match j {
        Job::Task(t, out) => task::<I>(b, t, out, s),
        Job::Scores { r, blocks, probs, max } => {
            decode::scores::<I>(b, r, blocks, probs, max, &mut s.row)
        }
        Job::Pv { r, max, probs, dims, out } => {
            decode::pv::<I>(b, r, max, probs, dims, out, &mut s.row)
        }
    }
}

/// Attention of every batch row into `out` (`[rows, n_heads * head_dim]`).
pub fn attend(b: &Batch<'_>, out: &mut [f32]) {
    attend_with(kind(), b, out)
}

fn attend_with(k: Kind, b: &Batch<'_>, out: &mut [f32]) {
    let (nh, nkv, hd) = (b.sh.n_heads, b.sh.n_kv_heads, b.sh.head_dim);
    let g = nh / nkv;
    let rows: usize = b.seqs.iter().map(|s| s.t).sum();
    let threads = crate::par::threads();
    if decode::wants_split(b, threads) {
        return decode::split(k, b, out, threads);
    }
    // Too few (row, KV head) pairs to keep the threads busy: one task per
    // query head (each converts its blocks itself). Decode rows are not
    // split: they read each K/V block once for all the group's heads.
    let split_heads = rows * nkv < 4 * threads && g > 1;
    let mut tasks = Vec::new();
    let mut row0 = 0;
    for (si, s) in b.seqs.iter().enumerate() {
        for i0 in (0..s.t).step_by(TILE) {
            let i1 = (i0 + TILE).min(s.t);
            for kvh in 0..nkv {
                if split_heads && i1 - i0 == 1 && !decode::eligible(b, s, i0, g) {
                    tasks.extend((0..g).map(|h| Task { si, row0, i0, i1, kvh, h0: h, h1: h + 1 }));
                } else {
                    tasks.push(Task { si, row0, i0, i1, kvh, h0: 0, h1: g });
                }
            }
        }
        row0 += s.t;
    }
    let size = |t: &Task| (t.i1 - t.i0) * (t.h1 - t.h0) * hd;
    let cost: usize = b.seqs.iter().map(|s| (s.past + s.t) * s.t).sum::<usize>() * nh;
    let results: Vec<Vec<f32>> = if cost >= 2048 && tasks.len() > 1 {
        crate::par::map_indices(tasks.len(), |i| {
            let t = &tasks[i];
            let mut o = vec![0f32; size(t)];
            run_job(k, b, Job::Task(t, &mut o));
            o
        })
    } else {
        tasks
            .iter()
            .map(|t| {
                let mut o = vec![0f32; size(t)];
                run_job(k, b, Job::Task(t, &mut o));
                o
            })
            .collect()
    };
    // Scatter `[row, head, hd]` of each task into `[row, nh * hd]`.
    let qd = nh * hd;
    for (t, o) in tasks.iter().zip(&results) {
        let w = (t.h1 - t.h0) * hd;
        for (r, src) in (t.i0..t.i1).zip(o.chunks_exact(w)) {
            let at = (t.row0 + r) * qd + (t.kvh * g + t.h0) * hd;
            out[at..at + w].copy_from_slice(src);
        }
    }
}

thread_local! {
    /// Per-thread scratch (probabilities, accumulators, converted blocks),
    /// reused across layers and steps.
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// One task: rows `i0..i1` of a sequence, query heads `h0..h1` of KV head
/// `kvh`. `out`: `[rows, heads, head_dim]`.
#[inline(always)]
fn task<I: Isa>(b: &Batch<'_>, t: &Task, out: &mut [f32], scr: &mut Scratch) {
    let (nh, nkv, hd) = (b.sh.n_heads, b.sh.n_kv_heads, b.sh.head_dim);
    let g = nh / nkv;
    let width = (nh + 2 * nkv) * hd;
    let s = &b.seqs[t.si];
    if t.i1 - t.i0 == 1 && decode::eligible(b, s, t.i0, t.h1 - t.h0) {
        let r = decode::Row {
            si: t.si,
            row: t.row0 + t.i0,
            kvh: t.kvh,
            h0: t.h0,
            nheads: t.h1 - t.h0,
            keys: decode::Keys::of(b, s, t.i0),
        };
        return decode::row::<I>(b, &r, out, scr);
    }
    let scratch = &mut scr.main;
    let nrows = t.i1 - t.i0;
    let nheads = t.h1 - t.h0;
    // Keys of row i: positions lo(i)..n(i), n(i) = past + i + 1.
    let n_of = |i: usize| s.past + i + 1;
    let lo_of = |i: usize| n_of(i).saturating_sub(b.window);
    let nb_max = n_of(t.i1 - 1).div_ceil(L);
    let b_min = lo_of(t.i0) / L;
    let span = (nb_max - b_min) * L; // positions covered by the task
    let bsz = hd * L; // one block of one KV head
    let block_at = |bi: usize| {
        let off = (s.table[bi] as usize * nkv + t.kvh) * bsz;
        off..off + bsz
    };
    // Several rows: convert each block once up front for all of them; one
    // row: stream blocks through a one-block buffer.
    let buffered = nrows > 1;
    let conv = if buffered { 2 * span * hd } else { bsz };
    let npr = nrows * nheads;
    let acc_len = 4 * nheads * bsz;
    scratch.resize(npr * span + acc_len + conv, 0.0);
    let (probs, rest) = scratch.split_at_mut(npr * span);
    let (acc, cbuf) = rest.split_at_mut(acc_len);
    if buffered {
        let (kb, vb) = cbuf.split_at_mut(span * hd);
        for bi in b_min..nb_max {
            convert::<I>(&b.k[block_at(bi)], &mut kb[(bi - b_min) * bsz..][..bsz]);
            convert::<I>(&b.v[block_at(bi)], &mut vb[(bi - b_min) * bsz..][..bsz]);
        }
    }
    let q_of = |i: usize, h: usize| {
        let row = t.row0 + i;
        &b.qkv[row * width + (t.kvh * g + t.h0 + h) * hd..][..hd]
    };
    // Scores, block by block (probs[r * nheads + h] covers the task's span).
    let mut maxes = [f32::NEG_INFINITY; 4 * TILE];
    let mut maxes_vec;
    let maxes: &mut [f32] = if npr <= maxes.len() {
        &mut maxes[..npr]
    } else {
        maxes_vec = vec![f32::NEG_INFINITY; npr];
        &mut maxes_vec
    };
    for bi in b_min..nb_max {
        let kt: &[f32] = if buffered {
            &cbuf[(bi - b_min) * bsz..][..bsz]
        } else {
            convert::<I>(&b.k[block_at(bi)], &mut cbuf[..bsz]);
            &cbuf[..bsz]
        };
        for (r, i) in (t.i0..t.i1).enumerate() {
            let (n, lo) = (n_of(i), lo_of(i));
            if bi * L >= n || (bi + 1) * L <= lo {
                continue;
            }
            let single = s.past + i >= s.decode_from;
            for h in 0..nheads {
                let mut sc = [0f32; L];
                block_scores::<I>(single, q_of(i, h), kt, hd, &mut sc);
                let pr = &mut probs[(r * nheads + h) * span + (bi - b_min) * L..][..L];
                let m = &mut maxes[r * nheads + h];
                for l in 0..L {
                    let j = bi * L + l;
                    // Outside lo..n: -inf, which the softmax maps to 0.
                    pr[l] = if j >= lo && j < n { sc[l] * b.scale } else { f32::NEG_INFINITY };
                    if j >= lo && j < n {
                        *m = m.max(pr[l]);
                    }
                }
            }
        }
    }
    for (r, i) in (t.i0..t.i1).enumerate() {
        let (n, lo) = (n_of(i), lo_of(i));
        let (rb0, nb) = (lo / L, n.div_ceil(L));
        for h in 0..nheads {
            let pr = &mut probs[(r * nheads + h) * span..][(rb0 - b_min) * L..(nb - b_min) * L];
            softmax::<I>(pr, maxes[r * nheads + h]);
        }
    }
    // P·V, block by block into each head's accumulators; heads inner, so
    // a streamed V block is converted once for all of them (each head's
    // sequence of FMAs is the same as with heads outer).
    for (r, i) in (t.i0..t.i1).enumerate() {
        let (n, lo) = (n_of(i), lo_of(i));
        let (rb0, nb) = (lo / L, n.div_ceil(L));
        let single = s.past + i >= s.decode_from;
        let sets = if single { 4 } else { 1 };
        let acc = &mut acc[..nheads * sets * bsz];
        acc.iter_mut().for_each(|x| *x = 0.0);
        for bi in rb0..nb {
            let vt: &[f32] = if buffered {
                &cbuf[span * hd + (bi - b_min) * bsz..][..bsz]
            } else {
                convert::<I>(&b.v[block_at(bi)], &mut cbuf[..bsz]);
                &cbuf[..bsz]
            };
            let set = if single { bi % 4 } else { 0 };
            // Lanes at or past n of the last block hold later rows' or
            // stale values: zeroed, as llama.cpp's masked V is.
            let valid = (n - bi * L).min(L);
            for h in 0..nheads {
                let pr = &probs[(r * nheads + h) * span..];
                let pb: &[f32; L] = lanes(&pr[(bi - b_min) * L..]);
                let a = &mut acc[(h * sets + set) * bsz..][..bsz];
                block_pv::<I>(vt, pb, a, valid);
            }
        }
        for h in 0..nheads {
            let acc = &acc[h * sets * bsz..][..sets * bsz];
            let o = &mut out[(r * nheads + h) * hd..][..hd];
            for (d, od) in o.iter_mut().enumerate() {
                if single {
                    let at = |set: usize| I::ld(lanes(&acc[set * bsz + d * L..]));
                    let x = I::add(I::add(at(0), at(2)), I::add(at(1), at(3)));
                    let mut xs = [0f32; L];
                    I::st(x, &mut xs);
                    *od = reduce16(&xs);
                } else {
                    *od = reduce16(lanes(&acc[d * L..]));
                }
            }
        }
    }
}

#[inline(always)]
#[allow(clippy::expect_used)] // callers pass at least 16 lanes
fn lanes(x: &[f32]) -> &[f32; L] {
    x[..L].try_into().expect("16 lanes")
}

#[inline(always)]
#[allow(clippy::expect_used)] // callers pass 16 lanes
fn lanes_mut(x: &mut [f32]) -> &mut [f32; L] {
    (&mut x[..L]).try_into().expect("16 lanes")
}

#[inline(always)]
fn convert<I: Isa>(src: &[f16], dst: &mut [f32]) {
    for (d, s) in dst.as_chunks_mut::<L>().0.iter_mut().zip(src.chunks_exact(L)) {
        I::st(I::ld_f16(s), d);
    }
}

/// Scores of a block's 16 keys (`kt`: `[hd, 16]`) against `q`, unscaled,
/// each in the order of [`vec_dot_f16_order`] (`single`) or [`dot16`]:
/// vector `a[i]` holds, in lane `p`, the scalar dot's accumulator `i` for
/// key `p`, and the scalar tree reduction runs across the 16 vectors.
#[inline(always)]
fn block_scores<I: Isa>(single: bool, q: &[f32], kt: &[f32], hd: usize, out: &mut [f32; L]) {
    // Fixed-size chunks of K's rows (dimension e: `kr[e]`), so the
    // unrolled inner loops index without bounds checks.
    let kr: &[[f32; L]] = kt[..hd * L].as_chunks().0;
    if single && hd.is_multiple_of(64) {
        I::st(scores_single::<I>(q, hd, |e| I::ld(&kr[e])), out);
    } else if !single && hd.is_multiple_of(16) {
        let mut a = [I::zero(); L];
        let (qc, kc) = (q[..hd].as_chunks::<16>().0, kr.as_chunks::<16>().0);
        for (i, ai) in a.iter_mut().enumerate() {
            for (qc, kc) in qc.iter().zip(kc) {
                *ai = I::fma(I::splat(qc[i]), I::ld(&kc[i]), *ai);
            }
        }
        I::st(tree16::<I>(&a), out);
    } else {
        // Other head sizes: the reference dot per key.
        let mut k = vec![0f32; hd];
        for (p, o) in out.iter_mut().enumerate() {
            for (e, ke) in k.iter_mut().enumerate() {
                *ke = kt[e * L + p];
            }
            *o = if single {
                vec_dot_f16_order(q, &k)
            } else if hd.is_multiple_of(16) {
                dot16(q, &k)
            } else {
                q.iter().zip(&k).map(|(x, y)| x * y).sum()
            };
        }
    }
}

/// A block's 16 scores in [`vec_dot_f16_order`] (`hd` a multiple of 64;
/// `k(e)`: dimension `e` of the 16 keys): four accumulators, chunk `c` of
/// 16 dims to accumulator `c % 4`.
#[inline(always)]
fn scores_single<I: Isa>(q: &[f32], hd: usize, k: impl Fn(usize) -> I::V) -> I::V {
    let mut a = [I::zero(); L];
    let qm = q[..hd].as_chunks::<64>().0;
    for (i, ai) in a.iter_mut().enumerate() {
        let mut s = [I::zero(); 4];
        for (m, qm) in qm.iter().enumerate() {
            for (j, sj) in s.iter_mut().enumerate() {
                let e = 16 * j + i;
                *sj = I::fma(I::splat(qm[e]), k(64 * m + e), *sj);
            }
        }
        *ai = I::add(I::add(s[0], s[2]), I::add(s[1], s[3]));
    }
    tree16::<I>(&a)
}

/// [`reduce16`]'s tree, for 16 lanes at once.
#[inline(always)]
fn tree16<I: Isa>(a: &[I::V; L]) -> I::V {
    let t8: [I::V; 8] = std::array::from_fn(|i| I::add(a[8 + i], a[i]));
    let t4: [I::V; 4] = std::array::from_fn(|i| I::add(t8[4 + i], t8[i]));
    I::add(I::add(t4[0], t4[2]), I::add(t4[1], t4[3]))
}

/// `a[d][l] += v[d][l] * p[l]` for one block, lanes `>= valid` of `v` as 0.
#[inline(always)]
fn block_pv<I: Isa>(vt: &[f32], p: &[f32; L], a: &mut [f32], valid: usize) {
    let p = I::ld(p);
    for (ad, vd) in a.as_chunks_mut::<L>().0.iter_mut().zip(vt.as_chunks::<L>().0) {
        let v = if valid == L { I::ld(vd) } else { I::keep(I::ld(vd), valid) };
        I::st(I::fma(v, p, I::ld(ad)), ad);
    }
}

/// [`crate::attn`]'s softmax on whole blocks of scores (`-inf`: masked):
/// ggml's `expf`, the f64 sum of each 16-chunk's tree sum, one reciprocal,
/// probabilities rounded to f16. Leading fully masked blocks are left out
/// by the caller: they add exact zeros.
#[inline(always)]
fn softmax<I: Isa>(p: &mut [f32], max: f32) {
    let mut sum = 0f64;
    for ch in p.chunks_exact_mut(L) {
        let ch = lanes_mut(ch);
        exp16::<I>(ch, max);
        sum += reduce16(ch) as f64;
    }
    let inv = I::splat((1.0 / sum) as f32);
    for ch in p.as_chunks_mut::<L>().0 {
        I::st(I::round_f16(I::mul(I::ld(ch), inv)), ch);
    }
}

/// `x[l] = ggml_expf(x[l] - max)` ([`exp_lanes`]).
#[inline(always)]
fn exp16<I: Isa>(x: &mut [f32; L], max: f32) {
    *x = exp_lanes::<I>(I::sub(I::ld(x), I::splat(max)));
}

/// `ggml_expf` of each lane of `xv`, vectorised on the common range (the
/// scalar routine's `scalef` fast branch, the same operations lane by
/// lane), the lanes outside it (masked `-inf`, underflow) by the routine.
#[inline(always)]
fn exp_lanes<I: Isa>(xv: I::V) -> [f32; L] {
    let c = |bits: u32| I::splat(f32::from_bits(bits));
    let r = c(0x4b40_0000);
    let z = I::fma(xv, c(0x3fb8_aa3b), r);
    let n = I::sub(z, r);
    // -n exactly (a multiplication by -1 keeps the sign of zero).
    let mn = I::mul(n, I::splat(-1.0));
    let b = I::fma(mn, c(0x35bf_be8e), I::fma(mn, c(0x3f31_7200), xv));
    let u = I::mul(b, b);
    let j = I::fma(
        I::fma(
            I::fma(c(0x3c07_2010), b, c(0x3d2b_9f17)),
            u,
            I::fma(c(0x3e2a_af33), b, c(0x3eff_fedb)),
        ),
        u,
        I::fma(c(0x3f7f_fff6), b, I::splat(1.0)),
    );
    let mut y = [0f32; L];
    I::st(I::mul(j, I::pow2(n)), &mut y);
    if I::outside(n, -126.0, 127.0) {
        let (mut nn, mut xs) = ([0f32; L], [0f32; L]);
        I::st(n, &mut nn);
        I::st(xv, &mut xs);
        for l in 0..L {
            if !(-126.0..=127.0).contains(&nn[l]) {
                y[l] = ggml_expf(xs[l]);
            }
        }
    }
    y
}

#[cfg(test)]
mod tests;
