//! The ggml tensor types ([`GgmlType`]: their block layouts and decoding
//! to f32), quantized weight matrices, and the CPU matmul kernels that read
//! them. The GGUF parser ([`crate::gguf`]) builds on this module, not the
//! other way round.
//!
//! Weights stay in their GGUF block formats, repacked at load time into
//! groups of 8 rows: for each group and block, the 8 rows' quants are
//! contiguous, followed by their scales. A kernel call then streams one
//! contiguous region and computes 8 outputs in the lanes of one vector,
//! each lane accumulating its row sequentially over blocks (the float order
//! of llama.cpp's AMX/VNNI kernels). Activations are quantized to 8 bits per
//! 32-element block and each block product is an exact integer dot product,
//! as in llama.cpp's `vec_dot_q4_1_q8_1`.

use half::f16;

pub mod blocks;
mod k_common;
mod kernels;
pub mod profile;
pub mod rows;
#[cfg(target_arch = "x86_64")]
mod rows_avx2;
#[cfg(target_arch = "x86_64")]
mod rows_avx512;

pub const QK: usize = 32;
/// Rows per packed group (one f32 lane per row in a 256-bit vector).
pub const GROUP: usize = 8;

/// ggml tensor element types we can load (GGUF tags each tensor with one).
#[allow(non_camel_case_types)] // ggml's names
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
}

/// ggml's name of a type id (ggml.c `type_traits`), for error messages
/// about types this build cannot load.
pub fn ggml_type_name(v: u32) -> &'static str {
    const NAMES: [&str; 43] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
        "NVFP4",
        "Q1_0",
        "Q2_0",
    ];
    NAMES.get(v as usize).copied().unwrap_or("unknown")
}

impl GgmlType {
    /// The type of ggml's numeric type id, if we support it.
    pub(crate) fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            8 => Self::Q8_0,
            12 => Self::Q4_K,
            13 => Self::Q5_K,
            14 => Self::Q6_K,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block)
    pub fn block_layout(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_0 => (QK, 18),
            Self::Q4_1 => (QK, 20),
            Self::Q5_0 => (QK, 22),
            Self::Q8_0 => (QK, 34),
            Self::Q4_K => (rows::QK_K, 144),
            Self::Q5_K => (rows::QK_K, 176),
            Self::Q6_K => (rows::QK_K, 210),
        }
    }
}

