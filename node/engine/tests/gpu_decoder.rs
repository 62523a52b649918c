//! `GpuDecoder` (CubeCL on wgpu/lavapipe) against `CpuDecoder` on SmolLM2:
//! teacher-forced top-1 agreement and max |Δ logit| over a prefill and
//! decode steps of two sequences batched together (needs the model; skips
//! otherwise). `-- --nocapture` prints the figures.
#![cfg(feature = "wgpu")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::gpu::compare;
use gcs_engine::backend::gpu::{launch, GpuDecoder};
use gcs_engine::backend::{Adjust, BackendKind, CpuDecoder, PagedDecoder, Pick};
use gcs_engine::llama::PagedSeq;
use gcs_engine::sampling::{argmax, draw_temperature, top_candidates};
use gcs_engine::{cpu_device, ChatMessage, Engine};

fn cpu_decoder(path: &std::path::Path) -> Box<dyn PagedDecoder> {
    Box::new(CpuDecoder::new(Engine::load(path, &cpu_device()).unwrap().model, 16))
}

/// With `GCS_GPU_EXACT`'s arithmetic (`GpuDecoder::with_exact`), the GPU
/// step is the CPU's bit for bit: every logit of a prefill and of decode
/// steps, so greedy tokens are the same on either.
#[test]
fn the_exact_gpu_decoder_equals_the_cpu_decoder_bit_for_bit() {
    let Some(path) = common::smollm_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let client = cubecl::Device::Wgpu(Default::default()).client();
    let gpu = GpuDecoder::new(client, BackendKind::Wgpu, &engine.model, 16).unwrap();
    let mut gpu = gpu.with_exact(true).unwrap();
    assert!(gpu.exact());
    let (agree, total, max_d, equal) = compare(&engine, &mut gpu, &mut *cpu_decoder(&path));
    eprintln!("exact GPU (lavapipe) vs CPU: top-1 {agree}/{total}, max |Δ logit| {max_d:e}");
    assert!(equal, "logits differ: max |Δ| {max_d:e}, top-1 {agree}/{total}");
    // Nine launches a layer in the CPU's arithmetic (norm and its
    // quantization, Q/K/V, RoPE/K-V store, attention and its quantization,
    // O, norm and quantization, gate/up, SwiGLU quantized for the down
    // projection, down), the embedding before; the output norm with its
    // quantization, the LM head and the pick after.
    // A decode step: 8 a layer (the attention rotates and stores K/V).
    assert_launches(&mut gpu, engine.model.config.n_layers, 9, 8, 0);
}

/// A prefill step of two tokens launches `prefill` kernels a layer, the
/// decode step after it `decode`: with the embedding before and the
/// output norm, LM head and pick after, and `extra` launches more (a
/// matrix in several parts launches once a part).
fn assert_launches(
    gpu: &mut dyn PagedDecoder,
    layers: usize,
    prefill: usize,
    decode: usize,
    extra: usize,
) {
    for (tokens, past, per_layer) in [(&[1u32, 2][..], 0, prefill), (&[3u32][..], 2, decode)] {
        let before = launch::launches();
        let seq = PagedSeq { tokens, past, table: &[4], decode_from: 2 };
        gpu.forward_paged(&[seq]).unwrap();
        let n = launch::launches() - before;
        assert_eq!(n, 1 + per_layer * layers + 3 + extra, "{} tokens", tokens.len());
    }
}

