//! RoPE with the paged K/V write, and paged attention over block tables.
//!
//! The K/V pool is one buffer per kind for all layers:
//! `[layer][block][kv_head][16 positions][head_dim]` (V is not transposed
//! as on the CPU: a unit per output dimension reads V rows coalesced).
//! Per batch row the host passes its position and its `slot`
//! (`block · 16 + pos % 16`) for the write, and for attention the offset of
//! its sequence's block table in one flat `tables` buffer.

use cubecl::prelude::*;

use super::q8::{fused, mul, round_f16};

/// Positions per K/V block (the block manager's `BLOCK_SIZE`).
pub const BLOCK: usize = 16;

/// Loads the float attention issues together before using them.
const GROUP: usize = 8;

/// Shapes of one attention layer, fixed for a model (`#[comptime]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeadShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// NEOX rotation `(x[i], x[i + d/2])`; else adjacent pairs (llama).
    pub neox: bool,
}

impl HeadShape {
    pub const fn width(&self) -> usize {
        (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
    }
    /// Elements of one block of one layer (all KV heads).
    pub const fn block_len(&self) -> usize {
        self.n_kv_heads * BLOCK * self.head_dim
    }
}

/// Pair `(x0, x1)` rotated by the angle of `(c, s)`; with `exact` in the
/// CPU's arithmetic, each rounded to f16 (see [`rope_kv_store`]).
#[cube]
pub fn rotate(
    x0: f32,
    x1: f32,
    c: f32,
    s: f32,
    #[comptime] exact: bool,
    #[comptime] wide: bool,
) -> (f32, f32) {
    if comptime!(exact) {
        let y0 = round_f16(fused(x0, c, -mul(x1, s, wide), wide));
        (y0, round_f16(fused(x0, s, mul(x1, c, wide), wide)))
    } else {
        (x0 * c - x1 * s, x0 * s + x1 * c)
    }
}

/// Element `d`'s RoPE pair in a head: `(i, a, b)`, its frequency index
/// and the pair's two elements (NEOX: `(i, i + d/2)`; else adjacent).
#[cube]
pub fn pair_of(d: usize, #[comptime] sh: HeadShape) -> (usize, usize, usize) {
    let half = comptime!(sh.head_dim / 2);
    if comptime!(sh.neox) {
        let i = d % half;
        (i, i, i + half)
    } else {
        let i = d / 2;
        (i, 2 * i, 2 * i + 1)
    }
}

/// Element `d` of the head at `o` in `qkv`, rotated for position `pos`:
/// the value [`rope_kv_store`] leaves there (`exact`, `wide` as there),
/// the pair computed the same way by each of its two units.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn rotated(
    qkv: &[f32],
    o: usize,
    d: usize,
    cos: &[f32],
    sin: &[f32],
    pos: usize,
    #[comptime] sh: HeadShape,
    #[comptime] exact: bool,
    #[comptime] wide: bool,
) -> f32 {
    let half = comptime!(sh.head_dim / 2);
    let (i, a, b) = pair_of(d, sh);
    let (c, s) = (cos[pos * half + i], sin[pos * half + i]);
    let (y0, y1) = rotate(qkv[o + a], qkv[o + b], c, s, exact, wide);
    select(d == a, y0, y1)
}

