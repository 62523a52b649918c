//! Quantized weight matrices and the CPU matmul kernels that read them.
//!
//! Weights stay in their GGUF block formats (repacked into separate scale
//! and quant arrays so the inner loops load contiguous bytes). Activations
//! are quantized to 8 bits per 32-element block, and each block dot product
//! is an integer dot product, as in llama.cpp's `vec_dot_q4_1_q8_1`.

use half::f16;
use rayon::prelude::*;

use crate::gguf::GgmlType;

pub const QK: usize = 32;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Decode any supported GGUF tensor payload to f32.
pub fn dequantize(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
    match ty {
        GgmlType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        GgmlType::F16 => bytes.chunks_exact(2).map(|c| f16_at(c, 0)).collect(),
        GgmlType::Q4_0 => {
            let mut out = Vec::with_capacity(bytes.len() / 18 * QK);
            for blk in bytes.chunks_exact(18) {
                let d = f16_at(blk, 0);
                let qs = &blk[2..];
                let mut v = [0f32; QK];
                for j in 0..16 {
                    v[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
                    v[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
                }
                out.extend_from_slice(&v);
            }
            out
        }
        GgmlType::Q4_1 => {
            let mut out = Vec::with_capacity(bytes.len() / 20 * QK);
            for blk in bytes.chunks_exact(20) {
                let d = f16_at(blk, 0);
                let m = f16_at(blk, 2);
                let qs = &blk[4..];
                let mut v = [0f32; QK];
                for j in 0..16 {
                    v[j] = (qs[j] & 0x0f) as f32 * d + m;
                    v[j + 16] = (qs[j] >> 4) as f32 * d + m;
                }
                out.extend_from_slice(&v);
            }
            out
        }
        GgmlType::Q8_0 => {
            let mut out = Vec::with_capacity(bytes.len() / 34 * QK);
            for blk in bytes.chunks_exact(34) {
                let d = f16_at(blk, 0);
                out.extend(blk[2..].iter().map(|&q| q as i8 as f32 * d));
            }
            out
        }
    }
}

/// Weight storage. Scales are widened to f32 at load time so the kernel
/// does no f16 conversion in its inner loop.
#[derive(Debug, Clone)]
pub enum QData {
    /// w = d * (q - 8); `qs` holds 16 bytes per block (low nibbles are
    /// elements 0..16, high nibbles 16..32).
    Q4_0 { d: Vec<f32>, qs: Vec<u8> },
    /// w = d * q + m.
    Q4_1 { d: Vec<f32>, m: Vec<f32>, qs: Vec<u8> },
    /// w = d * q.
    Q8_0 { d: Vec<f32>, qs: Vec<i8> },
    /// Unquantized fallback (F32/F16 GGUF tensors).
    F32(Vec<f32>),
}

/// A `[rows, cols]` weight matrix (`y = W x`), rows are output features.
#[derive(Debug, Clone)]
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: QData,
}

impl QMatrix {
    /// Build from a GGUF tensor payload of shape ggml `[cols, rows]`.
    pub fn from_gguf(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Self {
        let nb = rows * cols / QK;
        let data = match ty {
            GgmlType::F32 | GgmlType::F16 => QData::F32(dequantize(ty, bytes)),
            GgmlType::Q4_0 => {
                let mut d = Vec::with_capacity(nb);
                let mut qs = Vec::with_capacity(nb * 16);
                for blk in bytes.chunks_exact(18) {
                    d.push(f16_at(blk, 0));
                    qs.extend_from_slice(&blk[2..18]);
                }
                QData::Q4_0 { d, qs }
            }
            GgmlType::Q4_1 => {
                let mut d = Vec::with_capacity(nb);
                let mut m = Vec::with_capacity(nb);
                let mut qs = Vec::with_capacity(nb * 16);
                for blk in bytes.chunks_exact(20) {
                    d.push(f16_at(blk, 0));
                    m.push(f16_at(blk, 2));
                    qs.extend_from_slice(&blk[4..20]);
                }
                QData::Q4_1 { d, m, qs }
            }
            GgmlType::Q8_0 => {
                let mut d = Vec::with_capacity(nb);
                let mut qs = Vec::with_capacity(nb * 32);
                for blk in bytes.chunks_exact(34) {
                    d.push(f16_at(blk, 0));
                    qs.extend(blk[2..34].iter().map(|&b| b as i8));
                }
                QData::Q8_0 { d, qs }
            }
        };
        Self { rows, cols, data }
    }

    /// Concatenate matrices with equal `cols` and equal storage kind along
    /// the row axis (used to fuse q/k/v and gate/up projections). Returns
    /// `None` when the storage kinds differ.
    pub fn concat_rows(parts: &[&QMatrix]) -> Option<QMatrix> {
        let cols = parts[0].cols;
        if parts.iter().any(|p| p.cols != cols) {
            return None;
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let data = match &parts[0].data {
            QData::Q4_0 { .. } => {
                let (mut d2, mut q2) = (Vec::new(), Vec::new());
                for p in parts {
                    let QData::Q4_0 { d, qs } = &p.data else { return None };
                    d2.extend_from_slice(d);
                    q2.extend_from_slice(qs);
                }
                QData::Q4_0 { d: d2, qs: q2 }
            }
            QData::Q4_1 { .. } => {
                let (mut d2, mut m2, mut q2) = (Vec::new(), Vec::new(), Vec::new());
                for p in parts {
                    let QData::Q4_1 { d, m, qs } = &p.data else { return None };
                    d2.extend_from_slice(d);
                    m2.extend_from_slice(m);
                    q2.extend_from_slice(qs);
                }
                QData::Q4_1 { d: d2, m: m2, qs: q2 }
            }
            QData::Q8_0 { .. } => {
                let (mut d2, mut q2) = (Vec::new(), Vec::new());
                for p in parts {
                    let QData::Q8_0 { d, qs } = &p.data else { return None };
                    d2.extend_from_slice(d);
                    q2.extend_from_slice(qs);
                }
                QData::Q8_0 { d: d2, qs: q2 }
            }
            QData::F32(_) => {
                let mut w = Vec::new();
                for p in parts {
                    let QData::F32(v) = &p.data else { return None };
                    w.extend_from_slice(v);
                }
                QData::F32(w)
            }
        };
        Some(QMatrix { rows, cols, data })
    }

    /// Bytes held by this matrix.
    pub fn nbytes(&self) -> usize {
        match &self.data {
            QData::Q4_0 { d, qs } => d.len() * 4 + qs.len(),
            QData::Q4_1 { d, qs, .. } => d.len() * 8 + qs.len(),
            QData::Q8_0 { d, qs } => d.len() * 4 + qs.len(),
            QData::F32(w) => w.len() * 4,
        }
    }

    /// One row as f32 (embedding lookup for tied embeddings).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let nbr = self.cols / QK;
        match &self.data {
            QData::Q4_0 { d, qs } => {
                for b in 0..nbr {
                    let (dd, q) = (d[r * nbr + b], &qs[(r * nbr + b) * 16..][..16]);
                    for j in 0..16 {
                        out[b * QK + j] = ((q[j] & 15) as i32 - 8) as f32 * dd;
                        out[b * QK + j + 16] = ((q[j] >> 4) as i32 - 8) as f32 * dd;
                    }
                }
            }
            QData::Q4_1 { d, m, qs } => {
                for b in 0..nbr {
                    let i = r * nbr + b;
                    let q = &qs[i * 16..][..16];
                    for j in 0..16 {
                        out[b * QK + j] = (q[j] & 15) as f32 * d[i] + m[i];
                        out[b * QK + j + 16] = (q[j] >> 4) as f32 * d[i] + m[i];
                    }
                }
            }
            QData::Q8_0 { d, qs } => {
                for b in 0..nbr {
                    let i = r * nbr + b;
                    for j in 0..QK {
                        out[b * QK + j] = qs[i * QK + j] as f32 * d[i];
                    }
                }
            }
            QData::F32(w) => out.copy_from_slice(&w[r * self.cols..][..self.cols]),
        }
    }

    /// `out[n, rows] = x[n, cols] · Wᵀ`, multithreaded over output rows.
    pub fn matmul(&self, x: &[f32], n: usize, out: &mut [f32]) {
        assert_eq!(x.len(), n * self.cols, "matmul input shape");
        assert_eq!(out.len(), n * self.rows, "matmul output shape");
        if let QData::F32(w) = &self.data {
            return matmul_f32(w, self.rows, self.cols, x, n, out);
        }
        let acts = QActs::quantize(x, n, self.cols);
        // Row-major over weights: each weight row is read once and dotted
        // with all n activation rows while it is in L1.
        let chunk = 16usize;
        let mut tmp = vec![0f32; self.rows * n];
        tmp.par_chunks_mut(chunk * n).enumerate().for_each(|(ci, o)| {
            let r0 = ci * chunk;
            for (ri, orow) in o.chunks_mut(n).enumerate() {
                let r = r0 + ri;
                for (t, ov) in orow.iter_mut().enumerate() {
                    *ov = self.dot_row(r, &acts, t);
                }
            }
        });
        if n == 1 {
            out.copy_from_slice(&tmp);
        } else {
            for r in 0..self.rows {
                for t in 0..n {
                    out[t * self.rows + r] = tmp[r * n + t];
                }
            }
        }
    }

    #[inline]
    fn dot_row(&self, r: usize, a: &QActs, t: usize) -> f32 {
        let nb = self.cols / QK;
        let xd = &a.d[t * nb..][..nb];
        let xs = &a.s[t * nb..][..nb];
        let xsum = &a.sum_q[t * nb..][..nb];
        let xq = &a.qs[t * self.cols..][..self.cols];
        match &self.data {
            QData::Q4_1 { d, m, qs } => {
                let (d, m, q) = (&d[r * nb..][..nb], &m[r * nb..][..nb], &qs[r * nb * 16..][..nb * 16]);
                kernels::dot_q4_1(d, m, q, xd, xs, xq)
            }
            QData::Q4_0 { d, qs } => {
                let (d, q) = (&d[r * nb..][..nb], &qs[r * nb * 16..][..nb * 16]);
                kernels::dot_q4_0(d, q, xd, xsum, xq)
            }
            QData::Q8_0 { d, qs } => {
                let (d, q) = (&d[r * nb..][..nb], &qs[r * nb * QK..][..nb * QK]);
                kernels::dot_q8_0(d, q, xd, xq)
            }
            QData::F32(_) => unreachable!("f32 handled in matmul"),
        }
    }
}

fn matmul_f32(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
    let mut tmp = vec![0f32; rows * n];
    tmp.par_chunks_mut(n).enumerate().for_each(|(r, o)| {
        let wr = &w[r * cols..][..cols];
        for (t, ov) in o.iter_mut().enumerate() {
            *ov = wr.iter().zip(&x[t * cols..][..cols]).map(|(a, b)| a * b).sum();
        }
    });
    for r in 0..rows {
        for t in 0..n {
            out[t * rows + r] = tmp[r * n + t];
        }
    }
}

/// Activations quantized to 8 bits per 32-element block (like block_q8_1):
/// `x ≈ d * q`, and `s = d * Σq` so that Q4_1's min and Q4_0's offset can be
/// applied once per block.
pub struct QActs {
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    /// Exact integer Σq per block (for Q4_0's offset of 8).
    pub sum_q: Vec<i32>,
    pub qs: Vec<i8>,
}

impl QActs {
    pub fn quantize(x: &[f32], n: usize, cols: usize) -> Self {
        let nb = n * cols / QK;
        let mut d = vec![0f32; nb];
        let mut s = vec![0f32; nb];
        let mut sum_q = vec![0i32; nb];
        let mut qs = vec![0i8; n * cols];
        for (b, (xb, qb)) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).enumerate() {
            let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
            let db = amax / 127.0;
            // Same rounding as llama.cpp's AVX2 quantizer: multiply by
            // 127/amax and round half to even.
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in qb.iter_mut().zip(xb) {
                let qi = (v * id).round_ties_even() as i32;
                *q = qi as i8;
                sum += qi;
            }
            // llama.cpp stores the activation scale and sum as f16 (block_q8_1);
            // rounding the same way keeps logits bit-close to it.
            d[b] = f16::from_f32(db).to_f32();
            s[b] = f16::from_f32(db * sum as f32).to_f32();
            sum_q[b] = sum;
        }
        Self { d, s, sum_q, qs }
    }
}

mod kernels {
    //! Block dot products. Per row, the float accumulation is sequential
    //! over blocks (`acc = fma(isum, d_w*d_x, acc)`, then the Q4_1 min
    //! term), the order of llama.cpp's AMX/VNNI kernels on this CPU family;
    //! integer block sums are exact in any order. Each public fn dispatches
    //! to AVX2 when available, otherwise to a scalar loop with the same
    //! float order.

    pub fn dot_q4_1(d: &[f32], m: &[f32], q: &[u8], xd: &[f32], xs: &[f32], xq: &[i8]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the required CPU features were detected above.
            if let Ok(v) = std::env::var("Q41") { return unsafe { avx2::dot_q4_1_lanes(d, m, q, xd, xs, xq, v == "fma") }; }
            return unsafe { avx2::dot_q4_1(d, m, q, xd, xs, xq) };
        }
        scalar_dot_q4_1(d, m, q, xd, xs, xq)
    }

    pub fn dot_q4_0(d: &[f32], q: &[u8], xd: &[f32], xs: &[i32], xq: &[i8]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the required CPU features were detected above.
            return unsafe { avx2::dot_q4_0(d, q, xd, xs, xq) };
        }
        scalar_dot_q4_0(d, q, xd, xs, xq)
    }

    pub fn dot_q8_0(d: &[f32], q: &[i8], xd: &[f32], xq: &[i8]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the required CPU features were detected above.
            if std::env::var("Q80").is_ok() { return unsafe { avx2::dot_q8_0_lanes(d, q, xd, xq) }; }
            return unsafe { avx2::dot_q8_0(d, q, xd, xq) };
        }
        scalar_dot_q8_0(d, q, xd, xq)
    }

    fn nib_dot(q: &[u8], x: &[i8]) -> i32 {
        let mut s = 0i32;
        for j in 0..16 {
            s += (q[j] & 15) as i32 * x[j] as i32 + (q[j] >> 4) as i32 * x[j + 16] as i32;
        }
        s
    }

    pub fn scalar_dot_q4_1(d: &[f32], m: &[f32], q: &[u8], xd: &[f32], xs: &[f32], xq: &[i8]) -> f32 {
        let mut acc = 0f32;
        for b in 0..d.len() {
            let i = nib_dot(&q[b * 16..][..16], &xq[b * 32..][..32]);
            acc = (i as f32).mul_add(d[b] * xd[b], acc);
            acc = m[b].mul_add(xs[b], acc);
        }
        acc
    }

    pub fn scalar_dot_q4_0(d: &[f32], q: &[u8], xd: &[f32], xs: &[i32], xq: &[i8]) -> f32 {
        let mut acc = 0f32;
        for b in 0..d.len() {
            let i = nib_dot(&q[b * 16..][..16], &xq[b * 32..][..32]);
            // Subtract the offset in the integer domain: exact.
            acc = ((i - 8 * xs[b]) as f32).mul_add(d[b] * xd[b], acc);
        }
        acc
    }

    pub fn scalar_dot_q8_0(d: &[f32], q: &[i8], xd: &[f32], xq: &[i8]) -> f32 {
        let mut acc = 0f32;
        for b in 0..d.len() {
            let mut i = 0i32;
            for j in 0..32 {
                i += q[b * 32 + j] as i32 * xq[b * 32 + j] as i32;
            }
            acc = (i as f32).mul_add(d[b] * xd[b], acc);
        }
        acc
    }

    #[cfg(target_arch = "x86_64")]
    mod avx2 {
        use std::arch::x86_64::*;

        #[inline(always)]
        unsafe fn hsum_i32(v: __m256i) -> i32 {
            let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
            _mm_cvtsi128_si32(s)
        }

        /// Expand 16 packed nibble bytes to 32 u8 lanes in element order.
        #[inline(always)]
        unsafe fn unpack_nibbles(p: *const u8) -> __m256i {
            let qs = _mm_loadu_si128(p as *const __m128i);
            let m = _mm_set1_epi8(0x0f);
            let lo = _mm_and_si128(qs, m);
            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m);
            _mm256_set_m128i(hi, lo)
        }

        /// Exact integer dot of 32 unsigned bytes with 32 signed bytes
        /// (no i16 saturation: |u| <= 127 here).
        #[inline(always)]
        unsafe fn udot(u: __m256i, s: __m256i) -> i32 {
            let p16 = _mm256_maddubs_epi16(u, s);
            hsum_i32(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)))
        }

        #[inline(always)]
        unsafe fn hsum(v: __m256) -> f32 {
            let r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
            let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
            let r = _mm_add_ss(r, _mm_movehdup_ps(r));
            _mm_cvtss_f32(r)
        }

        #[inline(always)]
        unsafe fn udot8(u: __m256i, s: __m256i) -> __m256 {
            let p16 = _mm256_maddubs_epi16(u, s);
            _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)))
        }

        /// llama.cpp's AVX2 `ggml_vec_dot_q4_1_q8_1` order (8 lanes).
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn dot_q4_1_lanes(d: &[f32], m: &[f32], q: &[u8], xd: &[f32], xs: &[f32], xq: &[i8], fma_mins: bool) -> f32 {
            let mut acc = _mm256_setzero_ps();
            let mut summs = 0f32;
            for b in 0..d.len() {
                let w = unpack_nibbles(q.as_ptr().add(b * 16));
                let x = _mm256_loadu_si256(xq.as_ptr().add(b * 32) as *const __m256i);
                if fma_mins { summs = m[b].mul_add(xs[b], summs); } else { summs += m[b] * xs[b]; }
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d[b] * xd[b]), udot8(w, x), acc);
            }
            hsum(acc) + summs
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn dot_q8_0_lanes(d: &[f32], q: &[i8], xd: &[f32], xq: &[i8]) -> f32 {
            let mut acc = _mm256_setzero_ps();
            for b in 0..d.len() {
                let w = _mm256_loadu_si256(q.as_ptr().add(b * 32) as *const __m256i);
                let x = _mm256_loadu_si256(xq.as_ptr().add(b * 32) as *const __m256i);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d[b] * xd[b]), udot8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), acc);
            }
            hsum(acc)
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn dot_q4_1(d: &[f32], m: &[f32], q: &[u8], xd: &[f32], xs: &[f32], xq: &[i8]) -> f32 {
            let mut acc = 0f32;
            for b in 0..d.len() {
                let w = unpack_nibbles(q.as_ptr().add(b * 16));
                let x = _mm256_loadu_si256(xq.as_ptr().add(b * 32) as *const __m256i);
                let i = udot(w, x);
                acc = (i as f32).mul_add(d[b] * xd[b], acc);
                acc = m[b].mul_add(xs[b], acc);
            }
            acc
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn dot_q4_0(d: &[f32], q: &[u8], xd: &[f32], xs: &[i32], xq: &[i8]) -> f32 {
            let mut acc = 0f32;
            for b in 0..d.len() {
                let w = unpack_nibbles(q.as_ptr().add(b * 16));
                let x = _mm256_loadu_si256(xq.as_ptr().add(b * 32) as *const __m256i);
                let i = udot(w, x);
                acc = ((i - 8 * xs[b]) as f32).mul_add(d[b] * xd[b], acc);
            }
            acc
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn dot_q8_0(d: &[f32], q: &[i8], xd: &[f32], xq: &[i8]) -> f32 {
            let mut acc = 0f32;
            for b in 0..d.len() {
                let w = _mm256_loadu_si256(q.as_ptr().add(b * 32) as *const __m256i);
                let x = _mm256_loadu_si256(xq.as_ptr().add(b * 32) as *const __m256i);
                // maddubs needs one unsigned operand: use |w| and move w's
                // sign onto x (weights are in -127..=127 so |w| fits).
                let i = udot(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
                acc = (i as f32).mul_add(d[b] * xd[b], acc);
            }
            acc
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    fn make_blocks(ty: GgmlType, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
        let nb = rows * cols / QK;
        let mut out = Vec::new();
        for _ in 0..nb {
            let d = f16::from_f32(lcg(seed).abs() * 0.05 + 0.001).to_bits().to_le_bytes();
            out.extend_from_slice(&d);
            match ty {
                GgmlType::Q4_1 => {
                    out.extend_from_slice(&f16::from_f32(lcg(seed) * 0.3).to_bits().to_le_bytes());
                    out.extend((0..16).map(|_| ((lcg(seed) + 1.0) * 127.9) as u8));
                }
                GgmlType::Q4_0 => out.extend((0..16).map(|_| ((lcg(seed) + 1.0) * 127.9) as u8)),
                GgmlType::Q8_0 => out.extend((0..32).map(|_| (lcg(seed) * 127.0) as i8 as u8)),
                _ => unreachable!(),
            }
        }
        out
    }

    fn check(ty: GgmlType) {
        let (rows, cols, n) = (37, 256, 3);
        let mut seed = 7u64;
        let bytes = make_blocks(ty, rows, cols, &mut seed);
        let w = QMatrix::from_gguf(ty, rows, cols, &bytes);
        let wf = dequantize(ty, &bytes);
        let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed)).collect();
        let mut out = vec![0f32; n * rows];
        w.matmul(&x, n, &mut out);
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            w.row_f32(r, &mut row);
            assert_eq!(row, wf[r * cols..(r + 1) * cols], "row_f32 {ty:?}");
            for t in 0..n {
                let refv: f32 = (0..cols).map(|c| wf[r * cols + c] * x[t * cols + c]).sum();
                let got = out[t * rows + r];
                let tol = 0.02 * (1.0 + refv.abs());
                assert!((got - refv).abs() < tol, "{ty:?} r{r} t{t}: {got} vs {refv}");
            }
        }
        // Scalar and SIMD paths agree closely.
        let a = QActs::quantize(&x, n, cols);
        let nb = cols / QK;
        for r in 0..rows {
            let fast = w.dot_row(r, &a, 0);
            let slow = match &w.data {
                QData::Q4_1 { d, m, qs } => kernels::scalar_dot_q4_1(
                    &d[r * nb..][..nb], &m[r * nb..][..nb], &qs[r * nb * 16..][..nb * 16], &a.d[..nb], &a.s[..nb], &a.qs[..cols]),
                QData::Q4_0 { d, qs } => kernels::scalar_dot_q4_0(
                    &d[r * nb..][..nb], &qs[r * nb * 16..][..nb * 16], &a.d[..nb], &a.sum_q[..nb], &a.qs[..cols]),
                QData::Q8_0 { d, qs } => kernels::scalar_dot_q8_0(
                    &d[r * nb..][..nb], &qs[r * nb * 32..][..nb * 32], &a.d[..nb], &a.qs[..cols]),
                QData::F32(_) => unreachable!(),
            };
            assert!((fast - slow).abs() < 1e-3 * (1.0 + slow.abs()), "{ty:?} simd {fast} vs scalar {slow}");
        }
    }

    #[test]
    fn q4_1_matches_reference() {
        check(GgmlType::Q4_1);
    }
    #[test]
    fn q4_0_matches_reference() {
        check(GgmlType::Q4_0);
    }
    #[test]
    fn q8_0_matches_reference() {
        check(GgmlType::Q8_0);
    }
}