#[test]
fn gpu_decoder_agrees_with_the_cpu_decoder() {
    let Some(path) = common::smollm_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let client = cubecl::Device::Wgpu(Default::default()).client();
    let gpu = GpuDecoder::new(client, BackendKind::Wgpu, &engine.model, 16).unwrap();
    let mut gpu: Box<dyn PagedDecoder> = Box::new(gpu.with_exact(false).unwrap());
    let mut cpu = cpu_decoder(&path);
    assert_eq!(gpu.vocab(), cpu.vocab());
    let (agree, total, max_d, _) = compare(&engine, &mut *gpu, &mut *cpu);
    eprintln!("GPU (lavapipe) vs CPU: top-1 {agree}/{total}, max |Δ logit| {max_d:.3}");
    // The CPU quantizes activations to 8 bits and rounds K/V to f16; the
    // GPU does neither, so logits differ by a few tenths at most.
    assert!(agree * 100 >= total * 90, "top-1 {agree}/{total}");
    assert!(max_d < 1.5, "max |Δ logit| {max_d}");

    // Six launches a layer in a prefill step, five in a decode step (the
    // attention rotates and stores K/V itself).
    assert_launches(&mut *gpu, engine.model.config.n_layers, 6, 5, 0);

    // Copy-on-write goes to the device pool: the same K/V through a copy.
    gpu.copy_block(9, 15);
    let s = |table: &'static [u32], tok: &'static [u32]| PagedSeq {
        tokens: tok,
        past: 20,
        table,
        decode_from: 0,
    };
    let x = gpu.forward_paged(&[s(&[3, 9], &[42])]).unwrap();
    let y = gpu.forward_paged(&[s(&[3, 15], &[42])]).unwrap();
    assert_eq!(x, y);
    // A bad table or token is a typed error, not a device fault.
    assert!(gpu.forward_paged(&[s(&[3, 99], &[42])]).is_err());
    assert!(gpu.forward_paged(&[s(&[3, 9], &[4_000_000])]).is_err());
}

