//! The Q5_0 matmul alone, as a Gemma 3 prefill runs it (640 columns; 4096
//! rows = the fused gate/up): ms per matmul for a few batch sizes.
//! `GCS_ENGINE_NO_AVX512=1` for the AVX2 kernel, `RAYON_NUM_THREADS=1`
//! for one thread.
//!
//! usage: cargo run --release -p gcs-engine --example q5_bench [-- ROWS COLS]
use std::time::Instant;

use gcs_engine::par::SpinPool;
use gcs_engine::quant::{GgmlType, QMatrix};

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>().expect("a number"));
    let rows = args.next().unwrap_or(4096);
    let cols = args.next().unwrap_or(640);
    let mut seed = 7u64;
    let mut next = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    };
    // Q5_0 blocks: f16 scale 0.01, random high bits and nibbles.
    let mut bytes = Vec::with_capacity(rows * cols / 32 * 22);
    for _ in 0..rows * cols / 32 {
        bytes.extend_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
        bytes.extend((0..20).map(|_| next() as u8));
    }
    let m = QMatrix::from_gguf(GgmlType::Q5_0, rows, cols, &bytes);
    let pool = SpinPool::for_rayon();
    for n in [1usize, 8, 64, 512] {
        let x: Vec<f32> = (0..n * cols).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
        let mut out = vec![0f32; n * rows];
        let reps = (2048 / n).max(4);
        pool.install(|| m.matmul(&x, n, &mut out));
        let t = Instant::now();
        for _ in 0..reps {
            pool.install(|| m.matmul(&x, n, &mut out));
        }
        let ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
        let gmacs = (rows * cols * n) as f64 / ms / 1e6;
        println!("n {n:4}: {ms:8.3} ms a matmul, {gmacs:6.1} GMAC/s ({} threads)", pool.threads());
    }
}
