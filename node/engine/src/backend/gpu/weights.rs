//! Host-side preparation of what the GPU decoder uploads: quantized
//! matrices as device words ([`kernels::quant::WeightKind`]) and the RoPE
//! tables.

use cubecl::client::Client;

use super::kernels::quant::WeightKind;
use super::{DeviceBuf, GpuError};
use crate::llama::Llama;
use crate::quant::blocks::GgufPart;
use crate::quant::{GgmlType, QData, QKind, QMatrix};

/// The weight types the GPU matmul and embedding kernels dequantize.
pub const GPU_WEIGHT_TYPES: [GgmlType; 7] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q5_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// The weight types the exact kernels (the CPU's arithmetic,
/// `GpuDecoder::with_exact`) dequantize.
pub const EXACT_WEIGHT_KINDS: [WeightKind; 3] =
    [WeightKind::Q4_0, WeightKind::Q4_1, WeightKind::Q8_0];

/// Every GGUF type `m` is stored in (its parts' types when stacked).
fn types(m: &QMatrix, out: &mut Vec<GgmlType>) {
    match &m.data {
        QData::Stack(parts) => parts.iter().for_each(|p| types(p, out)),
        QData::Rows { ty, .. } => out.push(*ty),
        QData::F32(_) => out.push(GgmlType::F32),
        QData::Quant { kind, .. } => out.push(match kind {
            QKind::Q4_0 => GgmlType::Q4_0,
            QKind::Q4_1 => GgmlType::Q4_1,
            QKind::Q8_0 => GgmlType::Q8_0,
        }),
    }
}

/// Whether the GPU decoder covers `model`, checked on the host before
/// anything is uploaded: weights in [`GPU_WEIGHT_TYPES`] (checked first,
/// so the error names the first tensor and type without a kernel), then
/// llama or gemma3 (without a final soft-cap), no projection biases.
pub fn check_model(model: &Llama) -> Result<(), GpuError> {
    let mut named: Vec<(String, &QMatrix)> =
        vec![("token_embd".into(), &*model.embed), ("output".into(), &*model.lm_head)];
    for (i, b) in model.blocks.iter().enumerate() {
        for (what, m) in [
            ("attn_qkv", &b.q.wqkv),
            ("attn_output", &b.q.wo),
            ("ffn_gate_up", &b.q.w_gate_up),
            ("ffn_down", &b.q.w_down),
        ] {
            named.push((format!("blk.{i}.{what}"), m));
        }
    }
    for (name, m) in named {
        let mut ts = vec![];
        types(m, &mut ts);
        if let Some(t) = ts.into_iter().find(|t| !GPU_WEIGHT_TYPES.contains(t)) {
            return Err(GpuError::Unsupported(format!(
                "no GPU kernel for {t:?} weights yet ({name}; the GPU decoder dequantizes \
                 {GPU_WEIGHT_TYPES:?})"
            )));
        }
    }
    let c = &model.config;
    if !matches!(c.arch.as_str(), "llama" | "gemma3") {
        return Err(GpuError::Unsupported(format!(
            "architecture {:?} (the GPU decoder runs llama and gemma3)",
            c.arch
        )));
    }
    if c.gemma3.as_ref().is_some_and(|g| g.final_softcap.is_some()) {
        return Err(GpuError::Unsupported("a final logit soft-cap (no GPU kernel yet)".into()));
    }
    let biased = model.lm_head_bias.is_some()
        || model.blocks.iter().any(|b| b.biases.qkv.is_some() || b.biases.attn_out.is_some());
    if biased {
        return Err(GpuError::Unsupported(
            "projection biases (no GPU kernel adds them yet)".into(),
        ));
    }
    Ok(())
}