/// The GPU decoder behind the batch scheduler (`BatchEngine::start_on`):
/// the same scheduler, prefix cache and sampler as the CPU's, so a greedy
/// request starts with the CPU's tokens.
#[test]
fn the_batch_scheduler_serves_from_the_gpu_decoder() {
    use gcs_engine::backend::ComputeDevice;
    use gcs_engine::sampling::SamplingOptions;
    use gcs_engine::{BatchConfig, BatchEngine, Prompt, SeqEvent, SeqRequest};
    let Some(path) = common::smollm_path() else { return };
    let submit_with = |engine: &BatchEngine, ids: &[u32], sampling: SamplingOptions| {
        let mut r = SeqRequest::new(Prompt::Tokens(ids.to_vec()), 6);
        r.ignore_eos = true;
        r.sampling = sampling;
        engine.submit(r).unwrap()
    };
    let at = |temperature| SamplingOptions { temperature, seed: 5, ..SamplingOptions::default() };
    let submit = |engine: &BatchEngine, ids: &[u32], t: f32| submit_with(engine, ids, at(t));
    let collect = |s: gcs_engine::SeqStream| {
        let mut toks = vec![];
        loop {
            match s.recv().unwrap() {
                SeqEvent::Delta { token_ids, .. } => toks.extend(token_ids),
                SeqEvent::Done(d) => break (toks, d),
                SeqEvent::Error(e) => panic!("{e}"),
            }
        }
    };
    let greedy = |engine: &BatchEngine, ids: &[u32]| collect(submit(engine, ids, 0.0));
    let cfg = BatchConfig { max_running: 2, kv_blocks: 32, ..BatchConfig::default() };
    let e = Engine::load(&path, &cpu_device()).unwrap();
    let ids = e.prompt_tokens(&[ChatMessage::new("user", "What is 2 + 2?")]).unwrap();
    let gpu = BatchEngine::start_on(e, cfg.clone(), ComputeDevice::Wgpu(0)).unwrap();
    let cpu = BatchEngine::start(Engine::load(&path, &cpu_device()).unwrap(), cfg);
    let (g, gd) = greedy(&gpu, &ids);
    let (c, _) = greedy(&cpu, &ids);
    eprintln!("GPU {g:?}\nCPU {c:?}");
    assert_eq!(g.len(), 6, "{gd:?}");
    assert_eq!(g[..2], c[..2], "the first greedy tokens agree");
    // The second identical prompt reuses the first's cached blocks on the
    // device, and decodes the same tokens from them.
    let (again, ad) = greedy(&gpu, &ids);
    assert!(ad.cached_tokens > 0, "{ad:?}");
    assert_eq!(again, g);
    // Sampled at temperature 1 (each token drawn on the device, at the
    // uniforms of the request's seed): the same tokens alone and beside a
    // greedy stream.
    let (alone, _) = collect(submit(&gpu, &ids, 1.0));
    let (beside, other) = (submit(&gpu, &ids, 1.0), submit(&gpu, &ids, 0.0));
    let ((beside, _), (other, _)) = (collect(beside), collect(other));
    let (cpu_drawn, _) = collect(submit(&cpu, &ids, 1.0));
    eprintln!("GPU drew {alone:?}\nCPU drew {cpu_drawn:?}");
    assert_eq!(alone.len(), 6);
    assert_eq!(beside, alone, "a draw does not depend on the batch");
    assert_eq!(other, g, "nor does the greedy stream beside it");
    // Top-p draws finished from the device's candidates (the hot, wide
    // nucleus from rows read after their step): the same alone and
    // beside a greedy stream.
    for o in
        [SamplingOptions { top_p: 0.9, ..at(1.0) }, SamplingOptions { top_p: 0.999, ..at(2.0) }]
    {
        let (alone, _) = collect(submit_with(&gpu, &ids, o.clone()));
        let (beside, other) = (submit_with(&gpu, &ids, o.clone()), submit(&gpu, &ids, 0.0));
        let ((beside, _), (other, _)) = (collect(beside), collect(other));
        eprintln!("GPU drew {alone:?} at top-p {} (t {})", o.top_p, o.temperature);
        assert_eq!(alone.len(), 6);
        assert_eq!(beside, alone, "top-p {}: a draw does not depend on the batch", o.top_p);
        assert_eq!(other, g, "top-p {}: nor does the greedy stream beside it", o.top_p);
    }
    // The hot nucleus lay past the candidates at some step: that row was
    // read after its step.
    assert!(gpu.rows_read_after_step() > 0);
    // A bias (the CPU's first greedy token banned) and penalties, added
    // on the device before its argmax: the CPU's tokens (which adds them
    // on the host), alone and beside a plain greedy stream.
    let adjusted = SamplingOptions {
        logit_bias: vec![(c[0], -100.0)],
        frequency_penalty: 0.5,
        presence_penalty: 0.4,
        ..at(0.0)
    };
    let (alone, _) = collect(submit_with(&gpu, &ids, adjusted.clone()));
    let (beside, other) = (submit_with(&gpu, &ids, adjusted.clone()), submit(&gpu, &ids, 0.0));
    let ((beside, _), (other, _)) = (collect(beside), collect(other));
    let (cpu_adjusted, _) = collect(submit_with(&cpu, &ids, adjusted));
    eprintln!("GPU adjusted {alone:?}\nCPU adjusted {cpu_adjusted:?}");
    assert_eq!(alone[..2], cpu_adjusted[..2], "the first adjusted greedy tokens agree");
    assert!(alone[0] != c[0] && beside == alone && other == g);
    // A JSON object under its grammar, masked on the device before its
    // argmax: the CPU's first tokens, every one allowed there (the CPU
    // masks on the host).
    let json = |engine: &BatchEngine| {
        let ask = vec![ChatMessage::new("user", "Describe a cat as a JSON object.")];
        let mut r = SeqRequest::new(Prompt::Chat(ask), 8);
        r.grammar = Some(gcs_engine::Grammar::JsonObject);
        collect(engine.submit(r).unwrap()).0
    };
    let (gj, cj) = (json(&gpu), json(&cpu));
    eprintln!("GPU JSON {gj:?}\nCPU JSON {cj:?}");
    assert!(gj.len() >= 2 && gj[..2] == cj[..2], "the first masked greedy tokens agree");
    // Greedy with logprobs (from the device's candidates): the greedy
    // tokens, each the best of its alternatives.
    let mut r = SeqRequest::new(Prompt::Tokens(ids.to_vec()), 6);
    (r.ignore_eos, r.logprobs) = (true, Some(2));
    let (toks, lps) = common::tokens_and_logprobs(gpu.submit(r).unwrap());
    assert_eq!(toks, g, "greedy with logprobs");
    assert_eq!(lps.len(), 6);
    for (lp, &t) in lps.iter().zip(&toks) {
        assert_eq!((lp.chosen.token, lp.top.len(), lp.top[0].token), (t, 2, t), "{lp:?}");
        assert!(lp.chosen.logprob <= 0.0 && lp.top[1].logprob <= lp.chosen.logprob, "{lp:?}");
    }
    assert!(gpu.measure_decode(4).unwrap() > 0.0);
}

