//! The compute-backend boundary: the CPU decoder behind `PagedDecoder` is
//! the host path bit for bit, and a GPU device is refused with a typed
//! error on a build or machine that cannot use it (needs the model; skips
//! otherwise). The GPU decoder itself: `tests/gpu_decoder.rs` (wgpu).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use gcs_engine::backend::{
    paged_decoder, BackendError, BackendKind, ComputeDevice, CpuDecoder, PagedDecoder,
};
use gcs_engine::llama::PagedSeq;
use gcs_engine::sampling::argmax;
use gcs_engine::{cpu_device, ChatMessage, Engine};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn cpu_decoder_is_the_host_path_bit_for_bit() {
    let Some(path) = common::smollm_path() else { return };
    let direct = Engine::load(&path, &cpu_device()).unwrap();
    let boxed = Engine::load(&path, &cpu_device()).unwrap();
    let prompt = direct
        .prompt_tokens(&[ChatMessage::new("user", "Name three colours of the rainbow.")])
        .unwrap();
    let p = prompt.len();
    let table: Vec<u32> = (0..16).collect();
    let mut pool = direct.model.new_kv_pool(16);
    let mut dec: Box<dyn PagedDecoder> =
        paged_decoder(ComputeDevice::Cpu, boxed.model, 16, Default::default())
            .expect("CPU always works");
    assert_eq!(dec.kind(), BackendKind::Cpu);
    assert_eq!(dec.kv_blocks(), 16);
    assert_eq!(dec.kv_bytes_per_token(), pool.bytes_per_token());
    assert_eq!(dec.vocab(), direct.model.lm_head.rows);
    assert_eq!(dec.config(), &direct.model.config);

    let run_direct = |pool: &mut _, tokens: &[u32], past: usize| {
        let s = PagedSeq { tokens, past, table: &table, decode_from: p };
        direct.model.forward_paged(pool, &[s]).unwrap()
    };
    let mut a = run_direct(&mut pool, &prompt, 0);
    let mut b = dec
        .forward_paged(&[PagedSeq { tokens: &prompt, past: 0, table: &table, decode_from: p }])
        .unwrap();
    assert_eq!(bits(&a), bits(&b), "prefill logits");
    for k in 0..12 {
        let t = argmax(&a);
        a = run_direct(&mut pool, &[t], p + k);
        b = dec
            .forward_paged(&[PagedSeq { tokens: &[t], past: p + k, table: &table, decode_from: p }])
            .unwrap();
        assert_eq!(bits(&a), bits(&b), "decode step {k}");
    }

    // Copy-on-write goes to the backend's storage: a sequence reading a
    // copied block sees the same K/V as one reading the original.
    let len = p + 12;
    let last = len / gcs_engine::paged::BLOCK_SIZE; // the block the next row goes to
    let (src, dst) = (table[last], 15u32);
    assert!(last < 15, "prompt too long for this test's table");
    dec.copy_block(src, dst);
    pool.copy_block(src, dst);
    let mut moved = table.clone();
    moved[last] = dst;
    let t = argmax(&a);
    let x = direct
        .model
        .forward_paged(
            &mut pool,
            &[PagedSeq { tokens: &[t], past: len, table: &moved, decode_from: p }],
        )
        .unwrap();
    let y = dec
        .forward_paged(&[PagedSeq { tokens: &[t], past: len, table: &moved, decode_from: p }])
        .unwrap();
    assert_eq!(bits(&x), bits(&y), "after copy_block");
    let z = dec
        .forward_paged(&[PagedSeq { tokens: &[t], past: len, table: &table, decode_from: p }])
        .unwrap();
    assert_eq!(bits(&x), bits(&z), "the copy holds the original block's K/V");
}

#[test]
fn a_gpu_device_is_refused_with_a_typed_error_here() {
    let Some(path) = common::smollm_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    match paged_decoder(ComputeDevice::Cuda(0), engine.model, 4, Default::default()) {
        // A cuda build on a machine with a GPU serves on it.
        Ok(dec) => assert!(cfg!(feature = "cuda") && dec.kind() == BackendKind::Cuda),
        Err(err) if cfg!(feature = "cuda") => {
            assert!(!matches!(err, BackendError::NoCudaSupport { .. }), "{err}")
        }
        Err(err) => assert!(matches!(err, BackendError::NoCudaSupport { index: 0 }), "{err:?}"),
    }
    // CpuDecoder is also constructible directly.
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let dec = CpuDecoder::new(engine.model, 2);
    assert_eq!(dec.kv_blocks(), 2);
}

