//! The rest of the CPU decoder's arithmetic on the GPU, bit for bit: the
//! embedding rows, attention in llama.cpp's order and SwiGLU with ggml's
//! `expf` (RoPE with the f16 K/V write is `attention::rope_kv_store`'s
//! `exact`). With [`super::q8`]'s matmuls and
//! norm every op of a llama step equals the CPU's, so a GPU worker's
//! greedy tokens equal a CPU worker's (and llama.cpp's): issue 17's parity.
//!
//! Besides following the CPU's order of operations, two hazards:
//! - **CUDA contracts.** cubecl-llvm marks every f32 add, sub and mul
//!   `contract`, so LLVM may fuse a product into the add that follows it;
//!   the CPU rounds the product first. A product that can reach an add is
//!   taken with [`super::q8::mul`]: `fma(a, b, −0)` rounds once and carries no flag
//!   to contract with (LLVM may turn it back into a plain `fmul`, also
//!   without the flag).
//! - **wgpu's `fma` may round twice** (lavapipe's does): `wide` takes
//!   [`fused`]'s f64 stand-in, as the q8 matmul.

use cubecl::prelude::*;

use super::attention::{pair_of, rotate, HeadShape, BLOCK};
use super::q8::{self, fused, mul, round_f16};
use super::quant::{f16_to_f32, WeightKind};

/// `2^e` for `e` in −126..=127 (clamped there).
#[cube]
fn pow2(e: i32) -> f32 {
    let e = select(e > 127i32, 127i32, select(e < -126i32, -126i32, e));
    f32::reinterpret(u32::cast_from(e + 127) << 23)
}

/// `numerics::ggml_expf`: ggml's vectorised `expf`, the same single IEEE
/// operations in the same order (its `scalef` too, over- and underflow).
/// `n != n` is its NaN test, and `max(min(..))` clamps only the integer
/// conversion (the clamped value is never returned).
#[cube]
#[allow(clippy::eq_op, clippy::manual_clamp)]
pub fn ggml_expf(x: f32, #[comptime] wide: bool) -> f32 {
    let r = f32::reinterpret(0x4b40_0000u32);
    let z = fused(x, f32::reinterpret(0x3fb8_aa3bu32), r, wide);
    let n = z - r;
    let mn = -n;
    let inner = fused(mn, f32::reinterpret(0x3f31_7200u32), x, wide);
    let b = fused(mn, f32::reinterpret(0x35bf_be8eu32), inner, wide);
    let u = b * b;
    let p0 = fused(f32::reinterpret(0x3c07_2010u32), b, f32::reinterpret(0x3d2b_9f17u32), wide);
    let p1 = fused(f32::reinterpret(0x3e2a_af33u32), b, f32::reinterpret(0x3eff_fedbu32), wide);
    let p2 = fused(f32::reinterpret(0x3f7f_fff6u32), b, 1.0f32, wide);
    let j = fused(fused(p0, u, p1, wide), u, p2, wide);
    // scalef(j, n): one rounding in range, two beyond it (as the CPU).
    let ni = i32::cast_from(f32::max(f32::min(n, 192.0f32), -192.0f32));
    let mid = mul(j, pow2(ni), wide);
    let high = mul(j * pow2(127i32), pow2(ni - 127), wide);
    let low = mul(j * pow2(-126i32), pow2(ni + 126), wide);
    let scaled = select(ni > 127, high, select(ni < -126, low, mid));
    let inf = f32::reinterpret(0x7f80_0000u32);
    let out = select(f32::abs(n) > 192.0f32, select(n <= 0.0f32, 0.0f32, inf), scaled);
    select(n != n, f32::reinterpret(0x7fc0_0000u32), out)
}

/// `numerics::reduce16`: halve 16 → 8 → 4 → 2 → 1.
#[cube]
fn reduce16(a: &Array<f32>) -> f32 {
    let mut t8 = Array::<f32>::new(8usize);
    #[unroll]
    for i in 0..8usize {
        t8[i] = a[8 + i] + a[i];
    }
    let mut t4 = Array::<f32>::new(4usize);
    #[unroll]
    for i in 0..4usize {
        t4[i] = t8[4 + i] + t8[i];
    }
    (t4[0] + t4[2]) + (t4[1] + t4[3])
}