/// A K-quant file (Gemma 3 270M Q4_K_M) is refused before upload, with
/// the first tensor and type the kernels lack named (its embedding is
/// requantized to Q8_0 at load, so that is `blk.0.attn_qkv`'s Q5_0).
/// Gemma 3 270M (gemma3: Q5_0, Q8_0, Q4_K and Q6_K weights, per-head Q/K
/// norms, NEOX RoPE, post-norms, GeGLU, sliding-window layers with their
/// own RoPE base) on the GPU decoder against the CPU decoder: two short
/// prompts batched, then one prompt past the 512-key window, so the local
/// layers' queries drop their first keys; teacher-forced top-1 and max
/// |Δ logit|. The exact arithmetic is refused for it, by name.
#[test]
fn gemma_on_the_gpu_decoder_agrees_with_the_cpu_decoder() {
    use gcs_engine::backend::gpu::GpuError;
    let Some(path) = common::gemma_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let gc = engine.model.config.gemma3.clone().unwrap();
    assert_eq!(gc.sliding_window, 512);
    let blocks = 40;
    let client = cubecl::Device::Wgpu(Default::default()).client();
    let gpu = GpuDecoder::new(client, BackendKind::Wgpu, &engine.model, blocks).unwrap();
    let err = match GpuDecoder::new(
        cubecl::Device::Wgpu(Default::default()).client(),
        BackendKind::Wgpu,
        &engine.model,
        4,
    )
    .unwrap()
    .with_exact(true)
    {
        Err(e) => e,
        Ok(_) => panic!("exact arithmetic for gemma3 was accepted"),
    };
    assert!(matches!(&err, GpuError::Unsupported(m) if m.contains("gemma3")), "{err}");
    // A pool past wgpu's binding limit (909 blocks for Gemma) is refused
    // before any upload, naming the limit.
    let client = cubecl::Device::Wgpu(Default::default()).client();
    match GpuDecoder::new(client, BackendKind::Wgpu, &engine.model, 910) {
        Err(GpuError::Unsupported(m)) => assert!(m.contains("at most 909"), "{m}"),
        other => panic!("910 blocks on wgpu: {:?}", other.map(|_| ())),
    }
    let mut gpu: Box<dyn PagedDecoder> = Box::new(gpu.with_exact(false).unwrap());
    let model = Engine::load(&path, &cpu_device()).unwrap().model;
    let mut cpu: Box<dyn PagedDecoder> = Box::new(CpuDecoder::new(model, blocks));
    let (agree, total, max_d, _) = compare(&engine, &mut *gpu, &mut *cpu);
    eprintln!("gemma3 GPU (lavapipe) vs CPU: top-1 {agree}/{total}, max |Δ logit| {max_d:.3}");
    assert!(agree * 100 >= total * 90, "top-1 {agree}/{total}");
    assert!(max_d < 2.5, "max |Δ logit| {max_d}");

    // Past the window: 530 prompt tokens and 4 teacher-forced steps.
    let text = "The quick brown fox jumps over the lazy dog while counting to ten. ".repeat(40);
    let mut toks = engine.prompt_tokens(&[ChatMessage::new("user", &text)]).unwrap();
    toks.truncate(530);
    let table: Vec<u32> = (0..36).rev().collect();
    let (mut feed, mut past) = (toks.clone(), 0);
    let (mut agree, mut max_d) = (0, 0f32);
    for _ in 0..5 {
        let seq = [PagedSeq { tokens: &feed, past, table: &table, decode_from: toks.len() }];
        let (a, b) = (cpu.forward_paged(&seq).unwrap(), gpu.forward_paged(&seq).unwrap());
        max_d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(max_d, f32::max);
        let mean = a.iter().zip(&b).map(|(x, y)| (x - y).abs() as f64).sum::<f64>();
        let t = argmax(&a) as usize;
        eprintln!(
            "mean |Δ logit| {:.3}; best logit {} against {}",
            mean / a.len() as f64,
            a[t],
            b[t]
        );
        agree += usize::from(argmax(&a) == argmax(&b));
        past += feed.len();
        feed = vec![argmax(&a)];
    }
    eprintln!("gemma3 past the window: top-1 {agree}/5, max |Δ logit| {max_d:.3}");
    assert!(agree >= 4, "top-1 {agree}/5");
    assert!(max_d < 2.0, "max |Δ logit| {max_d}");

    // A prefill layer: 9 launches (the head norms and the two post-norms
    // beside llama's 6); a decode layer 8. More: the 189 MB embedding table
    // (the LM head too) is 3 parts on wgpu, 2 launches more each, and half
    // the layers' Q/K/V are two parts (V in Q8_0 after Q and K in Q5_0).
    assert_launches(&mut *gpu, engine.model.config.n_layers, 9, 8, 2 * 2 + 9);
}

