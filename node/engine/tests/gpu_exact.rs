//! The CPU's arithmetic on the GPU (`kernels::exact`, with `GCS_GPU_EXACT`)
//! on wgpu (Mesa's lavapipe), each kernel against the CPU engine's own op,
//! bit for bit: SwiGLU with ggml's `expf` (its over- and underflow
//! branches too), and RoPE with the f16 K/V write and attention
//! in both of llama.cpp's orders (prefill rows, decode rows, one sequence
//! crossing from one to the other, more keys than a cube has units). The
//! exact embedding rows and matmuls are checked in `gpu_kernels`.
//! `cargo test -p gcs-engine --features wgpu --test gpu_exact`.
#![cfg(feature = "wgpu")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use cubecl::client::Client;
use gcs_engine::attn::PagedSeqRef;
use gcs_engine::backend::gpu::launch::{self, Attn, FusedRope, RowMeta};
use gcs_engine::backend::gpu::DeviceBuf;
use gcs_engine::numerics::swiglu_rows;
use gcs_engine::quant::QActs;

mod common;
use common::gpu::{assert_acts_eq, AttnRig};
use common::rng::Rng;

fn client() -> Client {
    cubecl::Device::Wgpu(Default::default()).client()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Lavapipe's `fma` rounds twice: the kernels take the f64 stand-in.
const WIDE: Option<bool> = Some(true);

#[test]
fn exact_swiglu_equals_the_cpu_bit_for_bit() {
    let c = client();
    let mut rng = Rng(0xe_5817);
    let (n, inter) = (4, 1536);
    let mut gu: Vec<f32> = rng.vec(n * 2 * inter).iter().map(|v| v * 8.0).collect();
    // Gates whose exp(−g) leaves scalef's range (|n| > 126), overflows,
    // underflows, or is exact.
    let edges = [-200.0, -100.0, -90.0, -88.5, 87.0, 88.8, 100.0, 104.0, 150.0, 0.0, -0.0, 1e-30];
    for (i, &g) in edges.iter().enumerate() {
        gu[i] = g;
    }
    let (hg, ha) = (DeviceBuf::upload(&c, &gu), DeviceBuf::<f32>::uninit(&c, n * inter));
    launch::swiglu(&c, &hg, &ha, inter, WIDE);
    let mut want = vec![0f32; n * inter];
    swiglu_rows(&gu, &mut want, inter);
    assert_eq!(bits(&ha.read(&c).unwrap()), bits(&want));
    // The float kernel is not the CPU's (the test can tell them apart).
    launch::swiglu(&c, &hg, &ha, inter, None);
    assert_ne!(bits(&ha.read(&c).unwrap()), bits(&want), "the float SwiGLU");
}

/// The down projection's exact input in one kernel
/// (`launch::quantize_q8` with `glu`): the quantized blocks of what the exact
/// SwiGLU writes, bit for bit, over rows of several blocks.
#[test]
fn swiglu_fused_into_the_quantizer_equals_the_two_kernels() {
    let c = client();
    let mut rng = Rng(0x5_9a7e);
    let (n, inter) = (5, 1536);
    let gu: Vec<f32> = rng.vec(n * 2 * inter).iter().map(|v| v * 8.0).collect();
    let hg = DeviceBuf::upload(&c, &gu);
    let act = DeviceBuf::<f32>::uninit(&c, n * inter);
    launch::swiglu(&c, &hg, &act, inter, WIDE);
    let (two, one) = (launch::QActs::new(&c, n * inter), launch::QActs::new(&c, n * inter));
    launch::quantize_q8(&c, &act, n, inter, &two, None);
    launch::quantize_q8(&c, &hg, n, inter, &one, WIDE);
    let all = |a: &launch::QActs| {
        let (d, s) = (a.d.read(&c).unwrap(), a.s.read(&c).unwrap());
        (a.qs.read(&c).unwrap(), bits(&d), bits(&s), a.sum_q.read(&c).unwrap())
    };
    let (want, got) = (all(&two), all(&one));
    assert_eq!(want, got);
    // Not vacuous: the blocks differ from row to row.
    assert_ne!(want.1[0], want.1[inter / 32]);
}

/// One sequence of the attention test.
struct Seq {
    table: Vec<u32>,
    decode_from: usize,
    past: usize,
}

#[test]
fn exact_rope_and_attention_equal_the_cpu_pool_bit_for_bit() {
    let c = client();
    let mut rng = Rng(0xe_a77);
    let rig = AttnRig::new(&c, 512, 40);
    let (sh, rope, layer, pool) = (rig.sh, &rig.rope, rig.layer, rig.pool());
    let (cos, sin) = (&rig.cos, &rig.sin);
    let mut cpu = rig.cpu_pool();
    let (width, qd) = (sh.width(), 9 * 64);
    // Sequence 0 turns to the decode order in the middle of a step,
    // sequence 2 has more keys than a cube's 256 units.
    let mut seqs = [
        Seq { table: vec![5, 2], decode_from: 21, past: 0 },
        Seq { table: vec![7, 0, 3, 9], decode_from: 37, past: 0 },
        Seq { table: (10..30).collect(), decode_from: 291, past: 0 },
    ];
    let (mut decode_rows, mut prefill_rows, mut fused_steps) = (0, 0, 0);
    for step in [[20usize, 37, 290], [1, 1, 1], [3, 1, 2], [1, 1, 1]] {
        let mut qkv = Vec::new();
        let (mut pos, mut slot, mut table, mut tables, mut single) =
            (vec![], vec![], vec![], vec![], vec![]);
        for (s, &t) in seqs.iter().zip(&step) {
            let toff = tables.len() as u32;
            tables.extend_from_slice(&s.table);
            for i in 0..t {
                qkv.extend(rng.vec(width).iter().map(|v| v * 3.0));
                let p = s.past + i;
                pos.push(p as u32);
                slot.push(s.table[p / 16] * 16 + (p % 16) as u32);
                table.push(toff);
                single.push(u32::from(p >= s.decode_from));
            }
        }
        decode_rows += single.iter().filter(|&&s| s == 1).count();
        prefill_rows += single.iter().filter(|&&s| s == 0).count();
        let rows = pos.len();
        let meta = RowMeta {
            pos: DeviceBuf::upload(&c, &pos),
            slot: DeviceBuf::upload(&c, &slot),
            table: DeviceBuf::upload(&c, &table),
            tables: DeviceBuf::upload(&c, &tables),
            single: DeviceBuf::upload(&c, &single),
        };
        let hq = DeviceBuf::upload(&c, &qkv);
        let ho = DeviceBuf::<f32>::uninit(&c, rows * qd);
        let acts = launch::QActs::new(&c, rows * qd);
        // A decode step (each row its sequence's only one) rotates and
        // stores K/V inside the attention, as the decoder does.
        let fused = (rows == seqs.len()).then_some(FusedRope { cos, sin });
        if fused.is_none() {
            launch::rope_kv_store(&c, sh, &hq, pool, cos, sin, &meta, WIDE);
        }
        fused_steps += usize::from(fused.is_some());
        let how = Attn::Exact { wide: true, acts: &acts, rope: fused };
        launch::paged_attention(&c, sh, &hq, pool, &ho, &meta, 1.0 / 8.0, 0, how);

        let mut cq = qkv.clone();
        let mut cout = vec![0f32; rows * qd];
        let refs: Vec<PagedSeqRef<'_>> = seqs
            .iter()
            .zip(&step)
            .map(|(s, &t)| PagedSeqRef {
                past: s.past,
                t,
                table: &s.table,
                decode_from: s.decode_from,
            })
            .collect();
        cpu.attend(layer, rope, &mut cq, &refs, &mut cout);
        let (gq, got) = (hq.read(&c).unwrap(), ho.read(&c).unwrap());
        for r in 0..rows {
            let q = |v: &[f32]| bits(&v[r * width..r * width + qd]);
            assert_eq!(q(&gq), q(&cq), "step {step:?}: rotated Q of row {r}");
            let o = |v: &[f32]| bits(&v[r * qd..(r + 1) * qd]);
            assert_eq!(o(&got), o(&cout), "step {step:?}: attention of row {r}");
        }
        // Its output quantized for the O projection, as `QActs::quantize`.
        let want = QActs::quantize(&cout, rows, qd);
        assert_acts_eq(&c, &acts, &want, &format!("step {step:?}: quantized output"));
        // Both f16 pools as the CPU's, bit for bit (the device's are
        // position-major in a head, the CPU's dimension-major).
        let (ck, cv) = cpu.layer(layer);
        for (what, dev, host) in [("K", &rig.kp, ck), ("V", &rig.vp, cv)] {
            let dev = dev.read(&c).unwrap();
            let off = pool.off;
            let at = |i: usize| {
                let (b, r) = (i / sh.block_len(), i % sh.block_len());
                let (h, r) = (r / (16 * 64), r % (16 * 64));
                let (d, o) = (r / 16, r % 16);
                dev[off + b * sh.block_len() + (h * 16 + o) * 64 + d]
            };
            let differ = (0..host.len()).filter(|&i| at(i).to_bits() != host[i].to_bits()).count();
            assert_eq!(differ, 0, "step {step:?}: {what} pool");
        }
        eprintln!("step {step:?}: {rows} rows equal");
        for (s, &t) in seqs.iter_mut().zip(&step) {
            s.past += t;
        }
    }
    assert!(decode_rows >= 8 && prefill_rows >= 300, "{decode_rows} / {prefill_rows}");
    assert_eq!(fused_steps, 2, "decode steps with RoPE inside the attention");
}

/// The exact decoder behind the batch scheduler streams the CPU engine's
/// tokens bit for bit, whatever a step does beside the logits on the
/// device: a bias and penalties added before a greedy pick, a draw and a
/// top-p draw; a JSON grammar's mask, alone and beside penalties. Every
/// stream asks for logprobs, so the device selects the candidates they
/// come from before its additions (`Pick::Scored`) or of the masked row
/// (`Pick::Top`); all five run in one batch. The logprobs are the CPU's
/// bit for bit too: both sides weigh the logits by ggml's `expf` and sum
/// the normaliser in the same ranges (`sampling::range_sums`).
#[test]
fn the_exact_decoder_streams_the_cpu_engines_logprobs_beside_additions_and_masks() {
    use gcs_engine::backend::{ComputeDevice, GpuOptions};
    use gcs_engine::sampling::{Logprobs, SamplingOptions};
    use gcs_engine::{cpu_device, BatchConfig, BatchEngine, ChatMessage, Engine, Grammar};
    use gcs_engine::{Prompt, SeqRequest};
    let Some(path) = common::smollm_path() else { return };
    let e = Engine::load(&path, &cpu_device()).unwrap();
    let ids = e.prompt_tokens(&[ChatMessage::new("user", "Describe a cat as JSON.")]).unwrap();
    let penalized = |temperature, top_p| SamplingOptions {
        temperature,
        top_p,
        seed: 11,
        frequency_penalty: 0.5,
        presence_penalty: 0.3,
        logit_bias: vec![(13, -2.0), (28, 1.5), (330, -1.0)],
        ..Default::default()
    };
    let drawn = SamplingOptions { temperature: 1.0, seed: 3, ..Default::default() };
    let asks = [
        (penalized(0.0, 1.0), None),
        (penalized(1.0, 1.0), None),
        (penalized(0.8, 0.9), None),
        (drawn, Some(Grammar::JsonObject)),
        (penalized(0.0, 1.0), Some(Grammar::JsonObject)),
    ];
    let run = |engine: &BatchEngine| {
        let streams: Vec<_> = asks
            .iter()
            .map(|(sampling, grammar)| {
                let mut r = SeqRequest::new(Prompt::Tokens(ids.clone()), 8);
                (r.sampling, r.grammar, r.logprobs) = (sampling.clone(), grammar.clone(), Some(4));
                engine.submit(r).unwrap()
            })
            .collect();
        streams.into_iter().map(common::tokens_and_logprobs).collect::<Vec<_>>()
    };
    let cfg = BatchConfig { max_running: 8, kv_blocks: 64, ..BatchConfig::default() };
    let exact = GpuOptions { exact: Some(true), ..Default::default() };
    let gpu =
        BatchEngine::start_on(e, BatchConfig { gpu: exact, ..cfg.clone() }, ComputeDevice::Wgpu(0))
            .unwrap();
    let cpu = BatchEngine::start(Engine::load(&path, &cpu_device()).unwrap(), cfg);
    let (g, c) = (run(&gpu), run(&cpu));
    for (i, ((gt, gl), (ct, cl))) in g.iter().zip(&c).enumerate() {
        eprintln!("stream {i}: GPU {gt:?}, CPU {ct:?}");
        assert!(!gt.is_empty() && gl.len() == gt.len(), "stream {i}");
        assert_eq!(gt, ct, "stream {i}'s tokens");
        let bits = |l: &[Logprobs]| {
            let one = |t: &gcs_engine::sampling::TokenLogprob| (t.token, t.logprob.to_bits());
            let each = |x: &Logprobs| (one(&x.chosen), x.top.iter().map(one).collect::<Vec<_>>());
            l.iter().map(each).collect::<Vec<_>>()
        };
        assert_eq!(bits(gl), bits(cl), "stream {i}'s logprobs");
        // Under a grammar only the allowed alternatives are listed.
        let listed = |n: usize| n == 4 || (asks[i].1.is_some() && n > 0);
        assert!(gl.iter().all(|l| listed(l.top.len()) && l.chosen.logprob <= 0.0), "stream {i}");
    }
    // The grammar's mask was applied: the penalised greedy stream under
    // it is not the one without it.
    assert_ne!(g[0].0, g[4].0);
}
