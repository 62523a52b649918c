//! Rough per-token cost split: quantized matmuls alone vs a full decode step.
use std::time::Instant;

use gcs_engine::gguf::GgufFile;
use gcs_engine::llama::{KvCache, Llama, SeqInput};

fn main() {
    let path = std::env::args().nth(1).unwrap_or_else(|| {
        "/root/.cache/gcs/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf".into()
    });
    let g = GgufFile::open(&path).unwrap();
    let dev = gcs_engine::cpu_device();
    let m = Llama::from_gguf(&g, &dev).unwrap();
    let c = m.config.clone();
    let x = vec![0.1f32; c.intermediate * 2];
    let n = 50;
    let t = Instant::now();
    for _ in 0..n {
        for b in &m.blocks {
            for w in [&b.q.wqkv, &b.q.wo, &b.q.w_gate_up, &b.q.w_down] {
                let mut o = vec![0f32; w.rows];
                w.matmul(&x[..w.cols], 1, &mut o);
            }
        }
        let mut o = vec![0f32; m.lm_head.rows];
        m.lm_head.matmul(&x[..m.lm_head.cols], 1, &mut o);
    }
    println!("matmuls only: {:.2} ms/token", t.elapsed().as_secs_f64() * 1e3 / n as f64);
    let t = Instant::now();
    for _ in 0..n {
        let mut o = vec![0f32; m.lm_head.rows];
        m.lm_head.matmul(&x[..m.lm_head.cols], 1, &mut o);
    }
    println!("lm_head only: {:.2} ms/token", t.elapsed().as_secs_f64() * 1e3 / n as f64);
    let mut cache = KvCache::new();
    let prompt: Vec<u32> = (0..40).map(|i| 1000 + i).collect();
    m.forward(&mut [SeqInput { tokens: &prompt, cache: &mut cache }]).unwrap();
    let t = Instant::now();
    for i in 0..n {
        let l = m.forward(&mut [SeqInput { tokens: &[2000 + i as u32], cache: &mut cache }]).unwrap();
        let _ = l.into_data();
    }
    println!("full decode step: {:.2} ms/token", t.elapsed().as_secs_f64() * 1e3 / n as f64);
}
