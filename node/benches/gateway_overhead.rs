//! Gateway overhead: client-side time to first token and decode tokens/s
//! through HTTP + gateway + network + worker (`--role all` in one process,
//! real sockets), against the same engine called directly, measured
//! alternately in one run. `cargo bench -p gcs-node --bench gateway_overhead`
//! (under `cargo test --benches` it runs a small smoke version).

//! Without the model it says SKIP (a failure under `CI=true`); with it, an
//! engine that does not load is a failure.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gcs_node::jobs::engine_exec::EngineExecutor;
use gcs_node::jobs::executor::{ExecRequest, Executor};
use gcs_node::{start, NodeConfig, Role};
use gcs_protocol::ApiType;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKENS: usize = 64;

fn body() -> serde_json::Value {
    serde_json::json!({"model": "gnus-auto", "max_tokens": TOKENS, "temperature": 0, "stream": true,
        "logit_bias": {"0": -100, "1": -100, "2": -100},
        "messages": [{"role": "user", "content": "Describe the sea in detail."}]})
}

/// The job payload the gateway builds for [`body`].
fn payload() -> Vec<u8> {
    let bytes = serde_json::to_vec(&body()).unwrap();
    match gcs_gateway::request::parse(ApiType::ChatCompletion, &bytes).unwrap() {
        gcs_gateway::request::Parsed::Generation(g) => g.choice(0).encode().unwrap(),
        gcs_gateway::request::Parsed::Embedding(_) => panic!("not a chat body"),
    }
}

/// (TTFT, decode tokens/s after the first token) through the HTTP API.
async fn via_gateway(port: u16, key: &str) -> (f64, f64) {
    let b = serde_json::to_vec(&body()).unwrap();
    let t0 = Instant::now();
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.set_nodelay(true).unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        b.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&b).await.unwrap();
    let (mut first, mut last, mut frames) = (None, t0, 0usize);
    let mut buf = vec![0u8; 65536];
    let mut seen = Vec::new();
    loop {
        let n = s.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
        let pat = b"\"content\":\"";
        let c = buf[..n].windows(pat.len()).filter(|w| w == pat).count();
        if c > 0 {
            first.get_or_insert_with(Instant::now);
            last = Instant::now();
            frames += c;
        }
    }
    assert!(String::from_utf8_lossy(&seen).contains("data: [DONE]"), "stream did not finish");
    let first = first.expect("no token arrived");
    let ttft = (first - t0).as_secs_f64();
    (ttft, (frames.saturating_sub(1)) as f64 / (last - first).as_secs_f64().max(1e-9))
}

/// The same request to the engine directly (the worker's executor).
fn direct(exec: &EngineExecutor) -> (f64, f64) {
    let req = ExecRequest {
        api_type: ApiType::ChatCompletion,
        model: "smollm2-135m-instruct".into(),
        body: payload(),
        cache_salt: "bench".into(),
        priority: Default::default(),
    };
    let t0 = Instant::now();
    let (mut first, mut last, mut n) = (None, t0, 0usize);
    exec.run(&req, &AtomicBool::new(false), &mut |_, tokens, _| {
        first.get_or_insert_with(Instant::now);
        last = Instant::now();
        n += tokens as usize;
        true
    })
    .unwrap();
    let first = first.unwrap();
    ((first - t0).as_secs_f64(), n.saturating_sub(1) as f64 / (last - first).as_secs_f64())
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds = if std::env::args().any(|a| a == "--bench") { 30 } else { 2 };
    let models = std::env::var_os("GCS_MODEL_DIR").map(Into::into).unwrap_or_else(|| {
        std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/gcs/models")
    });
    let entry = gcs_node::models::entry("smollm2-135m-instruct").expect("in the catalogue");
    let chat = entry.info();
    let gguf = entry.path(&models);
    if !gguf.is_file() {
        prereq::missing(&gguf.display().to_string(), "run scripts/fetch-models.sh");
        return;
    }
    let exec = Arc::new(
        EngineExecutor::load(&models, std::slice::from_ref(&chat), 4).expect("the engine loads"),
    );
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = NodeConfig::new(Role::All, dir.path().to_path_buf());
    cfg.network.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
    cfg.network.mdns = false;
    cfg.models = vec![chat];
    cfg.executor = Some(exec.clone());
    let node = start(cfg).await.unwrap();
    let keys = gcs_gateway::KeyStore::new(dir.path());
    let new =
        gcs_gateway::NewKey { tenant_id: "b".into(), project_id: "b".into(), ..Default::default() };
    let (key, _) = keys.create(new, gcs_node::now_ms()).unwrap();
    let app = gcs_gateway::router(
        Arc::new(node.client()),
        Arc::new(keys),
        gcs_gateway::GatewayConfig::default(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(gcs_gateway::serve(listener, app, None, std::future::pending()));
    let t = Instant::now();
    while node.fresh_registrations().is_empty() {
        assert!(t.elapsed() < Duration::from_secs(30), "the worker never registered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (mut gt, mut gr, mut dt, mut dr) = (vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        let e = exec.clone();
        let (t, r) = tokio::task::spawn_blocking(move || direct(&e)).await.unwrap();
        dt.push(t);
        dr.push(r);
        let (t, r) = via_gateway(port, &key).await;
        gt.push(t);
        gr.push(r);
    }
    let ms = |v: f64| v * 1000.0;
    println!("gateway overhead, {rounds} alternating rounds of {TOKENS} tokens (greedy):");
    println!(
        "  engine alone : TTFT p50 {:.1} ms p99 {:.1} ms | decode p50 {:.1} tok/s",
        ms(pct(&mut dt, 0.5)),
        ms(pct(&mut dt, 0.99)),
        pct(&mut dr, 0.5)
    );
    println!(
        "  via gateway  : TTFT p50 {:.1} ms p99 {:.1} ms | decode p50 {:.1} tok/s",
        ms(pct(&mut gt, 0.5)),
        ms(pct(&mut gt, 0.99)),
        pct(&mut gr, 0.5)
    );
    println!(
        "  added TTFT p50 {:.1} ms; decode ratio gateway/engine {:.3}",
        ms(pct(&mut gt, 0.5) - pct(&mut dt, 0.5)),
        pct(&mut gr, 0.5) / pct(&mut dr, 0.5)
    );
    node.shutdown().await;
}
