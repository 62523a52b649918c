//! Rough per-token cost split: quantized matmuls alone vs a full decode step.
use std::time::Instant;

use gcs_engine::gguf::GgufFile;
use gcs_engine::llama::{KvCache, Llama, SeqInput};

/// Process CPU time (user + system) in ms, from /proc/self/stat.
fn cpu_ms() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    let f: Vec<&str> = s.rsplit(')').next().unwrap().split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks * 10.0
}

fn main() {
    let path = std::env::args().nth(1).unwrap_or_else(|| {
        format!(
            "{}/.cache/gcs/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
            std::env::var("HOME").unwrap_or_else(|_| "/root".into())
        )
    });
    let g = GgufFile::open(&path).unwrap();
    let dev = gcs_engine::cpu_device();
    let m = Llama::from_gguf(&g, &dev).unwrap();
    let c = m.config.clone();
    let x = vec![0.1f32; c.intermediate * 2];
    let n = 200;
    let t = Instant::now();
    let c0 = cpu_ms();
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
    println!(
        "matmuls only: {:.2} ms/token wall, {:.2} cpu-ms/token",
        t.elapsed().as_secs_f64() * 1e3 / n as f64,
        (cpu_ms() - c0) / n as f64
    );
    let t = Instant::now();
    let c0 = cpu_ms();
    for _ in 0..n {
        let mut o = vec![0f32; m.lm_head.rows];
        m.lm_head.matmul(&x[..m.lm_head.cols], 1, &mut o);
    }
    println!(
        "lm_head only: {:.2} ms/token wall, {:.2} cpu-ms/token",
        t.elapsed().as_secs_f64() * 1e3 / n as f64,
        (cpu_ms() - c0) / n as f64
    );
    for (name, w) in [
        ("wqkv", &m.blocks[0].q.wqkv),
        ("wo", &m.blocks[0].q.wo),
        ("gate_up", &m.blocks[0].q.w_gate_up),
        ("down", &m.blocks[0].q.w_down),
    ] {
        let t = Instant::now();
        for _ in 0..n {
            let mut o = vec![0f32; w.rows];
            w.matmul(&x[..w.cols], 1, &mut o);
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        println!(
            "{name} [{}x{}] {:.1} us/call, {:.1} ns/row, {:.2} GB/s",
            w.rows,
            w.cols,
            us,
            us * 1e3 / w.rows as f64,
            w.nbytes() as f64 / us / 1e3
        );
    }
    let mut cache = KvCache::new();
    let prompt: Vec<u32> = (0..40).map(|i| 1000 + i).collect();
    m.forward(&mut [SeqInput { tokens: &prompt, cache: &mut cache }]).unwrap();
    let t = Instant::now();
    let c0 = cpu_ms();
    for i in 0..n {
        let l =
            m.forward(&mut [SeqInput { tokens: &[2000 + i as u32], cache: &mut cache }]).unwrap();
        let _ = l.into_data();
    }
    println!(
        "full decode step: {:.2} ms/token wall, {:.2} cpu-ms/token",
        t.elapsed().as_secs_f64() * 1e3 / n as f64,
        (cpu_ms() - c0) / n as f64
    );
}