/// Row `cube_x` of `qkv = [q | k | v]`: rotate Q in place, rotate K and
/// write it and V to the row's slot in layer `layer_off`'s pool.
/// `cos`/`sin` are `[context, head_dim / 2]`. With `exact`, in the CPU's
/// arithmetic (`attn::Rope::apply`, `KvPool::attend`): each pair becomes
/// `(fma(x0, c, −x1·s), fma(x0, s, x1·c))`, Q is rounded to f16 in place
/// and K and V to f16 in the pool (`wide`: `fma`'s f64 stand-in,
/// `exact.rs`). Launch with `CubeCount (rows)`, `CubeDim (128)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn rope_kv_store<KV: Float>(
    qkv: &mut [f32],
    k_pool: &mut [KV],
    v_pool: &mut [KV],
    cos: &[f32],
    sin: &[f32],
    row_pos: &[u32],
    row_slot: &[u32],
    layer_off: usize,
    #[comptime] sh: HeadShape,
    #[comptime] exact: bool,
    #[comptime] wide: bool,
) {
    let row = CUBE_POS_X as usize;
    let tid = UNIT_POS_X as usize;
    let threads = CUBE_DIM_X as usize;
    let hd = comptime!(sh.head_dim);
    let half = comptime!(sh.head_dim / 2);
    let (nh, nkv) = comptime!((sh.n_heads, sh.n_kv_heads));
    let qd = nh * hd;
    let base = row * comptime!(sh.width());
    let pos = row_pos[row] as usize;
    let slot = row_slot[row] as usize;
    let (blk, off) = (slot / BLOCK, slot % BLOCK);
    let pool_base = layer_off + blk * comptime!(sh.block_len());
    let mut p = tid;
    while p < (nh + nkv) * half {
        let (head, i) = (p / half, p % half);
        let (a, b) = if comptime!(sh.neox) { (i, i + half) } else { (2 * i, 2 * i + 1) };
        let o = base + head * hd;
        let (x0, x1) = (qkv[o + a], qkv[o + b]);
        let (c, s) = (cos[pos * half + i], sin[pos * half + i]);
        let (y0, y1) = rotate(x0, x1, c, s, exact, wide);
        if head < nh {
            qkv[o + a] = y0;
            qkv[o + b] = y1;
        } else {
            let kv = pool_base + ((head - nh) * BLOCK + off) * hd;
            k_pool[kv + a] = KV::cast_from(y0);
            k_pool[kv + b] = KV::cast_from(y1);
        }
        p += threads;
    }
    let mut e = tid;
    while e < nkv * hd {
        let (h, d) = (e / hd, e % hd);
        let kv = pool_base + (h * BLOCK + off) * hd + d;
        let mut v = qkv[base + qd + nkv * hd + e];
        if comptime!(exact) {
            v = round_f16(v);
        }
        v_pool[kv] = KV::cast_from(v);
        e += threads;
    }
}

