//! The worker's side of an exact continuation, on the real engine: a job
//! resumed (`Executor::resume_with_ids`) from the tokens and text a first
//! run had emitted up to a chunk boundary emits exactly the rest of that
//! run, and its outcome counts every token once. A continuation whose text
//! is not what the replay releases is refused. Needs the model; skips
//! otherwise.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;

use std::sync::atomic::AtomicBool;

use gcs_gateway::payload::{Generation, JobRequest, Message, Prompt, Role, Sampling};
use gcs_node::jobs::engine_exec::EngineExecutor;
use gcs_node::jobs::executor::{ExecError, ExecOutcome, ExecRequest, Executor};
use gcs_protocol::{ApiType, Continuation, Hash32, CONTINUATION_VERSION};

fn model_dir() -> std::path::PathBuf {
    std::env::var_os("GCS_MODEL_DIR").map(Into::into).unwrap_or_else(|| {
        std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/gcs/models")
    })
}

/// (text, token ids) of each emitted delta.
type Chunks = Vec<(String, Vec<u32>)>;

fn request(g: &Generation) -> ExecRequest {
    ExecRequest {
        api_type: ApiType::ChatCompletion,
        model: "smollm2-135m-instruct".into(),
        body: JobRequest::Generation(g.clone()).encode().unwrap(),
        cache_salt: "tenant-salt".into(),
        priority: Default::default(),
    }
}

fn run(
    exec: &EngineExecutor,
    g: &Generation,
    from: Option<&Continuation>,
) -> Result<(Chunks, ExecOutcome), ExecError> {
    let mut chunks = Vec::new();
    let mut emit = |text: &str, n: u32, ids: &[u32], _| {
        assert_eq!(ids.len(), n as usize, "the engine reports every token's id");
        chunks.push((text.to_string(), ids.to_vec()));
        true
    };
    let cancel = AtomicBool::new(false);
    let out = match from {
        None => exec.run_with_ids(&request(g), &cancel, &mut emit)?,
        Some(c) => exec.resume_with_ids(&request(g), c, &cancel, &mut emit)?,
    };
    Ok((chunks, out))
}

fn continuation(chunks: &[(String, Vec<u32>)], seed: u64) -> Continuation {
    let text: String = chunks.iter().map(|c| c.0.as_str()).collect();
    Continuation {
        version: CONTINUATION_VERSION,
        job_id: "gcsapi_01HZX3K9Q2W8E7R6T5Y4V3M2N1".into(),
        continuation: 1,
        from_sequence: chunks.len() as u64,
        delivered_tokens: chunks.iter().flat_map(|c| c.1.iter().copied()).collect(),
        delivered_text_hash: Hash32::of(text.as_bytes()),
        seed,
        engine_build: "gcs-engine/test".into(),
        model_hash: "00".repeat(32),
    }
}

#[test]
fn a_resumed_job_emits_exactly_the_rest_of_the_run() {
    let entry = gcs_node::models::entry("smollm2-135m-instruct").expect("in the catalogue");
    if !entry.path(&model_dir()).is_file() {
        prereq::missing(
            &entry.path(&model_dir()).display().to_string(),
            "run scripts/fetch-models.sh",
        );
        return;
    }
    let exec = EngineExecutor::load(&model_dir(), &[entry.info()], 4).unwrap();
    let ask = "Why is the sky blue? Answer in two sentences.";
    for (temperature, seed) in [(0.0, 1), (0.8, 77)] {
        let g = Generation {
            prompt: Prompt::Chat(vec![Message::text(Role::User, ask)]),
            max_tokens: 40,
            sampling: Sampling { temperature, seed: Some(seed), ..Sampling::default() },
            stop: vec![],
            logprobs: None,
            constraint: None,
            tools: None,
        };
        let (full, out) = run(&exec, &g, None).unwrap();
        assert!(full.len() >= 6, "enough chunks: {}", full.len());
        let all_ids: Vec<u32> = full.iter().flat_map(|c| c.1.iter().copied()).collect();
        let all_text: String = full.iter().map(|c| c.0.as_str()).collect();
        for k in [1, full.len() / 2, full.len() - 1] {
            let c = continuation(&full[..k], seed);
            let (rest, out2) = run(&exec, &g, Some(&c)).unwrap();
            let what = format!("T={temperature} after {k} chunks");
            let ids: Vec<u32> = rest.iter().flat_map(|c| c.1.iter().copied()).collect();
            assert_eq!(ids, all_ids[c.delivered_tokens.len()..], "{what}");
            let before: String = full[..k].iter().map(|c| c.0.as_str()).collect();
            let text: String = rest.iter().map(|c| c.0.as_str()).collect();
            assert_eq!(before + &text, all_text, "{what}");
            assert_eq!(out2.output_tokens, out.output_tokens, "{what}: every token once");
            assert_eq!(out2.body["choices"], out.body["choices"], "{what}");
        }
        // Text the replay does not release: another engine or model file.
        let mut bad = continuation(&full[..2], seed);
        bad.delivered_text_hash = Hash32::of(b"something else");
        match run(&exec, &g, Some(&bad)) {
            Err(ExecError::Invalid(m)) => assert!(m.contains("continuation"), "{m}"),
            other => panic!("expected a refusal, got {:?}", other.map(|r| r.0)),
        }
    }
}
