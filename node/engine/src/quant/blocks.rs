//! A [`QMatrix`] back in its GGUF block bytes: the inverse of
//! [`QMatrix::from_gguf`]'s repacking, for a backend that keeps the blocks
//! in its own layout (the GPU decoder uploads them).

use super::{bidx, q4_offset, GgmlType, QData, QKind, QMatrix, GROUP, QK};

/// One row-stacked part of a matrix, as GGUF stores it (row-major blocks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufPart {
    pub ty: GgmlType,
    pub rows: usize,
    pub bytes: Vec<u8>,
}

impl QKind {
    fn ggml(self) -> GgmlType {
        match self {
            QKind::Q4_0 => GgmlType::Q4_0,
            QKind::Q4_1 => GgmlType::Q4_1,
            QKind::Q8_0 => GgmlType::Q8_0,
        }
    }
}

impl QMatrix {
    /// The matrix as GGUF blocks, one part per stacked matrix (one part
    /// unless [`QData::Stack`]); unquantized matrices come back as F32.
    pub fn gguf_parts(&self) -> Vec<GgufPart> {
        match &self.data {
            QData::Stack(parts) => parts.iter().flat_map(QMatrix::gguf_parts).collect(),
            QData::Rows { ty, bytes } => {
                vec![GgufPart { ty: *ty, rows: self.rows, bytes: bytes.clone() }]
            }
            QData::F32(w) => vec![GgufPart {
                ty: GgmlType::F32,
                rows: self.rows,
                bytes: w.iter().flat_map(|v| v.to_le_bytes()).collect(),
            }],
            QData::Quant { kind, d, m, qs } => {
                let ty = kind.ggml();
                let (_, bsz) = ty.block_layout();
                let (nb, qb) = (self.cols / QK, kind.qbytes());
                let mut out = Vec::with_capacity(self.rows * nb * bsz);
                for r in 0..self.rows {
                    for b in 0..nb {
                        let k = bidx(nb, r, b);
                        out.extend_from_slice(&d[k].to_le_bytes());
                        if *kind == QKind::Q4_1 {
                            out.extend_from_slice(&m[k].to_le_bytes());
                        }
                        match kind {
                            QKind::Q4_0 | QKind::Q4_1 => {
                                let base = (k - r % GROUP) * 16;
                                out.extend((0..16).map(|e| qs[base + q4_offset(r, e)]));
                            }
                            QKind::Q8_0 => out.extend_from_slice(&qs[k * qb..][..qb]),
                        }
                    }
                }
                vec![GgufPart { ty, rows: self.rows, bytes: out }]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic bytes with valid (finite, small) f16 scales.
    fn blocks(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
        let (per, bsz) = ty.block_layout();
        let n = rows * cols / per;
        let mut out = Vec::with_capacity(n * bsz);
        for i in 0..n {
            let mut blk: Vec<u8> = (0..bsz).map(|j| ((i * 131 + j * 29) % 251) as u8).collect();
            blk[..2].copy_from_slice(&half::f16::from_f32(0.01 + i as f32 * 1e-4).to_le_bytes());
            if ty == GgmlType::Q4_1 {
                blk[2..4].copy_from_slice(&half::f16::from_f32(-0.05).to_le_bytes());
            }
            out.extend(blk);
        }
        out
    }

    #[test]
    fn parts_give_back_the_gguf_bytes() {
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q6_K] {
            // 12 rows: one full group of 8 and a padded one.
            let (rows, cols) = (12, 256);
            let bytes = blocks(ty, rows, cols);
            let m = QMatrix::from_gguf(ty, rows, cols, &bytes);
            let parts = m.gguf_parts();
            assert_eq!(parts, vec![GgufPart { ty, rows, bytes }], "{ty:?}");
        }
    }

    #[test]
    fn a_stack_gives_one_part_per_matrix() {
        let a = blocks(GgmlType::Q4_1, 8, 64);
        let b = blocks(GgmlType::Q8_0, 8, 64);
        let m = QMatrix::stack(vec![
            QMatrix::from_gguf(GgmlType::Q4_1, 8, 64, &a),
            QMatrix::from_gguf(GgmlType::Q8_0, 8, 64, &b),
        ])
        .unwrap_or_else(|| unreachable!("equal widths"));
        let parts = m.gguf_parts();
        assert_eq!(parts.len(), 2);
        assert_eq!((parts[0].ty, &parts[0].bytes), (GgmlType::Q4_1, &a));
        assert_eq!((parts[1].ty, &parts[1].bytes), (GgmlType::Q8_0, &b));
    }
}
