//! A real model answers through the network: gateway + worker running
//! SmolLM2 on the burn engine; the streamed text equals the engine's own
//! greedy output for the same prompt.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;

use std::sync::Arc;
use std::time::{Duration, Instant};

use gcs_engine::{ChatMessage, GenerateRequest, SamplingParams};
use gcs_node::jobs::engine_exec::EngineExecutor;
use gcs_node::jobs::{JobEvent, JobSpec};
use gcs_node::{start, NodeConfig, Role};
use gcs_protocol::{ApiType, JobLimits};

/// The job payload the gateway builds for this OpenAI body.
fn payload(body: &serde_json::Value) -> Vec<u8> {
    let bytes = serde_json::to_vec(body).unwrap();
    match gcs_gateway::request::parse(ApiType::ChatCompletion, &bytes).unwrap() {
        gcs_gateway::request::Parsed::Generation(g) => g.choice(0).encode().unwrap(),
        gcs_gateway::request::Parsed::Embedding(_) => panic!("not a chat body"),
    }
}

fn model_dir() -> std::path::PathBuf {
    std::env::var_os("GCS_MODEL_DIR").map(Into::into).unwrap_or_else(|| {
        std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/gcs/models")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_answers_through_gateway_and_worker() {
    let entry = gcs_node::models::entry("smollm2-135m-instruct").expect("in the catalogue");
    let gguf = entry.path(&model_dir());
    if !gguf.is_file() {
        prereq::missing(&gguf.display().to_string(), "run scripts/fetch-models.sh");
        return;
    }
    let chat = entry.info();
    let exec = EngineExecutor::load(&model_dir(), std::slice::from_ref(&chat), 4).unwrap();
    // Reference: the engine alone, greedy.
    let engine = gcs_engine::Engine::load(&gguf, &gcs_engine::cpu_device()).unwrap();
    let reference = engine
        .generate(
            &GenerateRequest {
                messages: vec![ChatMessage::new("user", "What is the capital of France?")],
                max_tokens: 12,
                sampling: SamplingParams::greedy(),
                extra_stop_ids: vec![],
            },
            |_| true,
        )
        .unwrap();
    drop(engine);

    let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let cfg = |role, d: &tempfile::TempDir, boot: Vec<libp2p::Multiaddr>| {
        let mut c = NodeConfig::new(role, d.path().to_path_buf());
        c.network.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
        c.network.bootstrap = boot;
        c.network.mdns = false;
        c.heartbeat_interval = Duration::from_millis(300);
        c.models = vec![chat.clone()];
        c
    };
    let gw = start(cfg(Role::Gateway, &dirs[0], vec![])).await.unwrap();
    let t = Instant::now();
    let addr = loop {
        if let Some(a) = gw.listen_addrs().await.unwrap().into_iter().next() {
            break a;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "no listen address after 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut wc = cfg(Role::Worker, &dirs[1], vec![addr]);
    wc.executor = Some(Arc::new(exec));
    let worker = start(wc).await.unwrap();
    let t = Instant::now();
    while gw.fresh_registrations().is_empty() {
        assert!(t.elapsed() < Duration::from_secs(30));
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let body = serde_json::json!({
        "model": "gnus-auto",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 12, "stream": true
    });
    let (_, mut rx) = gw
        .submit(JobSpec {
            api_type: ApiType::ChatCompletion,
            model: "gnus-auto".into(),
            stream: true,
            body: payload(&body),
            tenant_id: "t".into(),
            project_id: "p".into(),
            api_key_id: "k".into(),
            idempotency_key: "e2e".into(),
            limits: JobLimits { claim_timeout_ms: 5_000, ..JobLimits::default() },
            max_output_tokens: 12,
            routing: gcs_protocol::Routing::public(),
            batch_id: None,
            parent: None,
            price_percent: None,
        })
        .await
        .unwrap();
    let mut text = String::new();
    let done = loop {
        match tokio::time::timeout(Duration::from_secs(60), rx.recv()).await.unwrap().unwrap() {
            JobEvent::Chunk(c) => text.push_str(c.delta.content.as_deref().unwrap_or("")),
            JobEvent::Completed(r) => break r,
            JobEvent::Leased { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(text, reference.text, "streamed text = the engine's greedy output");
    assert!(!text.is_empty());
    let body = &done.response.as_ref().unwrap().body;
    assert_eq!(body["choices"][0]["message"]["content"], reference.text);
    assert_eq!(body["usage"]["completion_tokens"], reference.completion_tokens);
    worker.shutdown().await;
    gw.shutdown().await;
}