/// `ggml_silu(g) · u`: an element of `numerics::swiglu_rows`.
#[cube]
pub fn silu_mul_exact(g: f32, u: f32, #[comptime] wide: bool) -> f32 {
    g / (1.0f32 + ggml_expf(0.0f32 - g, wide)) * u
}

/// `act = ggml_silu(gate) · up` (`numerics::swiglu_rows`). Launch over
/// `act.len()` units, 256 a cube.
#[cube(launch)]
pub fn swiglu_exact(gu: &[f32], act: &mut [f32], inter: usize, #[comptime] wide: bool) {
    let p = ABSOLUTE_POS;
    if p < act.len() {
        let (j, i) = (p / inter, p % inter);
        let g = gu[j * 2 * inter + i];
        let u = gu[j * 2 * inter + inter + i];
        act[p] = silu_mul_exact(g, u, wide);
    }
}

/// [`swiglu_exact`] fused with [`q8::quantize_q8`]: block `b` of the
/// activations `act[n, inter]`, each value computed as `swiglu_exact`
/// computes it, quantized as `quantize_q8` quantizes (the down
/// projection's input without the `act` round trip: one launch fewer a
/// layer). Launch with `CubeDim (64)`, `CubeCount (blocks.div_ceil(64))`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn swiglu_quantize_q8(
    gu: &[f32],
    qs: &mut [u32],
    d: &mut [f32],
    s: &mut [f32],
    sum_q: &mut [i32],
    blocks: usize,
    inter: usize,
    #[comptime] wide: bool,
) {
    let b = ABSOLUTE_POS_X as usize;
    if b < blocks {
        let (j, c) = ((b * 32) / inter, (b * 32) % inter);
        let o = j * 2 * inter + c;
        let mut v = Array::<f32>::new(32usize);
        #[unroll]
        for e in 0..32usize {
            v[e] = silu_mul_exact(gu[o + e], gu[o + inter + e], wide);
        }
        q8::quantize_block(&v, b, qs, d, s, sum_q);
    }
}

/// Embedding rows as the CPU's `QMatrix::row_f32`: `q · d` (Q4_1: then
/// `+ m`, the product rounded first). One unit an element; launch over
/// `tokens · cols` units, 256 a cube.
#[cube(launch)]
pub fn embed_exact(
    w: &[u32],
    tokens: &[u32],
    x: &mut [f32],
    cols: usize,
    n: usize,
    #[comptime] kind: WeightKind,
    #[comptime] wide: bool,
) {
    let p = ABSOLUTE_POS;
    if p < n * cols {
        let (i, e) = (p / cols, p % cols);
        let (b, k) = (e / 32, e % 32);
        let words = comptime!(kind.words());
        let base = (tokens[i] as usize * (cols / 32) + b) * words;
        let w0 = w[base];
        let d = f16_to_f32(w0 & 0xffff);
        match comptime!(kind) {
            WeightKind::Q8_0 => {
                let byte = (w[base + 1 + k / 4] >> (8 * (k % 4) as u32)) & 255;
                let q = i32::cast_from(byte) - select(byte >= 128, 256i32, 0i32);
                x[p] = f32::cast_from(q) * d;
            }
            _ => {
                // Byte k % 16: low nibble element k, high element k + 16.
                let kk = k % 16;
                let byte = (w[base + 1 + kk / 4] >> (8 * (kk % 4) as u32)) & 255;
                let q = select(k < 16, byte & 15, byte >> 4);
                if comptime!(kind == WeightKind::Q4_1) {
                    x[p] = mul(f32::cast_from(q), d, wide) + f16_to_f32(w0 >> 16);
                } else {
                    x[p] = f32::cast_from(i32::cast_from(q) - 8) * d;
                }
            }
        }
    }
}

