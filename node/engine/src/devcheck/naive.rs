//! Issue 17's in-run reference: a "naive" burn decode loop of SmolLM2's
//! shapes on a burn device (burn-cuda in the GPU check): per step, 30
//! layers of f32 matmuls (QKV, output, gate+up, down) with SiLU and the
//! residual adds, no attention, the 49,152-row output projection, argmax,
//! one sync. Every op is a separate burn kernel, so its step time is what
//! the launch chain costs; the decoder's figures are read against it.

use std::time::Instant;

use burn::tensor::activation::silu;
use burn::tensor::{Device, Distribution, Tensor};
use serde::Serialize;

/// The loop's shapes (SmolLM2-135M's by default).
#[derive(Debug, Clone, Copy)]
pub struct NaiveShape {
    pub layers: usize,
    pub hidden: usize,
    /// Q + K + V output width.
    pub qkv: usize,
    pub inter: usize,
    pub vocab: usize,
}

impl NaiveShape {
    pub const SMOLLM2: NaiveShape =
        NaiveShape { layers: 30, hidden: 576, qkv: 960, inter: 1536, vocab: 49_152 };
}

/// Step time of the loop at one batch size.
#[derive(Debug, Clone, Serialize)]
pub struct NaiveFigure {
    pub batch: usize,
    pub steps: usize,
    pub ms_per_step: f64,
    pub tokens_per_s: f64,
}

struct Weights {
    layers: Vec<[Tensor<2>; 4]>,
    head: Tensor<2>,
}

fn weights(s: NaiveShape, device: &Device) -> Weights {
    let w = |r, c| Tensor::<2>::random([r, c], Distribution::Uniform(-0.05, 0.05), device);
    let layers = (0..s.layers)
        .map(|_| {
            [
                w(s.hidden, s.qkv),
                w(s.hidden, s.hidden),
                w(s.hidden, 2 * s.inter),
                w(s.inter, s.hidden),
            ]
        })
        .collect();
    Weights { layers, head: w(s.hidden, s.vocab) }
}

/// One step at `x`'s batch: the argmax ids (read back: the sync).
fn step(s: NaiveShape, w: &Weights, mut x: Tensor<2>) -> Vec<i64> {
    let b = x.dims()[0];
    for [wqkv, wo, wgu, wd] in &w.layers {
        let qkv = x.clone().matmul(wqkv.clone());
        x = x + qkv.slice([0..b, 0..s.hidden]).matmul(wo.clone());
        let gu = x.clone().matmul(wgu.clone());
        let act =
            silu(gu.clone().slice([0..b, 0..s.inter])) * gu.slice([0..b, s.inter..2 * s.inter]);
        x = x + act.matmul(wd.clone());
    }
    let ids = x.matmul(w.head.clone()).argmax(1);
    ids.into_data().convert::<i64>().try_to_vec::<i64>().unwrap_or_default()
}

/// `steps` timed steps (after two untimed) at each batch size.
pub fn run(s: NaiveShape, device: &Device, batches: &[usize], steps: usize) -> Vec<NaiveFigure> {
    let w = weights(s, device);
    batches
        .iter()
        .map(|&batch| {
            let x = Tensor::<2>::random(
                [batch.max(1), s.hidden],
                Distribution::Uniform(-1.0, 1.0),
                device,
            );
            for _ in 0..2 {
                step(s, &w, x.clone());
            }
            let t = Instant::now();
            for _ in 0..steps {
                step(s, &w, x.clone());
            }
            let sec = t.elapsed().as_secs_f64();
            let per = sec / steps.max(1) as f64;
            NaiveFigure {
                batch,
                steps,
                ms_per_step: per * 1e3,
                tokens_per_s: if per > 0.0 { batch as f64 / per } else { 0.0 },
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loop_runs_and_returns_one_id_per_row() {
        let s = NaiveShape { layers: 2, hidden: 8, qkv: 12, inter: 6, vocab: 20 };
        let d = crate::cpu_device();
        let w = weights(s, &d);
        let ids = step(s, &w, Tensor::<2>::random([3, 8], Distribution::Uniform(-1.0, 1.0), &d));
        assert_eq!(ids.len(), 3);
        assert!(ids.iter().all(|&i| (0..20).contains(&i)), "{ids:?}");
        let figs = run(s, &d, &[1, 4], 2);
        assert_eq!(figs.iter().map(|f| f.batch).collect::<Vec<_>>(), [1, 4]);
        assert!(figs.iter().all(|f| f.ms_per_step > 0.0 && f.tokens_per_s > 0.0), "{figs:?}");
    }
}