/// Causal attention of batch row `cube_x` over the `row_pos + 1`
/// positions of its sequence (keys before `pos + 1 − window` masked when
/// `window > 0`), for query head `cube_y`, or with `per_kv_head` for the
/// `G = n_heads / n_kv_heads` query heads of KV head `cube_y` (GQA: each K
/// row and V element loaded once for the `G`, their reductions sharing
/// the synchronisations). One pass over the keys in chunks of `T` (the
/// cube's units, `T ≥ head_dim`, a power of two) with an online softmax:
/// each unit scores one key of a chunk, the chunk's max and sum meet in
/// shared memory, and unit `d < head_dim` accumulates output dimension
/// `d`. Every head's arithmetic is the same operations in the same order
/// either way, so the two forms agree bit for bit and the choice is speed
/// only (`launch::AttentionKernel`). Decode rows and prefill rows are the
/// same kernel. With `rope` ([`rope_kv_store`]'s float work, where every
/// row is its sequence's only row in the step: a decode step) the cube
/// rotates its queries as it loads them and writes its row's rotated K
/// and its V to the row's slot itself, before reading the keys: one
/// launch fewer a layer. The cubes of a row's query heads that share a KV
/// head write the same values there. `out` in f32, or each value rounded
/// to f16 at the end (the dense step's matmul input). Launch with
/// `CubeCount (rows, n_heads)` (with `per_kv_head`: `n_kv_heads`),
/// `CubeDim (T)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<KV: Float, O: Float>(
    qkv: &[f32],
    k_pool: &mut [KV],
    v_pool: &mut [KV],
    out: &mut [O],
    cos: &[f32],
    sin: &[f32],
    row_pos: &[u32],
    row_slot: &[u32],
    row_table: &[u32],
    tables: &[u32],
    layer_off: usize,
    scale: f32,
    window: usize,
    #[comptime] sh: HeadShape,
    #[comptime] t: usize,
    #[comptime] per_kv_head: bool,
    #[comptime] rope: bool,
) {
    let row = CUBE_POS_X as usize;
    let tid = UNIT_POS_X as usize;
    let hd = comptime!(sh.head_dim);
    let nh = comptime!(sh.n_heads);
    let group = comptime!(sh.n_heads / sh.n_kv_heads);
    // Query heads h0 .. h0 + g, all of KV head kvh.
    let g = comptime!(if per_kv_head { group } else { 1 });
    let h0 = CUBE_POS_Y as usize * g;
    let kvh = h0 / group;
    let bl = comptime!(sh.block_len());
    let n = row_pos[row] as usize + 1;
    let toff = row_table[row] as usize;
    let lo = select(window > 0 && n > window, n - window, 0usize);

    // Head h0 + i's query at q[i · hd ..], its chunk's scores and
    // probabilities at p[i · t ..] and red[i · t ..].
    let mut q = Shared::new_slice(comptime!(g * hd));
    let base = row * comptime!(sh.width());
    if tid < hd {
        #[unroll]
        for i in 0..g {
            let o = base + (h0 + i) * hd;
            q[i * hd + tid] = if comptime!(rope) {
                rotated(qkv, o, tid, cos, sin, n - 1, sh, false, false)
            } else {
                qkv[o + tid]
            };
        }
        if comptime!(rope) {
            // The row's own K and V (KV head kvh) into its slot.
            let slot = row_slot[row] as usize;
            let kv = layer_off + (slot / BLOCK) * bl + (kvh * BLOCK + slot % BLOCK) * hd + tid;
            let ko = base + comptime!(nh * sh.head_dim) + kvh * hd;
            let k = rotated(qkv, ko, tid, cos, sin, n - 1, sh, false, false);
            k_pool[kv] = KV::cast_from(k);
            v_pool[kv] = KV::cast_from(qkv[ko + comptime!(sh.n_kv_heads * sh.head_dim) + tid]);
        }
    }
    let mut p = Shared::new_slice(comptime!(g * t));
    let mut red = Shared::new_slice(comptime!(g * t));
    if comptime!(rope) {
        // The slot's writes visible to the cube's units that read it.
        sync_storage();
    } else {
        sync_cube();
    }

    let mut m = Array::<f32>::new(g);
    let mut l = Array::<f32>::new(g);
    let mut acc = Array::<f32>::new(g);
    let mut score = Array::<f32>::new(g);
    let mut m_new = Array::<f32>::new(g);
    #[unroll]
    for i in 0..g {
        // Finite stand-in for −∞, so exp(m − m') never sees ∞ − ∞.
        m[i] = -3.0e38f32;
        l[i] = 0.0f32;
        acc[i] = 0.0f32;
    }
    let mut c0 = lo;
    while c0 < n {
        let j = c0 + tid;
        #[unroll]
        for i in 0..g {
            score[i] = -3.0e38f32;
        }
        if j < n {
            let kb =
                layer_off + tables[toff + j / BLOCK] as usize * bl + (kvh * BLOCK + j % BLOCK) * hd;
            let mut s = Array::<f32>::new(g);
            #[unroll]
            for i in 0..g {
                s[i] = 0.0f32;
            }
            // Eight loads issued before their eight products (a unit's
            // loads do not wait on each other's products); the products
            // in `d` order as ever.
            let mut kv = Array::<f32>::new(GROUP);
            for d0 in 0..comptime!(sh.head_dim / GROUP) {
                #[unroll]
                for u in 0..GROUP {
                    kv[u] = f32::cast_from(k_pool[kb + d0 * GROUP + u]);
                }
                #[unroll]
                for u in 0..GROUP {
                    #[unroll]
                    for i in 0..g {
                        s[i] += q[i * hd + d0 * GROUP + u] * kv[u];
                    }
                }
            }
            #[unroll]
            for d in comptime!(sh.head_dim - sh.head_dim % GROUP)..hd {
                let k = f32::cast_from(k_pool[kb + d]);
                #[unroll]
                for i in 0..g {
                    s[i] += q[i * hd + d] * k;
                }
            }
            #[unroll]
            for i in 0..g {
                score[i] = s[i] * scale;
            }
        }
        #[unroll]
        for i in 0..g {
            red[i * t + tid] = score[i];
        }
        sync_cube();
        let mut stride = (t / 2).runtime();
        while stride > 0 {
            if tid < stride {
                #[unroll]
                for i in 0..g {
                    red[i * t + tid] = f32::max(red[i * t + tid], red[i * t + tid + stride]);
                }
            }
            sync_cube();
            stride /= 2;
        }
        #[unroll]
        for i in 0..g {
            m_new[i] = f32::max(m[i], red[i * t]);
        }
        sync_cube();
        #[unroll]
        for i in 0..g {
            let pj = select(j < n, f32::exp(score[i] - m_new[i]), 0.0f32);
            p[i * t + tid] = pj;
            red[i * t + tid] = pj;
        }
        sync_cube();
        let mut stride = (t / 2).runtime();
        while stride > 0 {
            if tid < stride {
                #[unroll]
                for i in 0..g {
                    red[i * t + tid] = red[i * t + tid] + red[i * t + tid + stride];
                }
            }
            sync_cube();
            stride /= 2;
        }
        let mut alpha = Array::<f32>::new(g);
        #[unroll]
        for i in 0..g {
            alpha[i] = f32::exp(m[i] - m_new[i]);
            l[i] = l[i] * alpha[i] + red[i * t];
        }
        if tid < hd {
            let mut a = Array::<f32>::new(g);
            #[unroll]
            for i in 0..g {
                a[i] = acc[i] * alpha[i];
            }
            let cn = select(n - c0 < t, n - c0, t);
            // The chunk's keys in order, their V loads issued eight at a
            // time ahead of the products (one load's latency per eight
            // keys, not per key), then the rest one by one.
            let mut vv = Array::<f32>::new(GROUP);
            let mut k = 0usize;
            while k + GROUP <= cn {
                #[unroll]
                for u in 0..GROUP {
                    let jj = c0 + k + u;
                    let vb = layer_off
                        + tables[toff + jj / BLOCK] as usize * bl
                        + (kvh * BLOCK + jj % BLOCK) * hd;
                    vv[u] = f32::cast_from(v_pool[vb + tid]);
                }
                #[unroll]
                for u in 0..GROUP {
                    #[unroll]
                    for i in 0..g {
                        a[i] += p[i * t + k + u] * vv[u];
                    }
                }
                k += GROUP;
            }
            while k < cn {
                let jj = c0 + k;
                let vb = layer_off
                    + tables[toff + jj / BLOCK] as usize * bl
                    + (kvh * BLOCK + jj % BLOCK) * hd;
                let v = f32::cast_from(v_pool[vb + tid]);
                #[unroll]
                for i in 0..g {
                    a[i] += p[i * t + k] * v;
                }
                k += 1;
            }
            #[unroll]
            for i in 0..g {
                acc[i] = a[i];
            }
        }
        #[unroll]
        for i in 0..g {
            m[i] = m_new[i];
        }
        sync_cube();
        c0 += t;
    }
    if tid < hd {
        #[unroll]
        for i in 0..g {
            out[row * nh * hd + (h0 + i) * hd + tid] = O::cast_from(acc[i] / l[i]);
        }
    }
}

/// Copy block `src` to `dst` in every layer of both pools (copy-on-write).
/// Launch over `n_layers · block_len` units.
#[cube(launch)]
pub fn copy_block<KV: Float>(
    k_pool: &mut [KV],
    v_pool: &mut [KV],
    src: usize,
    dst: usize,
    block_len: usize,
    layer_len: usize,
    n_layers: usize,
) {
    let p = ABSOLUTE_POS;
    if p < n_layers * block_len {
        let (li, e) = (p / block_len, p % block_len);
        let (s, d) = (li * layer_len + src * block_len + e, li * layer_len + dst * block_len + e);
        k_pool[d] = k_pool[s];
        v_pool[d] = v_pool[s];
    }
}