/// Q·K of one key in llama.cpp's order for the row's kind (`attn::qk_dot`):
/// a decode row (`single`) takes `ggml_vec_dot_f16`'s (four 16-lane
/// accumulators over 64-element chunks, the rest in f64), a prefill row
/// tinyBLAS's (16 lanes, [`reduce16`]). `q` and `k` start at `qo`, `ko`
/// (only read; `&mut` as the attention holds them, which writes the
/// rotated Q and K/V first in a decode step).
#[cube]
#[allow(clippy::too_many_arguments, unused_assignments)]
fn qk_dot<KV: Float>(
    qkv: &mut [f32],
    qo: usize,
    k_pool: &mut [KV],
    ko: usize,
    single: bool,
    #[comptime] hd: usize,
    #[comptime] wide: bool,
) -> f32 {
    let mut x = Array::<f32>::new(16usize);
    let mut out = 0.0f32.runtime();
    if single {
        let np = comptime!(hd - hd % 64);
        #[unroll]
        for l in 0..16usize {
            let mut a = Array::<f32>::new(4usize);
            #[unroll]
            for j in 0..4usize {
                a[j] = 0.0f32;
            }
            #[unroll]
            for c in 0..comptime!(np / 64) {
                #[unroll]
                for j in 0..4usize {
                    let e = 64 * c + 16 * j + l;
                    a[j] = fused(qkv[qo + e], f32::cast_from(k_pool[ko + e]), a[j], wide);
                }
            }
            x[l] = (a[0] + a[2]) + (a[1] + a[3]);
        }
        let mut sum = f64::cast_from(reduce16(&x));
        #[unroll]
        for e in np..hd {
            sum += f64::cast_from(mul(qkv[qo + e], f32::cast_from(k_pool[ko + e]), wide));
        }
        out = f32::cast_from(sum);
    } else {
        #[unroll]
        for l in 0..16usize {
            x[l] = 0.0f32;
        }
        #[unroll]
        for c in 0..comptime!(hd / 16) {
            #[unroll]
            for l in 0..16usize {
                let e = 16 * c + l;
                x[l] = fused(qkv[qo + e], f32::cast_from(k_pool[ko + e]), x[l], wide);
            }
        }
        out = reduce16(&x);
    }
    out
}

/// Units of a [`paged_attention_exact`] cube.
pub const EXACT_THREADS: usize = 256;
/// P·V accumulators per output dimension of a decode row
/// (`ggml_vec_dot_f16`: 4 × 16 lanes); a prefill row has 16.
const DECODE_LANES: usize = 64;

