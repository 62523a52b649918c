//! Claim latency: job published → lease granted, p50/p99, with 1, 3 and 10
//! workers on loopback (real libp2p, real signing and validation). The
//! workers' executor is a trivial stand-in: this measures the network and
//! the claim protocol, not inference.
//! Run: `cargo bench -p gcs-node --bench claims`
//! (under `cargo test --benches` it runs a small smoke version).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "../../tests/support/loopback.rs"]
mod loopback;

use gcs_node::jobs::executor::{ExecError, ExecOutcome, ExecRequest, Executor};
use gcs_node::jobs::{JobEvent, JobSpec};
use gcs_node::{start, NodeConfig, NodeHandle, Role};
use gcs_protocol::{ApiType, FinishReason, JobLimits};

#[derive(Debug)]
struct OneToken;

impl Executor for OneToken {
    fn run(
        &self,
        _: &ExecRequest,
        _: &AtomicBool,
        emit: &mut dyn FnMut(&str, u32, Vec<gcs_protocol::TokenLogprob>) -> bool,
    ) -> Result<ExecOutcome, ExecError> {
        emit("x", 1, vec![]);
        Ok(ExecOutcome {
            finish_reason: FinishReason::Stop,
            input_tokens: 1,
            output_tokens: 1,
            cached_tokens: 0,
            body: serde_json::Value::Null,
        })
    }
}

fn config(role: Role, dir: &tempfile::TempDir, boot: Vec<libp2p::Multiaddr>) -> NodeConfig {
    let mut c = loopback::config(role, dir, boot);
    // The heartbeat the figures in specs/figures.md were measured with (the
    // shared test config's 300 ms makes ten workers' registrations, which
    // every node verifies and stores, a larger share of the two cores).
    c.heartbeat_interval = Duration::from_millis(500);
    c.registration_ttl = Duration::from_millis(5_000);
    c.models = vec![loopback::model("bench-model", &[])];
    c.executor = Some(Arc::new(OneToken));
    c.max_concurrent_jobs = 64;
    c
}

fn pct(v: &[f64], p: f64) -> f64 {
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

async fn run(workers: usize, jobs: usize) {
    let dirs: Vec<_> = (0..=workers).map(|_| tempfile::tempdir().unwrap()).collect();
    let gw = start(config(Role::Gateway, &dirs[0], vec![])).await.unwrap();
    let t = Instant::now();
    let boot = loop {
        if let Some(a) = gw.listen_addrs().await.unwrap().into_iter().next() {
            break a;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "no listen address after 30 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let mut ws: Vec<NodeHandle> = vec![];
    for d in &dirs[1..] {
        ws.push(start(config(Role::Worker, d, vec![boot.clone()])).await.unwrap());
    }
    let t = Instant::now();
    while gw.fresh_registrations().len() < workers {
        assert!(t.elapsed() < Duration::from_secs(60), "workers did not register");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let mut lat = vec![];
    for i in 0..jobs {
        let spec = JobSpec {
            api_type: ApiType::ChatCompletion,
            model: "bench-model".into(),
            stream: true,
            body: format!("{{\"i\":{i}}}").into_bytes(),
            tenant_id: "t".into(),
            project_id: "p".into(),
            api_key_id: "k".into(),
            idempotency_key: format!("i{i}"),
            limits: JobLimits::default(),
            max_output_tokens: 1,
            routing: gcs_protocol::Routing::public(),
            batch_id: None,
            parent: None,
            price_percent: None,
        };
        let t0 = Instant::now();
        let (_, mut rx) = gw.submit(spec).await.unwrap();
        loop {
            match tokio::time::timeout(Duration::from_secs(20), rx.recv()).await.unwrap() {
                Some(JobEvent::Leased { .. }) => lat.push(t0.elapsed().as_secs_f64() * 1000.0),
                Some(JobEvent::Completed(_)) | None => break,
                Some(JobEvent::Failed { error, .. }) => panic!("job failed: {error:?}"),
                Some(_) => {}
            }
        }
    }
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "claim latency (published -> lease granted), {workers} worker(s), {} jobs: p50 {:.2} ms, p99 {:.2} ms",
        lat.len(),
        pct(&lat, 0.5),
        pct(&lat, 0.99)
    );
    for w in ws {
        w.shutdown().await;
    }
    gw.shutdown().await;
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    if full {
        for w in [1, 3, 10] {
            run(w, 200).await;
        }
    } else {
        run(2, 5).await;
    }
}
