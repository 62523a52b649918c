//! The output revision's fence: a fingerprint of what the CPU engine
//! outputs for a fixed set of requests (greedy, seeded draws under every
//! sampling knob, a grammar, logprobs), pinned to
//! `gcs_engine::OUTPUT_REVISION`. Workers continue each other's streams
//! only when their engine builds match, and the build names that revision,
//! so a change that alters outputs must bump it: this test fails until it
//! does. Needs the models; skips otherwise (a failure under `CI=true`).
//!
//! The CPU arithmetic is the same bits on every ISA and thread count
//! (AVX-512, AVX2, scalar; `attn_paged` and `quant` tests), so the
//! fingerprint is a property of the code and the model file, not of the
//! machine.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::time::Duration;

use gcs_engine::{
    cpu_device, BatchConfig, BatchEngine, ChatMessage, Engine, Grammar, SamplingOptions, SeqEvent,
    SeqRequest, SeqStream, OUTPUT_REVISION,
};

/// The revision the fingerprints below belong to, and the fingerprints.
/// When the test fails because outputs changed on purpose: bump
/// `output_revision!()` in node/engine/src/lib.rs and pin the printed
/// fingerprints here with the new revision.
const PINNED_REVISION: &str = "1";
const SMOLLM2: &str = "8ce361093663eb5161a8a4873bb92cc2c2b7d00be1220aeec6b96dc0faf0267d";
const GEMMA3: &str = "f6eca3c1bbb7e6a2a817f9072b88202a1b7e69a134e9abfc0731b435a3573cab";

/// Tokens a request may generate: enough for several draws under each
/// knob, few enough to keep the test at seconds.
const TOKENS: usize = 24;

fn chat(q: &str) -> gcs_engine::Prompt {
    gcs_engine::Prompt::Chat(vec![ChatMessage::new("user", q)])
}

fn seeded(temperature: f32, seed: u64) -> SamplingOptions {
    SamplingOptions { temperature, seed, ..SamplingOptions::default() }
}

/// The pinned requests, each with its number of samples: each sampling
/// path a stream can take.
fn requests() -> Vec<(&'static str, SeqRequest, usize)> {
    let base = |q: &str, s: SamplingOptions, logprobs: Option<usize>| {
        let mut r = SeqRequest::new(chat(q), TOKENS);
        r.sampling = s;
        r.logprobs = logprobs;
        r
    };
    let mut v: Vec<(&'static str, SeqRequest)> = vec![
        ("greedy", base("Why is the sky blue?", SamplingOptions::greedy(), Some(5))),
        ("temperature", base("Write a haiku about the sea.", seeded(0.8, 11), Some(3))),
        (
            "top-k, top-p, penalties",
            base(
                "List three fruits and say one thing about each.",
                SamplingOptions {
                    top_k: 40,
                    top_p: 0.9,
                    frequency_penalty: 0.4,
                    presence_penalty: 0.3,
                    ..seeded(0.9, 5)
                },
                None,
            ),
        ),
        (
            "min-p, logit bias",
            base(
                "Tell me a short story about a robot.",
                SamplingOptions {
                    min_p: 0.05,
                    logit_bias: vec![(13, -5.0), (30, 2.0)],
                    ..seeded(1.2, 7)
                },
                Some(2),
            ),
        ),
        (
            "narrow nucleus, hot",
            base(
                "What is the capital of France, and why?",
                SamplingOptions { top_p: 0.5, ..seeded(1.5, 9) },
                Some(1),
            ),
        ),
    ];
    let mut stopped = base("Why is the sky blue?", seeded(0.7, 3), None);
    stopped.stop = vec![" the".into(), "\n".into()];
    v.push(("stop string", stopped));
    let mut g = base("Describe a cat as a JSON object.", seeded(0.7, 8), Some(2));
    g.grammar = Some(Grammar::JsonObject);
    v.push(("json object", g));
    let mut all: Vec<_> = v.into_iter().map(|(name, r)| (name, r, 1)).collect();
    // Two samples: their seeds and their shared prompt blocks.
    let two = base("Name a colour and a fruit.", seeded(0.9, 21), Some(1));
    all.insert(6, ("n = 2", two, 2));
    all
}

/// Everything a client sees of one stream, as bytes, and a line saying
/// how it ended.
fn digest(s: SeqStream) -> (blake3::Hash, String) {
    let mut h = blake3::Hasher::new();
    let mut all = String::new();
    loop {
        match s.recv_timeout(Duration::from_secs(300)).expect("event in time") {
            SeqEvent::Delta { text, token_ids, logprobs } => {
                h.update(b"delta");
                h.update(&(text.len() as u64).to_le_bytes());
                h.update(text.as_bytes());
                all.push_str(&text);
                for t in token_ids {
                    h.update(&t.to_le_bytes());
                }
                for l in logprobs {
                    h.update(&l.chosen.token.to_le_bytes());
                    h.update(&l.chosen.logprob.to_bits().to_le_bytes());
                    for t in &l.top {
                        h.update(&t.token.to_le_bytes());
                        h.update(&t.logprob.to_bits().to_le_bytes());
                    }
                }
            }
            SeqEvent::Done(r) => {
                let head: String = all.chars().take(60).collect();
                let end =
                    format!("{:?} after {} tokens: {head:?}", r.finish_reason, r.completion_tokens);
                h.update(end.as_bytes());
                return (h.finalize(), end);
            }
            SeqEvent::Error(e) => panic!("sequence failed: {e}"),
        }
    }
}

/// The model's fingerprint: every request's digest, in order. Prints each
/// so a changed one can be told apart.
fn fingerprint(model: &str, path: &Path) -> String {
    let batch =
        BatchEngine::start(Engine::load(path, &cpu_device()).unwrap(), BatchConfig::default());
    // Both models compile grammars: a fingerprint always covers one.
    assert!(batch.grammars().is_some(), "{model}: constrained decoding");
    let reqs = requests();
    // Submitted together: the outputs are the same whatever else is in the
    // batch (the engine's determinism contract), so batching them is fine.
    let streams: Vec<_> =
        reqs.iter().map(|(name, r, n)| (*name, batch.submit_n(r.clone(), *n).unwrap())).collect();
    let mut all = blake3::Hasher::new();
    for (name, samples) in streams {
        for (i, s) in samples.into_iter().enumerate() {
            let (d, end) = digest(s);
            eprintln!("{model}: {name} [{i}]: {} ({end})", &d.to_hex()[..16]);
            all.update(d.as_bytes());
        }
    }
    all.finalize().to_hex().to_string()
}

fn check(model: &str, got: &str, pinned: &str) {
    assert_eq!(
        PINNED_REVISION, OUTPUT_REVISION,
        "output_revision!() was bumped: pin the fingerprints printed above to it"
    );
    assert!(
        got == pinned,
        "{model}: the engine's outputs for the pinned requests changed (fingerprint {got}, \
         revision {OUTPUT_REVISION} pins {pinned}). A stream begun on a worker of the old build \
         would continue differently on this one. If the change is meant, bump output_revision!() \
         in node/engine/src/lib.rs and pin {got} with it here; if not, it is a bug."
    );
}

#[test]
fn smollm2_outputs_are_those_of_the_output_revision() {
    let Some(path) = common::smollm_path() else { return };
    check("SmolLM2", &fingerprint("SmolLM2", &path), SMOLLM2);
}

#[test]
fn gemma3_outputs_are_those_of_the_output_revision() {
    let Some(path) = common::gemma_path() else { return };
    check("Gemma 3", &fingerprint("Gemma 3", &path), GEMMA3);
}
