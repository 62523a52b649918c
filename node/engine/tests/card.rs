//! What a worker serving a file by path reads from it (`ModelCard`), the
//! operator's context cap (`Engine::load_capped`), the KV cost one position
//! has (the worker shares its KV budget by it) and the start-up decode
//! measurement registrations advertise, on both packaged chat models.

mod common;

use gcs_engine::{cpu_device, BatchConfig, BatchEngine, Engine, Prompt, SeqRequest};

#[test]
fn the_packaged_files_describe_themselves() {
    let (Some(smol), Some(gemma)) = (common::smollm_path(), common::gemma_path()) else { return };
    let dev = cpu_device();
    let s = Engine::load(&smol, &dev).unwrap();
    assert_eq!(s.card.arch, "llama");
    assert_eq!(s.card.quantization, "q4_1");
    assert_eq!((s.card.context_tokens, s.card.vocab), (8192, 49_152));
    assert!(s.card.chat, "SmolLM2 has a chat template");
    assert_eq!(s.card.name.as_deref(), Some("Smollm2 135M 8k Lc100K Mix1 Ep2"));
    assert_eq!(s.model.config.kv_bytes_per_token(), 2 * 2 * 30 * 3 * 64);

    let g = Engine::load_capped(&gemma, &dev, Some(512)).unwrap();
    assert_eq!(g.card.name.as_deref(), Some("Gemma 3 270m"));
    assert_eq!((g.card.arch.as_str(), g.card.quantization.as_str()), ("gemma3", "q4_k_m"));
    assert!(g.card.chat, "gemma3 has the built-in turn template");
    assert_eq!(g.card.context_tokens, 512, "--ctx caps the file's 32768");
    assert_eq!(g.model.config.kv_bytes_per_token(), 2 * 2 * 18 * 256);

    // The cap is the engine's real limit, not only a label.
    let engine = BatchEngine::start(g, BatchConfig { kv_blocks: 64, ..BatchConfig::default() });
    let long = SeqRequest::new(Prompt::Tokens(vec![2; 600]), 4);
    assert!(engine.submit(long).is_err(), "a 600-token prompt exceeds the 512 served");
    let rate = engine.measure_decode(8).unwrap();
    eprintln!("gemma 3 270m decode, measured at start: {rate:.1} tok/s");
    assert!(rate > 0.5 && rate.is_finite(), "{rate}");
    // The measurement leaves nothing running and its blocks evictable.
    assert_eq!(engine.running(), 0);
    assert_eq!(engine.free_kv_tokens(), 64 * 16);
}
