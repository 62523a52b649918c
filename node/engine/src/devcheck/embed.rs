//! The BERT embedder on the checked device (burn-cuda for a CUDA GPU)
//! against the same model on the CPU: how close the vectors are, and how
//! many texts a second each embeds at several batch sizes.

use std::path::Path;
use std::time::Instant;

use serde::Serialize;

use crate::backend::{self, ComputeDevice};
use crate::bert::Embedder;
use crate::cpu_device;
use crate::error::Result;

/// Texts embedded per second at one batch size.
#[derive(Debug, Clone, Serialize)]
pub struct EmbedRate {
    pub batch: usize,
    pub texts_per_s: f64,
}

/// The embedder's findings (`gpu-check.json`, `embed`).
#[derive(Debug, Clone, Serialize)]
pub struct EmbedFigure {
    /// Where the device's copy ran (`burn-cuda`, or `burn-flex`).
    pub backend: String,
    pub texts: usize,
    /// The least cosine similarity of a text's device and CPU vectors.
    pub min_cosine: f32,
    pub device: Vec<EmbedRate>,
    pub cpu: Vec<EmbedRate>,
}

/// A text of `i`'s own length and words (1 to ~90 tokens).
fn text(i: usize) -> String {
    let words = ["river", "quiet", "engine", "paper", "seven", "orange", "signal", "market"];
    let n = 1 + (i * 7) % 60;
    (0..n).map(|k| words[(i + k * 3) % words.len()]).collect::<Vec<_>>().join(" ")
}

fn rate(e: &Embedder, texts: &[&str], batch: usize) -> Result<EmbedRate> {
    let batch = batch.clamp(1, texts.len().max(1));
    let chunk = &texts[..batch];
    e.embed(chunk)?; // warm-up: kernels compiled, buffers sized
    let reps = 3;
    let t = Instant::now();
    for _ in 0..reps {
        e.embed(chunk)?;
    }
    let s = t.elapsed().as_secs_f64();
    Ok(EmbedRate { batch, texts_per_s: if s > 0.0 { (batch * reps) as f64 / s } else { 0.0 } })
}

/// Compare and time the embedder in `dir` on `device` against the CPU.
pub fn run(dir: &Path, device: ComputeDevice, batches: &[usize]) -> Result<EmbedFigure> {
    let most = batches.iter().copied().max().unwrap_or(1).max(64);
    let owned: Vec<String> = (0..most).map(text).collect();
    let texts: Vec<&str> = owned.iter().map(String::as_str).collect();
    let cpu = Embedder::load(dir, &cpu_device())?;
    let dev = Embedder::load(dir, &backend::burn_device(device))?;
    let n = 64.min(texts.len());
    let (a, b) = (cpu.embed(&texts[..n])?, dev.embed(&texts[..n])?);
    // Both are L2-normalised: the dot product is the cosine.
    let min_cosine = a
        .iter()
        .zip(&b)
        .map(|(x, y)| x.iter().zip(y).map(|(p, q)| p * q).sum::<f32>())
        .fold(f32::INFINITY, f32::min);
    let time = |e: &Embedder, bs: &[usize]| {
        bs.iter().map(|&bt| rate(e, &texts, bt)).collect::<Result<Vec<_>>>()
    };
    Ok(EmbedFigure {
        backend: backend::burn_backend_name(device).into(),
        texts: n,
        min_cosine,
        device: time(&dev, batches)?,
        // The CPU at the smaller sizes only: a 256-text batch is seconds.
        cpu: time(&cpu, &batches.iter().copied().filter(|&b| b <= 32).collect::<Vec<_>>())?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_vary_in_length_and_are_fixed() {
        assert_eq!(text(3), text(3));
        let lens: std::collections::BTreeSet<usize> =
            (0..64).map(|i| text(i).split(' ').count()).collect();
        assert!(lens.len() > 20, "{lens:?}");
    }
}