fn f32_of_f16(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// Decode one quantized block: `qs` holds its 16 nibble bytes (low nibbles
/// are elements 0..16, high nibbles 16..32) or its 32 signed bytes, `d` its
/// scale and `m` its min (Q4_1 only).
fn decode_block(kind: QKind, d: f32, m: f32, qs: &[u8], out: &mut [f32]) {
    match kind {
        QKind::Q4_0 => {
            for j in 0..16 {
                out[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
                out[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        QKind::Q4_1 => {
            for j in 0..16 {
                out[j] = (qs[j] & 0x0f) as f32 * d + m;
                out[j + 16] = (qs[j] >> 4) as f32 * d + m;
            }
        }
        QKind::Q8_0 => {
            for j in 0..QK {
                out[j] = qs[j] as i8 as f32 * d;
            }
        }
    }
}

/// Decode any supported GGUF tensor payload to f32.
pub fn dequantize(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let (per_block, block_bytes) = ty.block_layout();
    let mut out = vec![0f32; bytes.len() / block_bytes * per_block];
    if rows::is_row_type(ty) || ty == GgmlType::BF16 {
        rows::dequantize_blocks(ty, bytes, &mut out);
        return out;
    }
    let blocks = bytes.chunks_exact(block_bytes).zip(out.chunks_exact_mut(per_block));
    match QKind::of(ty) {
        Some(kind) => blocks.for_each(|(blk, o)| {
            let (d, m, qs) = kind.split(blk);
            decode_block(kind, f32_of_f16(d), f32_of_f16(m), qs, o);
        }),
        None if ty == GgmlType::F16 => {
            blocks.for_each(|(b, o)| o[0] = f32_of_f16(u16::from_le_bytes([b[0], b[1]])))
        }
        None => blocks.for_each(|(b, o)| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
    }
    out
}

/// Quantized weight kinds. Arrays use the packed group layout: block-row
/// index `k = ((row / 8) * nb + b) * 8 + row % 8` for row `row`, block `b`.
/// 4-bit quants of a group block are stored as `[quad 0..4][row 0..8][4 bytes]`
/// (byte `e` of a row holds elements `e` and `e + 16`), 8-bit quants as
/// `[row][32]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QKind {
    /// w = d * (q - 8); 16 nibble bytes per block (low nibbles are
    /// elements 0..16, high nibbles 16..32).
    Q4_0,
    /// w = d * q + m.
    Q4_1,
    /// w = d * q; 32 signed bytes per block.
    Q8_0,
}

impl QKind {
    /// The quantized kind of a GGUF type in the packed group layout; `None`
    /// for the float types and the row types of [`rows`].
    fn of(ty: GgmlType) -> Option<Self> {
        match ty {
            GgmlType::Q4_0 => Some(QKind::Q4_0),
            GgmlType::Q4_1 => Some(QKind::Q4_1),
            GgmlType::Q8_0 => Some(QKind::Q8_0),
            _ => None,
        }
    }

    fn ggml_type(self) -> GgmlType {
        match self {
            QKind::Q4_0 => GgmlType::Q4_0,
            QKind::Q4_1 => GgmlType::Q4_1,
            QKind::Q8_0 => GgmlType::Q8_0,
        }
    }

    fn qbytes(self) -> usize {
        match self {
            QKind::Q4_0 | QKind::Q4_1 => 16,
            QKind::Q8_0 => 32,
        }
    }

    /// A GGUF block's scale, min (0 but for Q4_1), both as f16 bits, and
    /// its quants.
    fn split(self, blk: &[u8]) -> (u16, u16, &[u8]) {
        let d = u16::from_le_bytes([blk[0], blk[1]]);
        match self {
            QKind::Q4_1 => (d, u16::from_le_bytes([blk[2], blk[3]]), &blk[4..]),
            QKind::Q4_0 | QKind::Q8_0 => (d, 0, &blk[2..]),
        }
    }
}

#[derive(Debug, Clone)]
pub enum QData {
    Quant {
        kind: QKind,
        /// Per block-row scale, f16 bits as stored in GGUF (kept at 16 bits:
        /// decode is memory-bound and f32 scales would add ~17% bytes).
        d: Vec<u16>,
        /// Per block-row min (Q4_1 only, else empty), f16 bits.
        m: Vec<u16>,
        qs: Vec<u8>,
    },
    /// Unquantized fallback (F32/F16/BF16 GGUF tensors), row-major.
    F32(Vec<f32>),
    /// The GGUF blocks as stored, row-major ([`rows`]: K-quants, Q5_0).
    Rows { ty: GgmlType, bytes: Vec<u8> },
    /// Matrices of different types stacked along the rows (a q/k/v or
    /// gate/up fusion whose parts the quantizer gave different types).
    Stack(Vec<QMatrix>),
}

/// A `[rows, cols]` weight matrix (`y = W x`), rows are output features.
#[derive(Debug, Clone)]
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: QData,
}

/// Offset of byte `e` of row `r`'s 4-bit block inside its packed group block.
#[inline]
fn q4_offset(r: usize, e: usize) -> usize {
    ((e / 4) * GROUP + r % GROUP) * 4 + e % 4
}

#[inline]
fn bidx(nb: usize, r: usize, b: usize) -> usize {
    ((r / GROUP) * nb + b) * GROUP + r % GROUP
}

impl QMatrix {
    /// Build from a GGUF tensor payload of ggml shape `[cols, rows]`.
    pub fn from_gguf(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Self {
        if rows::is_row_type(ty) {
            return Self { rows, cols, data: QData::Rows { ty, bytes: bytes.to_vec() } };
        }
        let Some(kind) = QKind::of(ty) else {
            return Self { rows, cols, data: QData::F32(dequantize(ty, bytes)) };
        };
        let (_, bsz) = ty.block_layout();
        let nb = cols / QK;
        let prow = rows.div_ceil(GROUP) * GROUP;
        let qb = kind.qbytes();
        // Padding rows keep d = 0 so they contribute nothing.
        let mut d = vec![0u16; prow * nb];
        let mut m = if kind == QKind::Q4_1 { vec![0u16; prow * nb] } else { Vec::new() };
        let mut qs = vec![0u8; prow * nb * qb];
        for r in 0..rows {
            for b in 0..nb {
                let k = bidx(nb, r, b);
                let (dk, mk, q) = kind.split(&bytes[(r * nb + b) * bsz..][..bsz]);
                d[k] = dk;
                if kind == QKind::Q4_1 {
                    m[k] = mk;
                }
                match kind {
                    // VNNI-style order inside a group block: 4-byte quads
                    // [quad][row][4], so one 32-byte load feeds 8 rows.
                    QKind::Q4_0 | QKind::Q4_1 => {
                        let base = (k - r % GROUP) * 16;
                        for (e, &byte) in q[..16].iter().enumerate() {
                            qs[base + q4_offset(r, e)] = byte;
                        }
                    }
                    QKind::Q8_0 => qs[k * qb..(k + 1) * qb].copy_from_slice(q),
                }
            }
        }
        Self { rows, cols, data: QData::Quant { kind, d, m, qs } }
    }

    /// Concatenate matrices along the row axis (fusing q/k/v and gate/up).
    /// Needs equal `cols`, equal kind and row counts that are multiples of
    /// the group size; returns `None` otherwise.
    pub fn concat_rows(parts: &[&QMatrix]) -> Option<QMatrix> {
        let cols = parts[0].cols;
        if parts.iter().any(|p| p.cols != cols) {
            return None;
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let data = match &parts[0].data {
            QData::Quant { kind, .. } => {
                let kind = *kind;
                let (mut d2, mut m2, mut q2) = (Vec::new(), Vec::new(), Vec::new());
                for p in parts {
                    match &p.data {
                        QData::Quant { kind: k, d, m, qs } if *k == kind && p.rows % GROUP == 0 => {
                            d2.extend_from_slice(d);
                            m2.extend_from_slice(m);
                            q2.extend_from_slice(qs);
                        }
                        _ => return None,
                    }
                }
                QData::Quant { kind, d: d2, m: m2, qs: q2 }
            }
            QData::F32(_) => {
                let mut w = Vec::new();
                for p in parts {
                    let QData::F32(v) = &p.data else { return None };
                    w.extend_from_slice(v);
                }
                QData::F32(w)
            }
            QData::Rows { ty, .. } => {
                let ty = *ty;
                let mut b2 = Vec::new();
                for p in parts {
                    match &p.data {
                        QData::Rows { ty: t, bytes } if *t == ty => b2.extend_from_slice(bytes),
                        _ => return None,
                    }
                }
                QData::Rows { ty, bytes: b2 }
            }
            QData::Stack(_) => return None,
        };
        Some(QMatrix { rows, cols, data })
    }

    /// Stack matrices of equal `cols` along the rows, whatever their types
    /// (one matmul call computes all of them).
    pub fn stack(parts: Vec<QMatrix>) -> Option<QMatrix> {
        let cols = parts.first()?.cols;
        if parts.iter().any(|p| p.cols != cols) {
            return None;
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        Some(QMatrix { rows, cols, data: QData::Stack(parts) })
    }

    /// Bytes held by this matrix.
    pub fn nbytes(&self) -> usize {
        match &self.data {
            QData::Quant { d, m, qs, .. } => (d.len() + m.len()) * 2 + qs.len(),
            QData::F32(w) => w.len() * 4,
            QData::Rows { bytes, .. } => bytes.len(),
            QData::Stack(parts) => parts.iter().map(QMatrix::nbytes).sum(),
        }
    }

    /// One row as f32 (embedding lookup for tied embeddings).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let nb = self.cols / QK;
        match &self.data {
            QData::Quant { kind, d, m, qs } => {
                let qb = kind.qbytes();
                for b in 0..nb {
                    let k = bidx(nb, r, b);
                    let q: Vec<u8> = match kind {
                        QKind::Q4_0 | QKind::Q4_1 => {
                            let base = (k - r % GROUP) * 16;
                            (0..16).map(|e| qs[base + q4_offset(r, e)]).collect()
                        }
                        QKind::Q8_0 => qs[k * qb..][..qb].to_vec(),
                    };
                    let mk = m.get(k).map_or(0.0, |&v| f32_of_f16(v));
                    decode_block(*kind, f32_of_f16(d[k]), mk, &q, &mut out[b * QK..][..QK]);
                }
            }
            QData::F32(w) => out.copy_from_slice(&w[r * self.cols..][..self.cols]),
            QData::Rows { ty, bytes } => {
                let rb = bytes.len() / self.rows;
                rows::dequantize_blocks(*ty, &bytes[r * rb..][..rb], out);
            }
            QData::Stack(parts) => {
                let mut r = r;
                for p in parts {
                    if r < p.rows {
                        return p.row_f32(r, out);
                    }
                    r -= p.rows;
                }
            }
        }
    }

    /// `out[n, rows] = x[n, cols] · Wᵀ`, multithreaded over row groups.
    pub fn matmul(&self, x: &[f32], n: usize, out: &mut [f32]) {
        assert_eq!(x.len(), n * self.cols, "matmul input shape");
        assert_eq!(out.len(), n * self.rows, "matmul output shape");
        self.matmul_cols(x, n, &OutColumns::new(out, n, self.rows), 0)
    }

    /// [`QMatrix::matmul`] into columns `c0..c0 + rows` of a wider output
    /// (a part of a [`QData::Stack`] writes its own columns).
    fn matmul_cols(&self, x: &[f32], n: usize, outc: &OutColumns<'_>, c0: usize) {
        assert!(c0 + self.rows <= outc.rows && n == outc.n, "matmul output columns");
        let (kind, d, m, qs) = match &self.data {
            QData::F32(w) => {
                let region = profile::Region::begin(GgmlType::F32);
                let mut out = vec![0f32; n * self.rows];
                profile::Region::task(&region, || {
                    matmul_f32(w, self.rows, self.cols, x, n, &mut out)
                });
                for (t, o) in out.chunks(self.rows).enumerate() {
                    // SAFETY: no task of this matmul is running.
                    unsafe { outc.put_row(t, c0, o) };
                }
                return profile::Region::finish(region, 0);
            }
            QData::Rows { ty, bytes } => {
                return rows::matmul_rows(*ty, bytes, self.rows, self.cols, x, n, outc, c0)
            }
            QData::Stack(parts) => {
                let mut off = c0;
                for p in parts {
                    p.matmul_cols(x, n, outc, off);
                    off += p.rows;
                }
                return;
            }
            QData::Quant { kind, d, m, qs } => (*kind, d, m, qs),
        };
        let region = profile::Region::begin(kind.ggml_type());
        let tq = profile::start();
        let acts = QActs::quantize(x, n, self.cols);
        let quant_ns = tq.map_or(0, |t| t.elapsed().as_nanos() as u64);
        let nb = self.cols / QK;
        let groups = self.rows.div_ceil(GROUP);
        let qb = kind.qbytes();
        // One task per thread for decode-sized work (fewer wake-ups); finer
        // tasks when there is more work so all threads stay balanced.
        let threads = crate::par::threads();
        let per_task =
            if n * groups <= 4096 { groups.div_ceil(threads) } else { (groups / 16).clamp(1, 64) };
        let rows: Vec<kernels::ActBlock<'_>> = (0..n)
            .map(|t| kernels::ActBlock {
                d: &acts.d[t * nb..][..nb],
                s: &acts.s[t * nb..][..nb],
                sum_q: &acts.sum_q[t * nb..][..nb],
                qs: &acts.qs[t * self.cols..][..self.cols],
            })
            .collect();
        let group_task = |ti: usize, o: &mut [f32]| {
            for (gi, og) in o.chunks_mut(n * GROUP).enumerate() {
                let g = ti * per_task + gi;
                let k0 = g * nb * GROUP;
                let gd = &d[k0..k0 + nb * GROUP];
                let gm = if m.is_empty() { &m[..] } else { &m[k0..k0 + nb * GROUP] };
                let gq = &qs[k0 * qb..(k0 + nb * GROUP) * qb];
                if n == 1 {
                    og.copy_from_slice(&kernels::dot_group(kind, gd, gm, gq, &rows[0]));
                } else {
                    kernels::dot_group_multi(kind, gd, gm, gq, &rows, og);
                }
            }
        };
        crate::par::for_each_index(groups.div_ceil(per_task), |ti| {
            let ng = per_task.min(groups - ti * per_task);
            // The task's results `[group, n, 8]`, then into their columns.
            with_scratch(ng * n * GROUP, |o| {
                profile::Region::task(&region, || {
                    group_task(ti, o);
                    for (gi, og) in o.chunks(n * GROUP).enumerate() {
                        let r0 = (ti * per_task + gi) * GROUP;
                        let w = GROUP.min(self.rows - r0);
                        for (t, v) in og.chunks(GROUP).enumerate() {
                            // SAFETY: columns c0 + r0.. (w of them) are this task's.
                            unsafe { outc.put_row(t, c0 + r0, &v[..w]) };
                        }
                    }
                })
            })
        });
        profile::Region::finish(region, quant_ns);
    }
}

thread_local! {
    /// Each thread's buffer for its matmul task's results, reused (a fresh
    /// `[rows, n]` buffer a matmul cost page faults and zeroing of
    /// megabytes in a prefill).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `f` on this thread's zeroed scratch of `len` floats.
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        s.clear();
        s.resize(len, 0.0);
        f(&mut s)
    })
}

/// A `[n, rows]` output that parallel tasks fill column range by column
/// range (each task owns some rows of the weight matrix), so no task's
/// results need a serial transpose afterwards.
pub(crate) struct OutColumns<'a> {
    ptr: *mut f32,
    n: usize,
    rows: usize,
    _out: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: tasks write disjoint columns (the contract of `put_*`).
unsafe impl Send for OutColumns<'_> {}
unsafe impl Sync for OutColumns<'_> {}

impl<'a> OutColumns<'a> {
    pub(crate) fn new(out: &'a mut [f32], n: usize, rows: usize) -> Self {
        assert_eq!(out.len(), n * rows, "output shape");
        Self { ptr: out.as_mut_ptr(), n, rows, _out: std::marker::PhantomData }
    }

    /// `out[t, r0..r0 + v.len()] = v`.
    ///
    /// # Safety
    /// No other thread writes these columns while this runs.
    pub(crate) unsafe fn put_row(&self, t: usize, r0: usize, v: &[f32]) {
        assert!(t < self.n && r0 + v.len() <= self.rows, "output columns");
        std::ptr::copy_nonoverlapping(v.as_ptr(), self.ptr.add(t * self.rows + r0), v.len());
    }

    /// `out[t, r0 + i] = part[i * n + t]`: a task's `[nr, n]` results for
    /// weight rows `r0..r0 + nr`.
    ///
    /// # Safety
    /// As [`OutColumns::put_row`], for columns `r0..r0 + nr`.
    pub(crate) unsafe fn put_rows(&self, r0: usize, part: &[f32]) {
        let n = self.n;
        let nr = part.len() / n;
        assert!(part.len() == nr * n && r0 + nr <= self.rows, "output columns");
        if n == 1 {
            return self.put_row(0, r0, part);
        }
        for t in 0..n {
            let dst = self.ptr.add(t * self.rows + r0);
            for i in 0..nr {
                *dst.add(i) = part[i * n + t];
            }
        }
    }
}

fn matmul_f32(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
    let mut tmp = vec![0f32; rows * n];
    crate::par::for_each_chunk_mut(&mut tmp, n, |r, o| {
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
#[derive(Debug)]
pub struct QActs {
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    /// Exact integer Σq per block (for Q4_0's offset of 8).
    pub sum_q: Vec<i32>,
    pub qs: Vec<i8>,
}

impl QActs {
    /// Rows in parallel when there are several (a prefill); each block is
    /// quantized alone, so the split does not change a bit.
    pub fn quantize(x: &[f32], n: usize, cols: usize) -> Self {
        let nb = cols / QK;
        let mut out = Self {
            d: vec![0f32; n * nb],
            s: vec![0f32; n * nb],
            sum_q: vec![0i32; n * nb],
            qs: vec![0i8; n * cols],
        };
        if n < 8 {
            // A decode step: one part, no list of parts to build.
            let Self { d, s, sum_q, qs } = &mut out;
            Self::quantize_rows(x, d, s, sum_q, qs);
            return out;
        }
        let per = n.div_ceil(crate::par::threads());
        let mut parts: Vec<_> = x
            .chunks(per * cols)
            .zip(out.d.chunks_mut(per * nb))
            .zip(out.s.chunks_mut(per * nb))
            .zip(out.sum_q.chunks_mut(per * nb))
            .zip(out.qs.chunks_mut(per * cols))
            .map(|((((x, d), s), sum_q), qs)| (x, d, s, sum_q, qs))
            .collect();
        crate::par::for_each_chunk_mut(&mut parts, 1, |_, p| {
            let (x, d, s, sum_q, qs) = &mut p[0];
            Self::quantize_rows(x, d, s, sum_q, qs)
        });
        out
    }

    fn quantize_rows(x: &[f32], d: &mut [f32], s: &mut [f32], sum_q: &mut [i32], qs: &mut [i8]) {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("sse4.1") {
            // SAFETY: SSE4.1 support was detected above.
            return unsafe { Self::quantize_sse41(x, d, s, sum_q, qs) };
        }
        Self::quantize_impl(x, d, s, sum_q, qs)
    }

    /// Compiled with SSE4.1 so rounding is one instruction, not a libm call.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "sse4.1")]
    unsafe fn quantize_sse41(
        x: &[f32],
        d: &mut [f32],
        s: &mut [f32],
        sum_q: &mut [i32],
        qs: &mut [i8],
    ) {
        Self::quantize_impl(x, d, s, sum_q, qs)
    }

    #[inline(always)]
    fn quantize_impl(x: &[f32], d: &mut [f32], s: &mut [f32], sum_q: &mut [i32], qs: &mut [i8]) {
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
    }
}

#[cfg(test)]
mod tests;