/// `attention::paged_attention` in the CPU's arithmetic (`attn::head`):
/// Q·K by the row's order ([`qk_dot`]), times the scale; the max; each
/// `ggml_expf(s − max)`; their sum as the CPU's (16 keys summed by
/// [`reduce16`], those sums added in f64 in key order); `p = f16(e · inv)`
/// with `inv = 1 / sum` in f64; and `out[d] = Σ p · v[d]` with the same
/// accumulators as the CPU: accumulator `a` of `A` (64 for a decode row,
/// 16 for a prefill row) takes the keys `a, a + A, …` in order by `fma`,
/// and the accumulators meet as the CPU's. Keys are scored three times
/// (for the max, the sum, the products) rather than kept: no scratch
/// buffer, whatever the context. `row_single[r] != 0` marks a decode-order
/// row (its position ≥ its sequence's `decode_from`). The head's output is
/// also quantized as `q8::quantize_q8` quantizes the attention rows (its
/// `head_dim / 32` blocks: the O projection's input, one launch fewer a
/// layer). With `rope` (a decode step: every row its sequence's only one)
/// the cube first does `rope_kv_store`'s exact work for its head: its Q
/// rotated in place, the row's K and V into its slot (the cubes of a KV
/// head's query heads write the same values), one launch fewer a layer.
/// Launch with `CubeCount (rows, n_heads)`, `CubeDim (EXACT_THREADS)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_exact<KV: Float>(
    qkv: &mut [f32],
    k_pool: &mut [KV],
    v_pool: &mut [KV],
    out: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    row_pos: &[u32],
    row_slot: &[u32],
    row_table: &[u32],
    row_single: &[u32],
    tables: &[u32],
    qs: &mut [u32],
    qd: &mut [f32],
    qsum: &mut [f32],
    qsum_q: &mut [i32],
    layer_off: usize,
    scale: f32,
    window: usize,
    #[comptime] sh: HeadShape,
    #[comptime] wide: bool,
    #[comptime] rope: bool,
) {
    let t = comptime!(EXACT_THREADS);
    let row = CUBE_POS_X as usize;
    let h = CUBE_POS_Y as usize;
    let tid = UNIT_POS_X as usize;
    let hd = comptime!(sh.head_dim);
    let (nh, nkv) = comptime!((sh.n_heads, sh.n_kv_heads));
    let kvh = h / (nh / nkv);
    let bl = comptime!(sh.block_len());
    let n = row_pos[row] as usize + 1;
    let toff = row_table[row] as usize;
    let single = row_single[row] != 0;
    let lo = select(window > 0 && n > window, n - window, 0usize);
    let qo = row * comptime!(sh.width()) + h * hd;
    let mut red = Shared::new_slice(t);
    let mut pt = Shared::new_slice(t);
    let mut accs = Shared::new_slice(comptime!(DECODE_LANES * sh.head_dim));
    let mut one = Shared::new_slice(1usize);

    if comptime!(rope) {
        let slot = row_slot[row] as usize;
        let kvo = layer_off + (slot / BLOCK) * bl + (kvh * BLOCK + slot % BLOCK) * hd + tid;
        let ko = row * comptime!(sh.width()) + nh * hd + kvh * hd;
        let mut yq = 0.0f32.runtime();
        let mut yk = 0.0f32.runtime();
        let mut yv = 0.0f32.runtime();
        if tid < hd {
            // `attention::rotated`'s pair, read here (`qkv` is writable).
            let (i, a, b) = pair_of(tid, sh);
            let half = comptime!(sh.head_dim / 2);
            let (c, s) = (cos[(n - 1) * half + i], sin[(n - 1) * half + i]);
            let (q0, q1) = rotate(qkv[qo + a], qkv[qo + b], c, s, true, wide);
            let (k0, k1) = rotate(qkv[ko + a], qkv[ko + b], c, s, true, wide);
            yq = select(tid == a, q0, q1);
            yk = select(tid == a, k0, k1);
            yv = round_f16(qkv[ko + nkv * hd + tid]);
        }
        // Every unit has read its pair before the head's Q is rewritten.
        sync_cube();
        if tid < hd {
            qkv[qo + tid] = yq;
            k_pool[kvo] = KV::cast_from(yk);
            v_pool[kvo] = KV::cast_from(yv);
        }
        sync_storage();
    }

    // The max score.
    // Finite stand-in for −∞: every score is above it.
    let mut m = (-3.0e38f32).runtime();
    let mut j = lo + tid;
    while j < n {
        let ko =
            layer_off + tables[toff + j / BLOCK] as usize * bl + (kvh * BLOCK + j % BLOCK) * hd;
        m = f32::max(m, mul(qk_dot(qkv, qo, k_pool, ko, single, hd, wide), scale, wide));
        j += t;
    }
    red[tid] = m;
    sync_cube();
    let mut stride = (t / 2).runtime();
    while stride > 0 {
        if tid < stride {
            red[tid] = f32::max(red[tid], red[tid + stride]);
        }
        sync_cube();
        stride /= 2;
    }
    let max = red[0];
    sync_cube();

    // The sum: 16 keys a unit, their sums added in key order by unit 0.
    let mut total = 0.0f64.runtime();
    let mut c0 = lo / 16;
    let chunks = n.div_ceil(16);
    while c0 < chunks {
        let c = c0 + tid;
        let mut e = Array::<f32>::new(16usize);
        #[unroll]
        for l in 0..16usize {
            let k = c * 16 + l;
            let mut v = 0.0f32.runtime();
            if k >= lo && k < n {
                let ko = layer_off
                    + tables[toff + k / BLOCK] as usize * bl
                    + (kvh * BLOCK + k % BLOCK) * hd;
                let s = mul(qk_dot(qkv, qo, k_pool, ko, single, hd, wide), scale, wide);
                v = ggml_expf(s - max, wide);
            }
            e[l] = v;
        }
        red[tid] = reduce16(&e);
        sync_cube();
        if tid == 0 {
            let mut k = 0usize;
            while k < t && c0 + k < chunks {
                total += f64::cast_from(red[k]);
                k += 1;
            }
        }
        sync_cube();
        c0 += t;
    }
    if tid == 0 {
        one[0] = f32::cast_from(1.0f64 / total);
    }
    sync_cube();
    let inv = one[0];

    // P·V: accumulator `a` of output dimension `d` is chain `a · hd + d`;
    // unit `tid` keeps chains `tid, tid + T, …` in registers.
    let lanes = select(single, DECODE_LANES.runtime(), 16usize.runtime());
    let per = comptime!(DECODE_LANES * sh.head_dim / EXACT_THREADS);
    let mut acc = Array::<f32>::new(per);
    #[unroll]
    for i in 0..per {
        acc[i] = 0.0f32;
    }
    let mut t0 = (lo / t) * t;
    while t0 < n {
        let k = t0 + tid;
        let mut p = 0.0f32.runtime();
        if k >= lo && k < n {
            let ko =
                layer_off + tables[toff + k / BLOCK] as usize * bl + (kvh * BLOCK + k % BLOCK) * hd;
            let s = mul(qk_dot(qkv, qo, k_pool, ko, single, hd, wide), scale, wide);
            p = round_f16(ggml_expf(s - max, wide) * inv);
        }
        pt[tid] = p;
        sync_cube();
        #[unroll]
        for i in 0..per {
            let ch = tid + i * t;
            let (a, d) = (ch / hd, ch % hd);
            if a < lanes {
                // The tile's keys k ≡ a (mod lanes), in order.
                let mut kk = a;
                while kk < t {
                    let key = t0 + kk;
                    if key >= lo && key < n {
                        let vo = layer_off
                            + tables[toff + key / BLOCK] as usize * bl
                            + (kvh * BLOCK + key % BLOCK) * hd;
                        acc[i] = fused(f32::cast_from(v_pool[vo + d]), pt[kk], acc[i], wide);
                    }
                    kk += lanes;
                }
            }
        }
        sync_cube();
        t0 += t;
    }
    #[unroll]
    for i in 0..per {
        accs[tid + i * t] = acc[i];
    }
    sync_cube();
    if tid < hd {
        let mut x = Array::<f32>::new(16usize);
        if single {
            #[unroll]
            for l in 0..16usize {
                let a0 = accs[l * hd + tid];
                let a1 = accs[(16 + l) * hd + tid];
                let a2 = accs[(32 + l) * hd + tid];
                let a3 = accs[(48 + l) * hd + tid];
                x[l] = (a0 + a2) + (a1 + a3);
            }
        } else {
            #[unroll]
            for l in 0..16usize {
                x[l] = accs[l * hd + tid];
            }
        }
        let o = reduce16(&x);
        out[row * nh * hd + h * hd + tid] = o;
        pt[tid] = o;
    }
    sync_cube();
    // The head's blocks of the row's quantized attention output.
    if tid < comptime!(sh.head_dim / 32) {
        let mut v = Array::<f32>::new(32usize);
        #[unroll]
        for e in 0..32usize {
            v[e] = pt[tid * 32 + e];
        }
        let b = (row * nh * hd + h * hd) / 32 + tid;
        q8::quantize_block(&v, b, qs, qd, qsum, qsum_q);
    }
}
