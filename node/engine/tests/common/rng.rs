//! Seeded test data: a small generator and random GGUF blocks.

use gcs_engine::quant::GgmlType;

/// A small deterministic generator (xorshift), values in [-1, 1).
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

/// GGUF blocks of `ty` with random quants and small random scales.
pub fn gguf_blocks(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let (per, bsz) = ty.block_layout();
    let mut out = Vec::new();
    for _ in 0..rows * cols / per {
        let mut b: Vec<u8> = (0..bsz).map(|_| rng.next() as u8).collect();
        b[..2].copy_from_slice(&half::f16::from_f32(0.02 * rng.f()).to_le_bytes());
        // The K-quants' mins' scale beside their scale; Q6_K's scale last.
        if matches!(ty, GgmlType::Q4_1 | GgmlType::Q4_K | GgmlType::Q5_K) {
            b[2..4].copy_from_slice(&half::f16::from_f32(0.05 * rng.f()).to_le_bytes());
        }
        if ty == GgmlType::Q6_K {
            b[208..210].copy_from_slice(&half::f16::from_f32(0.002 * rng.f()).to_le_bytes());
        }
        out.extend(b);
    }
    out
}
