//! CPU attention with RoPE and an f16 KV cache.
//!
//! Burn ops cost several microseconds each, and a decode step at batch 1 is
//! dominated by such fixed costs, so RoPE + cache append + attention run here
//! as one host kernel per layer. The numerics follow llama.cpp's default CPU
//! path (f16 K/V cache, Q and softmax probabilities rounded to f16 before the
//! f16 dot products, f32 accumulation) so that greedy decoding agrees with it.

use half::f16;
use rayon::prelude::*;

use crate::numerics::{dot16, ggml_expf, reduce16};

/// Q·K in the order of ggml's AVX-512 `ggml_vec_dot_f16` for 64 elements:
/// four 16-lane products, then (0+2) + (1+3) and a tree reduction. Measured
/// against the fixture, this order agrees with llama.cpp more often than
/// tinyBLAS's (519 vs 514 of 530 teacher-forced steps).
#[inline(always)]
fn vecdot_f16_order(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [[0f32; 16]; 4];
    for j in 0..4 {
        for l in 0..16 {
            s[j][l] = a[16 * j + l] * b[16 * j + l];
        }
    }
    let mut x = [0f32; 16];
    for l in 0..16 {
        let a02 = s[0][l] + s[2][l];
        let a13 = s[1][l] + s[3][l];
        x[l] = a02 + a13;
    }
    reduce16(&x)
}

/// RoPE cos/sin tables `[context, head_dim / 2]`, computed with llama.cpp's
/// recurrence (`theta *= base^(-2/d)`) for bit-compatible angles.
#[derive(Debug, Clone)]
pub struct Rope {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
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
        Self { half, cos, sin }
    }

    /// Rotate adjacent pairs `(x[2i], x[2i+1])` of every head in `x`
    /// (llama.cpp "normal" mode; GGUF q/k weights are permuted for it).
    fn apply(&self, x: &mut [f32], pos: usize) {
        let c = &self.cos[pos * self.half..][..self.half];
        let s = &self.sin[pos * self.half..][..self.half];
        for head in x.chunks_exact_mut(2 * self.half) {
            for i in 0..self.half {
                let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                // Contracting these into FMAs was tried: no effect on
                // results, since Q and K are rounded to f16 right after.
                head[2 * i] = x0 * c[i] - x1 * s[i];
                head[2 * i + 1] = x0 * s[i] + x1 * c[i];
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
    let ctx = HeadCtx { qkv: &*qkv, k: &kv.k, v_t: &kv.v_t, cap: kv.cap, sh, past };
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
        out.par_chunks_mut(hd).enumerate().for_each(work);
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
    let scale = 1.0 / (hd as f32).sqrt();
    // Scores padded to a multiple of 16 with exact zeros after softmax,
    // mirroring llama.cpp's padded, masked KV rows.
    let padded = n.div_ceil(16) * 16;
    let mut p = vec![0f32; padded];
    let mut max = f32::NEG_INFINITY;
    for (j, pj) in p[..n].iter_mut().enumerate() {
        let kj = &c.k[(j * nkv + kvh) * hd..][..hd];
        let dot = if hd == 64 {
            vecdot_f16_order(q, kj)
        } else if hd % 16 == 0 {
            dot16(q, kj)
        } else {
            q.iter().zip(kj).map(|(a, b)| a * b).sum()
        };
        *pj = dot * scale;
        max = max.max(*pj);
    }
    for pj in p[..n].iter_mut() {
        *pj = ggml_expf(*pj - max);
    }
    let mut sum = 0f64;
    for ch in p.chunks_exact(16) {
        sum += reduce16(ch.try_into().expect("16 lanes")) as f64;
    }
    let inv = (1.0 / sum) as f32;
    // Probabilities are rounded to f16 for llama.cpp's f16 V product.
    p[..n].iter_mut().for_each(|x| *x = r16(*x * inv));
    // out[d] = Σ_j p_j v_j[d]; lane (j mod 16) accumulates with FMA in
    // ascending j, then a tree reduction (tinyBLAS order; ggml's vec_dot
    // order was tried here too and matched the fixture no better). Padding keys have
    // p = 0 and zeroed V, adding exact zeros.
    for (dd, od) in o.iter_mut().enumerate() {
        let row = &c.v_t[(kvh * hd + dd) * c.cap..][..padded];
        *od = dot16(row, &p);
    }
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
}