/// GGUF blocks of `ty` as the kernel's words: Q4_1 as stored (20 bytes);
/// Q4_0, Q5_0 and Q8_0 with two zero bytes after the f16 scale so the
/// rest starts on a word; the K-quants as 32-element sub-blocks with f32
/// scales and min: Q4_K's as [`WeightKind::K4Sub`]s (nibbles, 24 bytes:
/// 1.3 times Q4_K's), Q5_K's and Q6_K's as [`WeightKind::KSub`]s (a
/// signed byte a quant, 44 bytes). Other types are not supported by the
/// kernels yet.
pub fn device_words(ty: GgmlType, bytes: &[u8]) -> Result<(WeightKind, Vec<u32>), GpuError> {
    let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    if matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K) {
        if bytes.len() % ty.block_layout().1 != 0 {
            return Err(GpuError::Unsupported(format!("{ty:?} payload of {} bytes", bytes.len())));
        }
        let subs = crate::quant::rows::k_sub_blocks(ty, bytes);
        // Q4_K's sub-blocks have one scale and quants 0..16 (checked, not
        // assumed: otherwise the wide form).
        let nibbles = |s: &crate::quant::rows::KSub| {
            s.a[0].to_bits() == s.a[1].to_bits() && s.q.iter().all(|&v| (0..16).contains(&v))
        };
        let compact = ty == GgmlType::Q4_K && subs.iter().all(nibbles);
        let kind = if compact { WeightKind::K4Sub } else { WeightKind::KSub };
        let mut words = Vec::with_capacity(subs.len() * kind.words());
        for s in subs {
            if compact {
                // Element j in byte j % 16's low (j < 16) or high nibble,
                // as Q4_0's.
                words.extend([s.a[0].to_bits(), s.m.to_bits()]);
                let q: Vec<u8> = (0..16).map(|j| s.q[j] as u8 | (s.q[j + 16] as u8) << 4).collect();
                words.extend(q.chunks_exact(4).map(word));
                continue;
            }
            words.extend([s.a[0].to_bits(), s.a[1].to_bits(), s.m.to_bits()]);
            let q: Vec<u8> = s.q.iter().map(|&v| v as u8).collect();
            words.extend(q.chunks_exact(4).map(word));
        }
        return Ok((kind, words));
    }
    let (kind, bsz) = match ty {
        GgmlType::Q4_0 => (WeightKind::Q4_0, 18),
        GgmlType::Q4_1 => (WeightKind::Q4_1, 20),
        GgmlType::Q8_0 => (WeightKind::Q8_0, 34),
        GgmlType::Q5_0 => (WeightKind::Q5_0, 22),
        other => {
            return Err(GpuError::Unsupported(format!("no GPU kernel for {other:?} weights yet")))
        }
    };
    if bytes.len() % bsz != 0 {
        return Err(GpuError::Unsupported(format!("{ty:?} payload of {} bytes", bytes.len())));
    }
    let mut words = Vec::with_capacity(bytes.len() / bsz * kind.words());
    for blk in bytes.chunks_exact(bsz) {
        match kind {
            WeightKind::Q4_1 => words.extend(blk.chunks_exact(4).map(word)),
            // Repacked above.
            WeightKind::KSub | WeightKind::K4Sub => {}
            WeightKind::Q4_0 | WeightKind::Q8_0 | WeightKind::Q5_0 => {
                words.push(u16::from_le_bytes([blk[0], blk[1]]) as u32);
                words.extend(blk[2..].chunks_exact(4).map(word));
            }
        }
    }
    Ok((kind, words))
}

/// One row-stacked part of a matrix on the device.
#[derive(Debug, Clone)]
pub struct GpuPart {
    pub kind: WeightKind,
    pub rows: usize,
    pub words: DeviceBuf<u32>,
}

/// A `[rows, cols]` weight matrix on the device, in row-stacked parts:
/// one a run of rows in one format (several only where a
/// [`crate::quant::QData::Stack`] mixes formats).
#[derive(Debug, Clone)]
pub struct GpuMatrix {
    pub rows: usize,
    pub cols: usize,
    pub parts: Vec<GpuPart>,
}

impl GpuMatrix {
    /// Upload `m`'s GGUF blocks once, each part in one buffer.
    pub fn upload(client: &Client, m: &QMatrix) -> Result<Self, GpuError> {
        Self::upload_parts(client, m, usize::MAX)
    }

    /// [`Self::upload`] with no part's buffer over `max_bytes` (whole
    /// rows a part; a matmul launches once a part, each writing its rows):
    /// wgpu adapters refuse buffers past their limit (lavapipe: Gemma 3's
    /// 180 MB embedding table), CUDA has none.
    pub fn upload_parts(client: &Client, m: &QMatrix, max_bytes: usize) -> Result<Self, GpuError> {
        if m.cols % 32 != 0 {
            return Err(GpuError::Unsupported(format!(
                "matrix width {} is not blocks of 32",
                m.cols
            )));
        }
        // Adjacent parts of one format become one (Q, K and V; gate and
        // up): a matmul launches once a part, and each output row is the
        // same sum whichever launch computes it.
        let mut host: Vec<(WeightKind, usize, Vec<u32>)> = Vec::new();
        for GgufPart { ty, rows, bytes } in m.gguf_parts() {
            let (kind, words) = device_words(ty, &bytes)?;
            match host.last_mut() {
                Some((k, r, w)) if *k == kind => {
                    *r += rows;
                    w.extend_from_slice(&words);
                }
                _ => host.push((kind, rows, words)),
            }
        }
        let mut parts = Vec::with_capacity(host.len());
        for (kind, rows, words) in host {
            let row_words = m.cols / 32 * kind.words();
            let per = (max_bytes / 4 / row_words).clamp(1, rows.max(1));
            for (i, chunk) in words.chunks(per * row_words).enumerate() {
                let rows = (rows - i * per).min(per);
                parts.push(GpuPart { kind, rows, words: DeviceBuf::upload(client, chunk) });
            }
        }
        Ok(Self { rows: m.rows, cols: m.cols, parts })
    }

    /// Whether every part is in a format the exact kernels read
    /// ([`EXACT_WEIGHT_KINDS`]).
    pub fn exact_kinds(&self) -> bool {
        self.parts.iter().all(|p| EXACT_WEIGHT_KINDS.contains(&p.kind))
    }

    /// Bytes held on the device.
    pub fn nbytes(&self) -> usize {
        self.parts.iter().map(|p| p.words.len() * 4).sum()
    }
}

/// RoPE cos/sin `[context, head_dim / 2]`, by the same recurrence and f32
/// operations as [`crate::attn::Rope::new`], so the angles are its bits.
pub fn rope_tables(head_dim: usize, base: f32, context: usize) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let theta_scale = base.powf(-2.0 / head_dim as f32);
    let (mut cos, mut sin) =
        (Vec::with_capacity(context * half), Vec::with_capacity(context * half));
    for p in 0..context {
        let mut theta = p as f32;
        for _ in 0..half {
            cos.push(theta.cos());
            sin.push(theta.sin());
            theta *= theta_scale;
        }
    }
    (cos, sin)
}