/// The device check (`gcs-node gpu-check`) on the CPU against itself: the
/// same decoder twice agrees exactly, and its speed figures are real.
#[test]
fn the_device_check_of_the_cpu_against_itself_agrees_exactly() {
    use gcs_engine::devcheck::{run, CheckConfig};
    let Some(path) = common::smollm_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let prompts: Vec<Vec<u32>> = ["What is 2 + 2?", "Name a colour."]
        .iter()
        .map(|p| engine.prompt_tokens(&[ChatMessage::new("user", *p)]).unwrap())
        .collect();
    let cfg = CheckConfig {
        model: path,
        device: ComputeDevice::Cpu,
        prompts,
        greedy_tokens: 4,
        logit_prompts: 1,
        batches: vec![1, 3],
        decode_tokens: 6,
        prefill_tokens: 40,
        naive_steps: 0,
        embed_dir: common::minilm_dir(),
        embed_batches: vec![1, 4],
    };
    let r = run(&cfg).unwrap();
    assert_eq!((r.parity.greedy_identical, r.parity.prompts), (2, 2), "{r:?}");
    assert_eq!((r.parity.top1_agree, r.parity.top1_total), (8, 8), "{r:?}");
    assert!(r.parity.logits_bit_equal, "{r:?}");
    assert_eq!(r.parity.max_abs_logit_delta, 0.0, "{r:?}");
    assert_eq!(r.backend, "burn-flex");
    assert_eq!(r.decode.iter().map(|d| d.batch).collect::<Vec<_>>(), [1, 3]);
    for d in &r.decode {
        // Every stream's tokens after the first are counted once steady.
        assert!(d.tokens > 0 && d.tokens <= d.batch * 6, "{d:?}");
        assert!(d.tokens_per_s > 0.0, "{d:?}");
        // Every stream decodes the first prompt greedily: all agree, and
        // with the CPU decoder's own continuation of it.
        assert_eq!((d.streams_equal, d.streams_match_cpu), (d.batch, d.batch), "{d:?}");
    }
    // Sampled at temperature 1 with one seed: every stream of a batch
    // draws the same tokens, those of the CPU engine's own stream.
    assert_eq!(r.decode_sampled.iter().map(|d| d.batch).collect::<Vec<_>>(), [1, 3]);
    // And with a nucleus (top-p 0.9), and with penalties and a bias, the same.
    assert_eq!(r.decode_nucleus.iter().map(|d| d.batch).collect::<Vec<_>>(), [1, 3]);
    assert_eq!(r.decode_penalized.iter().map(|d| d.batch).collect::<Vec<_>>(), [1, 3]);
    // And with those and logprobs: the same tokens and logprobs.
    assert_eq!(r.decode_logprobs.iter().map(|d| d.batch).collect::<Vec<_>>(), [1, 3]);
    let sampled = r.decode_sampled.iter().chain(&r.decode_nucleus).chain(&r.decode_penalized);
    for d in sampled.clone().chain(&r.decode_logprobs) {
        assert!(d.tokens > 0 && d.tokens_per_s > 0.0, "{d:?}");
        // The CPU returns every row's logits: none is read after its step.
        assert_eq!(d.rows_read_after, 0, "{d:?}");
        assert_eq!((d.streams_equal, d.streams_match_cpu), (d.batch, d.batch), "{d:?}");
    }
    for d in r.decode.iter().chain(sampled) {
        assert_eq!(d.logprobs, None, "no logprobs asked for: {d:?}");
    }
    for d in &r.decode_logprobs {
        // Every stream's first 4 tokens (the CPU stream's length) compared.
        let l = d.logprobs.as_ref().expect("logprobs compared");
        assert_eq!((l.tokens, l.top_ids_equal), (4 * d.batch, 4 * d.batch), "{d:?}");
        assert!(l.bit_equal && l.max_abs_delta == 0.0, "{d:?}");
    }
    // Graphs are a GPU decoder's; the CPU has no eager twin to measure.
    assert!(!r.graphs && r.decode_eager.is_empty(), "{r:?}");
    assert!(r.naive.is_empty(), "no naive loop asked for");
    if let Some(e) = &r.embed {
        // The embedder against itself on the CPU: the same vectors.
        assert_eq!(e.backend, "burn-flex");
        assert!(e.min_cosine > 0.9999, "{e:?}");
        assert_eq!(e.device.iter().map(|x| x.batch).collect::<Vec<_>>(), [1, 4]);
        assert!(e.device.iter().chain(&e.cpu).all(|x| x.texts_per_s > 0.0), "{e:?}");
    }
    assert_eq!(r.prefill_tokens, 40);
    assert!(r.ttft_ms > 0.0 && r.prefill_tokens_per_s > 0.0 && r.cpu_decode_tokens_per_s > 0.0);
}