/// Gemma behind the batch scheduler on the GPU decoder (device picks over
/// its 262,144-token vocabulary): a greedy chat answer starts with the CPU
/// engine's tokens.
#[test]
fn gemma_through_the_scheduler_answers_as_the_cpu() {
    use gcs_engine::backend::ComputeDevice;
    use gcs_engine::{BatchConfig, BatchEngine, Prompt, SeqEvent, SeqRequest};
    let Some(path) = common::gemma_path() else { return };
    let greedy = |engine: &BatchEngine, ids: &[u32]| {
        let mut r = SeqRequest::new(Prompt::Tokens(ids.to_vec()), 6);
        r.ignore_eos = true;
        let s = engine.submit(r).unwrap();
        let mut toks = vec![];
        loop {
            match s.recv().unwrap() {
                SeqEvent::Delta { token_ids, .. } => toks.extend(token_ids),
                SeqEvent::Done(_) => break toks,
                SeqEvent::Error(e) => panic!("{e}"),
            }
        }
    };
    let cfg = BatchConfig { max_running: 2, kv_blocks: 32, ..BatchConfig::default() };
    let e = Engine::load(&path, &cpu_device()).unwrap();
    let ids = e.prompt_tokens(&[ChatMessage::new("user", "Name a colour.")]).unwrap();
    let text = |t: &[u32]| e.tokenizer.decode(t);
    let cpu = BatchEngine::start(Engine::load(&path, &cpu_device()).unwrap(), cfg.clone());
    let c = greedy(&cpu, &ids);
    let gpu = BatchEngine::start_on(
        Engine::load(&path, &cpu_device()).unwrap(),
        cfg,
        ComputeDevice::Wgpu(0),
    )
    .unwrap();
    let g = greedy(&gpu, &ids);
    eprintln!("GPU {g:?} {:?}\nCPU {c:?} {:?}", text(&g), text(&c));
    assert_eq!(g[..2], c[..2], "the first greedy tokens agree");
}

