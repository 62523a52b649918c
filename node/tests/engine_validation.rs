//! The worker applies the gateway's validation with its engine's own limits
//! (gateway::validate): a payload that slipped past the edge (another build,
//! a vocabulary the gateway did not know) is refused as the client's error
//! (`ExecError::Invalid`, which the result reports as invalid_request_error)
//! before it reaches the engine, and a valid one still runs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;

use std::sync::atomic::AtomicBool;

use gcs_gateway::payload::{Generation, JobRequest, Message, Prompt, Role, Sampling};
use gcs_node::jobs::engine_exec::EngineExecutor;
use gcs_node::jobs::executor::{ExecError, ExecRequest, Executor};
use gcs_protocol::ApiType;

fn model_dir() -> std::path::PathBuf {
    std::env::var_os("GCS_MODEL_DIR").map(Into::into).unwrap_or_else(|| {
        std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/gcs/models")
    })
}

fn chat(max_tokens: u32) -> Generation {
    Generation {
        prompt: Prompt::Chat(vec![Message::text(Role::User, "Say hi")]),
        max_tokens,
        sampling: Sampling { temperature: 0.0, ..Sampling::default() },
        stop: vec![],
        logprobs: None,
        constraint: None,
        tools: None,
    }
}

fn run(exec: &EngineExecutor, g: Generation) -> Result<u64, ExecError> {
    let api = match g.prompt {
        Prompt::Chat(_) => ApiType::ChatCompletion,
        Prompt::Text(_) => ApiType::Completion,
    };
    let req = ExecRequest {
        api_type: api,
        model: "smollm2-135m-instruct".into(),
        body: JobRequest::Generation(g).encode().unwrap(),
        cache_salt: "t".into(),
        priority: Default::default(),
    };
    let mut emitted = 0u64;
    let out = exec.run(&req, &AtomicBool::new(false), &mut |_, n, _| {
        emitted += u64::from(n);
        true
    })?;
    Ok(out.output_tokens.max(emitted))
}

#[test]
fn the_worker_refuses_what_the_edge_refuses_as_a_client_error() {
    let entry = gcs_node::models::entry("smollm2-135m-instruct").expect("in the catalogue");
    if !entry.path(&model_dir()).is_file() {
        prereq::missing(
            &entry.path(&model_dir()).display().to_string(),
            "run scripts/fetch-models.sh",
        );
        return;
    }
    let exec = EngineExecutor::load(&model_dir(), &[entry.info()], 2).unwrap();
    let invalid = |g: Generation, what: &str| match run(&exec, g) {
        Err(ExecError::Invalid(m)) => assert!(m.contains(what), "{what}: {m}"),
        other => panic!("{what}: expected a client error, got {other:?}"),
    };
    let mut g = chat(4);
    g.sampling.logit_bias = [(10_000_000, 1.0)].into();
    invalid(g, "vocabulary");
    let mut g = chat(4);
    g.sampling.top_p = 0.0;
    invalid(g, "top_p");
    let mut g = chat(4);
    g.stop = vec!["x".into(); 5];
    invalid(g, "stop");
    let mut g = chat(4);
    g.sampling.logit_bias = (0..301).map(|i| (i, 1.0)).collect();
    invalid(g, "logit_bias");
    // A completion prompt longer than the context, counted exactly.
    let long = Generation { prompt: Prompt::Text("hello ".repeat(9000)), ..chat(4) };
    invalid(long, "context");
    // And the same engine still serves a valid request.
    let mut ok = chat(3);
    ok.sampling.logit_bias = [(1, 1.0)].into();
    let n = run(&exec, ok).unwrap();
    assert!(n >= 1, "no tokens generated");
}
