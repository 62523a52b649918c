//! A paged attention layer on the GPU beside the CPU's, and a decoder
//! against a reference one (wgpu tests).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use cubecl::client::Client;
use gcs_engine::attn::{AttnShape, KvPool, Rope};
use gcs_engine::backend::gpu::kernels::attention::HeadShape;
use gcs_engine::backend::gpu::launch::{self, LayerPool};
use gcs_engine::backend::gpu::weights::rope_tables;
use gcs_engine::backend::gpu::DeviceBuf;
use gcs_engine::backend::PagedDecoder;
use gcs_engine::llama::PagedSeq;
use gcs_engine::quant::QActs;
use gcs_engine::sampling::argmax;
use gcs_engine::{ChatMessage, Engine};

/// Layers of the rig's pools; [`AttnRig::layer`] is the one used.
pub const N_LAYERS: usize = 2;

/// SmolLM2's attention shape (9 query heads over 3 KV heads of 64), RoPE
/// tables of `ctx` positions on both sides, and zeroed device pools of
/// `n_blocks` blocks in [`N_LAYERS`] layers.
pub struct AttnRig {
    pub ash: AttnShape,
    pub sh: HeadShape,
    pub rope: Rope,
    pub cos: DeviceBuf<f32>,
    pub sin: DeviceBuf<f32>,
    pub kp: DeviceBuf<launch::KvElem>,
    pub vp: DeviceBuf<launch::KvElem>,
    pub layer: usize,
    pub n_blocks: usize,
}

impl AttnRig {
    pub fn new(c: &Client, ctx: usize, n_blocks: usize) -> Self {
        let sh = HeadShape { n_heads: 9, n_kv_heads: 3, head_dim: 64, neox: false };
        let (cos, sin) = rope_tables(64, 100000.0, ctx);
        let pool_len = N_LAYERS * n_blocks * sh.block_len();
        Self {
            ash: AttnShape { n_heads: 9, n_kv_heads: 3, head_dim: 64 },
            sh,
            rope: Rope::new(64, 100000.0, ctx),
            cos: DeviceBuf::upload(c, &cos),
            sin: DeviceBuf::upload(c, &sin),
            kp: DeviceBuf::zeros(c, pool_len),
            vp: DeviceBuf::zeros(c, pool_len),
            layer: 1,
            n_blocks,
        }
    }

    /// The used layer of the device pools.
    pub fn pool(&self) -> LayerPool<'_> {
        LayerPool {
            k: &self.kp,
            v: &self.vp,
            off: self.layer * self.n_blocks * self.sh.block_len(),
        }
    }

    /// The CPU's pool of the same shape.
    pub fn cpu_pool(&self) -> KvPool {
        KvPool::new(N_LAYERS, self.ash, self.n_blocks)
    }
}

/// The device's quantized inputs `got` equal the CPU's `want` bit for bit:
/// scales, scaled sums, integer sums and bytes.
#[track_caller]
pub fn assert_acts_eq(c: &Client, got: &launch::QActs, want: &QActs, what: &str) {
    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(got.d.read(c).unwrap()), bits(want.d.clone()), "{what}: d");
    assert_eq!(bits(got.s.read(c).unwrap()), bits(want.s.clone()), "{what}: s");
    assert_eq!(got.sum_q.read(c).unwrap(), want.sum_q, "{what}: Σq");
    let qs: Vec<i8> =
        got.qs.read(c).unwrap().iter().flat_map(|w| w.to_le_bytes().map(|b| b as i8)).collect();
    assert_eq!(qs, want.qs, "{what}: bytes");
}

/// Whether `mass`, a device's sum of `exp(l / t - max / t)` over `logits`
/// (`sampling::TopCandidates::mass`), is that sum's exact value within
/// float rounding (2e-5 relative). The exact value, not the host's own
/// f32 sum: that one, in id order, drops the tiny terms once it nears 1,
/// and is the further off (1.3e-4 of a peaked row at 0.9).
pub fn mass_is_exact(mass: f32, logits: &[f32], t: f32) -> bool {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) / t;
    let exact: f64 = logits.iter().map(|&l| ((l / t - max) as f64).exp()).sum();
    ((mass as f64 - exact) / exact).abs() < 2e-5
}

/// Teacher-forced steps of two prompts batched together on both decoders
/// (a prefill, then 7 decode steps, the tokens of `cpu` (the reference)
/// fed to both):
/// (top-1 agreements, steps, max |Δ logit|, logits bit-equal throughout).
pub fn compare(
    engine: &Engine,
    gpu: &mut dyn PagedDecoder,
    cpu: &mut dyn PagedDecoder,
) -> (usize, usize, f32, bool) {
    let prompts = ["Name three colours of the rainbow.", "What is 2 + 2?"];
    let toks: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| engine.prompt_tokens(&[ChatMessage::new("user", *p)]).unwrap())
        .collect();
    // Scattered, disjoint block tables.
    let tables: [Vec<u32>; 2] = [vec![3, 9, 1, 12], vec![0, 14, 5, 7]];
    let vocab = cpu.vocab();
    let (mut agree, mut total, mut max_d, mut equal) = (0usize, 0usize, 0f32, true);
    let mut feed: Vec<Vec<u32>> = toks.clone();
    let mut past = [0usize; 2];
    for step in 0..8 {
        let seqs: Vec<PagedSeq<'_>> = (0..2)
            .map(|i| PagedSeq {
                tokens: &feed[i],
                past: past[i],
                table: &tables[i],
                decode_from: toks[i].len(),
            })
            .collect();
        let a = cpu.forward_paged(&seqs).unwrap();
        let b = gpu.forward_paged(&seqs).unwrap();
        assert_eq!(a.len(), 2 * vocab);
        assert_eq!(b.len(), 2 * vocab);
        equal &= a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
        let mut next = vec![];
        for i in 0..2 {
            let (la, lb) = (&a[i * vocab..(i + 1) * vocab], &b[i * vocab..(i + 1) * vocab]);
            let d = la.iter().zip(lb).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            max_d = max_d.max(d);
            let t = argmax(la);
            agree += usize::from(argmax(lb) == t);
            total += 1;
            past[i] += feed[i].len();
            next.push(vec![t]); // teacher-forced by the CPU's choice
        }
        eprintln!("step {step}: max |Δ logit| so far {max_d:.3}, top-1 {agree}/{total}");
        feed = next;
    }
    (agree, total, max_d, equal)
}