/// Decode steps replayed from a recorded graph (`backend::gpu::graph`:
/// three sequences in a bucket of four, one padding row on the scratch
/// block) give the eager decoder's logits bit for bit, step after step;
/// the device's picks are the host's argmax of those logits, or its
/// temperature draw at the same uniform (`draw_temperature`) for the row
/// that draws; only the rows that ask for their logits get them back, and
/// a step that wants none copies none.
#[test]
fn decode_graphs_replay_the_eager_steps_exactly() {
    let Some(path) = common::smollm_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let decoder = |graphs: bool| {
        let client = cubecl::Device::Wgpu(Default::default()).client();
        GpuDecoder::new(client, BackendKind::Wgpu, &engine.model, 16).unwrap().with_graphs(graphs)
    };
    let (mut graphed, mut eager) = (decoder(true), decoder(false));
    let none = Adjust::default();
    let prompts = ["Name three colours of the rainbow.", "What is 2 + 2?", "Say hello."];
    let toks: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| engine.prompt_tokens(&[ChatMessage::new("user", *p)]).unwrap())
        .collect();
    let tables: [Vec<u32>; 3] = [vec![3, 9, 1, 12], vec![0, 14, 5, 7], vec![2, 4, 6, 8]];
    let vocab = eager.vocab();
    let mut feed = toks.clone();
    let mut past = [0usize; 3];
    for step in 0..5 {
        let seqs: Vec<PagedSeq<'_>> = (0..3)
            .map(|i| PagedSeq {
                tokens: &feed[i],
                past: past[i],
                table: &tables[i],
                decode_from: toks[i].len(),
            })
            .collect();
        let (temperature, u) = (0.8, [0.1, 0.9, 0.45, 0.6, 0.3][step]);
        let draw = Pick::Draw { temperature, u };
        // The rows asking for logits: the first, the last, or both (one
        // range from the buffer's start, one to a row before its end, two).
        let (first, last) = [(Pick::Logits, Pick::Argmax), (Pick::Argmax, Pick::Logits)]
            .get(step % 3)
            .copied()
            .unwrap_or((Pick::Logits, Pick::Logits));
        let picks = [first, draw, last];
        let asked: Vec<usize> = [0, 2].into_iter().filter(|&i| picks[i] == Pick::Logits).collect();
        // Every row's logits first (the step again writes the same K/V).
        let all = eager.forward_select(&seqs, &[Pick::Logits; 3], &none).unwrap();
        assert_eq!((all.logits.len(), &all.rows), (3 * vocab, &None));
        let replayed = graphed.forward_select(&seqs, &[Pick::Logits; 3], &none).unwrap();
        assert_eq!(all.logits, replayed.logits, "step {step}");
        let a = eager.forward_select(&seqs, &picks, &none).unwrap();
        let b = graphed.forward_select(&seqs, &picks, &none).unwrap();
        // Only the rows that asked for their logits come back.
        let row = |i: usize| all.row(i, vocab).unwrap();
        assert_eq!(a.rows.as_ref(), Some(&asked), "step {step}");
        for i in 0..3 {
            let want = asked.contains(&i).then(|| row(i));
            assert_eq!(a.row(i, vocab), want, "step {step}, row {i}");
        }
        assert_eq!((&a.logits, &a.rows), (&b.logits, &b.rows), "step {step}");
        let host = vec![argmax(row(0)), draw_temperature(row(1), temperature, u), argmax(row(2))];
        assert_eq!(a.picked.as_deref(), Some(&host[..]), "step {step}");
        assert_eq!(b.picked.as_deref(), Some(&host[..]), "step {step}");
        for i in 0..3 {
            past[i] += feed[i].len();
        }
        feed = host.iter().map(|&t| vec![t]).collect();
    }
    assert_eq!(graphed.recorded_buckets(), vec![4], "one bucket of 4 recorded and replayed");
    assert!(eager.recorded_buckets().is_empty());
    // Greedy and drawing rows only: their tokens come back, the logits do not.
    let seqs: Vec<PagedSeq<'_>> = (0..3)
        .map(|i| PagedSeq { tokens: &feed[i], past: past[i], table: &tables[i], decode_from: 0 })
        .collect();
    let draw = Pick::Draw { temperature: 1.0, u: 0.5 };
    let c = graphed.forward_select(&seqs, &[Pick::Argmax, draw, Pick::Argmax], &none).unwrap();
    assert!(c.logits.is_empty() && c.tops.is_empty());
    assert_eq!(c.picked.map(|a| a.len()), Some(3));
    // A top-p row and a drawing row with logprobs beside them: their
    // candidates come back instead of their logits (those of the host's
    // `top_candidates`), the draw as before, and their logits can still
    // be read after the step, eager or replayed.
    let all = eager.forward_select(&seqs, &[Pick::Logits; 3], &none).unwrap();
    let (top_p, scored) =
        (Pick::Top { temperature: 0.9, u: -1.0 }, Pick::Top { temperature: 1.0, u: 0.5 });
    for (what, dec) in [("eager", &mut eager), ("replayed", &mut graphed)] {
        let d = dec.forward_select(&seqs, &[Pick::Argmax, top_p, scored], &none).unwrap();
        assert!(d.logits.is_empty() && d.tops.len() == 2, "{what}");
        for (i, t) in [(1, 0.9), (2, 1.0)] {
            let row = all.row(i, vocab).unwrap();
            let got = d.top(i).unwrap_or_else(|| panic!("{what}: no candidates"));
            assert_eq!(got.cand, top_candidates(row, t).cand, "{what} row {i}");
            assert!(common::gpu::mass_is_exact(got.mass, row, t), "{what}: {}", got.mass);
            let unit = got.unit_mass as f32;
            assert!(common::gpu::mass_is_exact(unit, row, 1.0), "{what}: {unit}");
        }
        let drawn = draw_temperature(all.row(2, vocab).unwrap(), 1.0, 0.5);
        assert_eq!(d.picked.as_ref().map(|p| p[2]), Some(drawn), "{what}");
        let read = dec.last_logits(&[1, 2]).unwrap();
        assert_eq!(read, all.logits[vocab..].to_vec(), "{what}: rows read after the step");
    }
    // A bias and penalties added on the device before it picks: row 0's
    // argmax banned and another id pushed past it (two additions on one
    // id, in order), a draw's and a top-p row's own additions. The picks
    // and candidates are those of the rows plus the additions on the
    // host, bit for bit, and a top-p row read after the step is the
    // adjusted row; a row whose logits come back gets none.
    let best = argmax(all.row(0, vocab).unwrap());
    let adds: [&[(u32, f32)]; 3] = [
        &[(best, -100.0), (77, 60.0), (77, -0.3125), (900, -1.0)],
        &[(5, 12.5), (best, -3.0)],
        &[(40, 9.0), (41, -(0.4 * 3.0 + 0.25))],
    ];
    let adjust = Adjust::new(adds);
    let host_row = |i: usize| {
        let mut l = all.row(i, vocab).unwrap().to_vec();
        adds[i].iter().for_each(|&(id, a)| l[id as usize] += a);
        l
    };
    let draw = Pick::Draw { temperature: 0.7, u: 0.6 };
    for (what, dec) in [("eager", &mut eager), ("replayed", &mut graphed)] {
        let d = dec.forward_select(&seqs, &[Pick::Argmax, draw, top_p], &adjust).unwrap();
        assert!(d.adjusted && d.logits.is_empty(), "{what}");
        let want = [argmax(&host_row(0)), draw_temperature(&host_row(1), 0.7, 0.6)];
        assert_eq!(want[0], 77, "the bias decides it");
        assert_eq!(d.picked.as_ref().map(|p| &p[..2]), Some(&want[..]), "{what}");
        let got = d.top(2).unwrap_or_else(|| panic!("{what}: no candidates"));
        assert_eq!(got.cand, top_candidates(&host_row(2), 0.9).cand, "{what}");
        let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(dec.last_logits(&[2]).unwrap()), bits(host_row(2)), "{what}");
        let raw = dec.forward_select(&seqs, &[Pick::Logits, draw, top_p], &adjust).unwrap();
        assert_eq!(raw.row(0, vocab), all.row(0, vocab), "{what}: row 0 comes back raw");
    }
    // Grammar masks with them: row 0 may take tokens 5, 300 and 1000 only
    // (its additions to 77 and the banned argmax stay −inf), row 2 the even
    // ids (its top-p candidates among them); row 1 unmasked. Picks,
    // candidates and the rows read after the step are the host's: masked,
    // then added to.
    let allow = |ids: &mut dyn Iterator<Item = u32>| {
        let mut w = vec![0u32; vocab.div_ceil(32)];
        ids.for_each(|t| w[t as usize / 32] |= 1 << (t % 32));
        w
    };
    let (m0, m2) =
        (allow(&mut [5, 300, 1000].into_iter()), allow(&mut (0..vocab as u32).step_by(2)));
    let masks = [Some(&m0[..]), None, Some(&m2[..])];
    let masked = Adjust::new(adds).with_masks(masks);
    let host_masked = |i: usize| {
        let mut l = all.row(i, vocab).unwrap().to_vec();
        if let Some(m) = masks[i] {
            for (t, x) in l.iter_mut().enumerate() {
                if !gcs_engine::constraint::word_allows(m, t as u32) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        adds[i].iter().for_each(|&(id, a)| l[id as usize] += a);
        l
    };
    for (what, dec) in [("eager", &mut eager), ("replayed", &mut graphed)] {
        let d = dec.forward_select(&seqs, &[Pick::Argmax, draw, top_p], &masked).unwrap();
        let want = [argmax(&host_masked(0)), draw_temperature(&host_masked(1), 0.7, 0.6)];
        assert!([5, 300, 1000].contains(&want[0]), "{what}: {}", want[0]);
        assert_eq!(d.picked.as_ref().map(|p| &p[..2]), Some(&want[..]), "{what}");
        let got = d.top(2).unwrap_or_else(|| panic!("{what}: no candidates"));
        assert_eq!(got.cand, top_candidates(&host_masked(2), 0.9).cand, "{what}");
        assert!(got.cand.iter().all(|c| c.0 % 2 == 0), "{what}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        let read = dec.last_logits(&[0, 2]).unwrap();
        assert_eq!(bits(&read[..vocab]), bits(&host_masked(0)), "{what}: row 0 read after");
        assert_eq!(bits(&read[vocab..]), bits(&host_masked(2)), "{what}: row 2 read after");
    }
    // Logprobs beside them (`Pick::Scored`: greedy, a draw, a cut draw):
    // the picks and the cut draw's candidates as above, of the adjusted
    // rows; each row's candidates before its additions (after its mask)
    // with the logits there of every token its additions touch and of
    // its picked token, bit for bit.
    let before = |i: usize| {
        let mut l = all.row(i, vocab).unwrap().to_vec();
        if let Some(m) = masks[i] {
            for (t, x) in l.iter_mut().enumerate() {
                if !gcs_engine::constraint::word_allows(m, t as u32) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        l
    };
    let scored = |temperature, u| Pick::Scored { temperature, u };
    let picks = [scored(0.0, 0.0), scored(0.7, 0.6), scored(0.9, -1.0)];
    for (what, dec) in [("eager", &mut eager), ("replayed", &mut graphed)] {
        let d = dec.forward_select(&seqs, &picks, &masked).unwrap();
        assert!(d.logits.is_empty() && d.scored.len() == 3, "{what}");
        let want = [argmax(&host_masked(0)), draw_temperature(&host_masked(1), 0.7, 0.6)];
        let picked = d.picked.clone().unwrap();
        assert_eq!(&picked[..2], &want[..], "{what}");
        assert!(d.top(0).is_none() && d.top(1).is_none(), "{what}: only the cut draw's");
        let got = d.top(2).unwrap_or_else(|| panic!("{what}: no candidates"));
        assert_eq!(got.cand, top_candidates(&host_masked(2), 0.9).cand, "{what}");
        for (i, adds) in adds.iter().enumerate() {
            let (c, raw) = (d.scored(i).unwrap(), before(i));
            assert_eq!(c.cand, top_candidates(&raw, 0.0).cand, "{what} row {i}");
            // Not vacuous: rows 1 and 2 have additions their masks allow.
            let after = top_candidates(&host_masked(i), 0.0).cand;
            assert!(i == 0 || c.cand != after, "{what} row {i}");
            let unit = c.unit_mass as f32;
            assert!(common::gpu::mass_is_exact(unit, &raw, 1.0), "{what} row {i}: {unit}");
            let logit = |id: u32| c.logit(id).map(f32::to_bits);
            for id in adds.iter().map(|a| a.0).chain([picked[i]]) {
                assert_eq!(logit(id), Some(raw[id as usize].to_bits()), "{what} row {i}: {id}");
            }
        }
    }
    // An addition past the vocabulary is refused before the step.
    let past: [&[(u32, f32)]; 1] = [&[(vocab as u32, 1.0)]];
    let err = eager.forward_select(&seqs[..1], &[Pick::Argmax], &Adjust::new(past)).unwrap_err();
    assert!(err.to_string().contains(&vocab.to_string()), "{err}");
}

/// The device check's step anatomy (`GpuDecoder::anatomy`) runs every part
/// it names — each kernel, each matmul kernel, the q8 arithmetic, the step
/// eager and as a replayed graph — and times each as a positive, finite
/// figure (on a GPU it says where a step's time goes); it counts a step's
/// launches, five a layer.
#[test]
fn the_step_anatomy_times_every_part() {
    let Some(path) = common::smollm_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let client = cubecl::Device::Wgpu(Default::default()).client();
    let dec = GpuDecoder::new(client, BackendKind::Wgpu, &engine.model, 4).unwrap();
    let anatomy = dec.anatomy(3, 40, 1).unwrap();
    // Embedding; a layer's QKV, attention (rotating and storing K/V: a
    // decode step), O, gate/up and down (Q, K, V one launch, gate and up
    // one; the norms read inside QKV and gate/up, SwiGLU inside down, O
    // and down adding to the residual); the output norm, the LM head, the
    // bias and penalty additions (a decode bucket's step always launches
    // them) and the pick.
    let layers = engine.model.config.n_layers;
    assert_eq!(anatomy.launches, 1 + 5 * layers + 4, "launches a step");
    let parts = anatomy.parts;
    let names: Vec<&str> = parts.iter().map(|p| p.part.as_str()).collect();
    for want in [
        "step, eager",
        "attention KvHead",
        "lm_head Tiled",
        "pick (temperature draw)",
        "adjust (300 a row)",
        "adjust (300 a row, scored)",
        "gate_up q8",
        "step, graph replay",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    for p in &parts {
        assert!(p.us.is_finite() && p.us > 0.0 && p.enqueue_us <= p.us, "{p:?}");
    }
}
