//! One row-type matmul alone (Q5_0 by default, as a Gemma 3 prefill runs
//! it: 640 columns, 4096 rows = the fused gate/up; or q4_k / q5_k / q6_k):
//! ms per matmul for a few batch sizes, random blocks.
//! `GCS_ENGINE_NO_AVX512=1` for the AVX2 kernels, `RAYON_NUM_THREADS=1`
//! for one thread.
//!
//! usage: cargo run --release -p gcs-engine --example rows_bench [-- ROWS COLS TYPE]
use std::time::Instant;

use gcs_engine::par::SpinPool;
use gcs_engine::quant::{GgmlType, QMatrix};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, def: usize| args.get(i).map_or(def, |a| a.parse().expect("a number"));
    let (rows, cols) = (num(0, 4096), num(1, 640));
    let ty = match args.get(2).map_or("q5_0", |s| s.as_str()) {
        "q5_0" => GgmlType::Q5_0,
        "q4_k" => GgmlType::Q4_K,
        "q5_k" => GgmlType::Q5_K,
        "q6_k" => GgmlType::Q6_K,
        other => panic!("type {other}: q5_0, q4_k, q5_k or q6_k"),
    };
    let (per, bsz) = ty.block_layout();
    // Where each block's f16 scales are (the rest is random bytes).
    let scales: &[usize] = match ty {
        GgmlType::Q5_0 => &[0],
        GgmlType::Q6_K => &[208],
        _ => &[0, 2],
    };
    let mut seed = 7u64;
    let mut next = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    };
    let mut bytes = Vec::with_capacity(rows * cols / per * bsz);
    for _ in 0..rows * cols / per {
        let mut blk: Vec<u8> = (0..bsz).map(|_| next() as u8).collect();
        for &at in scales {
            blk[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
        }
        bytes.extend(blk);
    }
    let m = QMatrix::from_gguf(ty, rows, cols, &bytes);
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
        println!(
            "{ty:?} n {n:4}: {ms:8.3} ms a matmul, {gmacs:6.1} GMAC/s ({} threads)",
            pool.threads()
        );
    }
}
