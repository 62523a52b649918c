//! Child jobs (26.14) of an embeddings request larger than one job, in
//! front of the scripted network of `support`: one parent, its children
//! naming it, the answer in input order, the parent's roll-up counting its
//! children, and a failing child failing the parent with one error while
//! its siblings are cancelled.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use gcs_gateway::GatewayConfig;
use gcs_protocol::ErrorInfo;
use support::{exchange, gateway, post, Net, Script};

fn embed(n: usize) -> String {
    let input: Vec<String> = (0..n).map(|i| format!("text {i}")).collect();
    serde_json::json!({"model": "gnus-embed", "input": input}).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_embeddings_request_is_one_parent_of_child_jobs() {
    let config = GatewayConfig { embed_batch: 4, wall_timeout_ms: 60_000, ..Default::default() };
    let net = Net::new(Script::Embed);
    let (addr, key, _dir) = gateway(net.clone(), config, None).await;
    let a = exchange(addr, &post("/v1/embeddings", Some(&key), &embed(12))).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let data = a.json()["data"].as_array().unwrap().clone();
    assert_eq!(data.len(), 12);
    for (i, d) in data.iter().enumerate() {
        assert_eq!(d["index"], i, "in input order");
    }
    let jobs = net.jobs.lock().unwrap().clone();
    assert_eq!(jobs.len(), 3, "3 children of 4 inputs");
    let parents = net.parents.lock().unwrap().clone();
    assert_eq!(parents.len(), 1, "one parent roll-up");
    let p = &parents[0];
    assert_eq!(p.child_jobs, 3);
    assert!(p.job_id.starts_with("gcsapi_"), "{}", p.job_id);
    assert!(p.cancellation_reason.is_none());
    assert!(a.head.contains(&format!("x-request-id: {}", p.job_id.to_lowercase())), "{}", a.head);
    for (i, j) in jobs.iter().enumerate() {
        let r = j.parent.as_ref().expect("each child names its parent");
        assert_eq!(r.parent_job.job_id, p.job_id);
        assert_eq!(r.parent_job.phase, "embeddings");
        assert!(r.processing_task.is_none());
        assert!(j.idempotency_key.ends_with(&format!("#{i}")), "{}", j.idempotency_key);
        // The parent's deadline, not a fresh one per child.
        assert!(j.limits.wall_timeout_ms <= 60_000 && j.limits.wall_timeout_ms > 50_000);
        assert_eq!(j.routing, jobs[0].routing, "one policy for all children");
    }
    // A request that fits one job is one job, with no parent.
    let a = exchange(addr, &post("/v1/embeddings", Some(&key), &embed(3))).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(net.jobs.lock().unwrap()[3].parent.is_none());
    assert_eq!(net.parents.lock().unwrap().len(), 1, "no roll-up for a single job");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_child_fails_the_parent_once_and_cancels_its_siblings() {
    let config = GatewayConfig { embed_batch: 4, ..Default::default() };
    let error = ErrorInfo {
        kind: "server_error".into(),
        code: "gnus_worker_failed".into(),
        message: "the worker failed".into(),
    };
    // The first child fails after 50 ms; its siblings would take 1 s.
    let net = Net::new(Script::EmbedFailing { nth: 0, after: Duration::from_millis(50), error });
    let (addr, key, _dir) = gateway(net.clone(), config, None).await;
    let a = exchange(addr, &post("/v1/embeddings", Some(&key), &embed(12))).await;
    let v = a.assert_envelope(500);
    assert_eq!(v["error"]["code"], "gnus_worker_failed", "the child's own error: {v}");
    let parents = net.parents.lock().unwrap().clone();
    assert_eq!(parents.len(), 1, "one roll-up: {parents:?}");
    assert_eq!(parents[0].child_jobs, 3);
    assert!(parents[0].cancellation_reason.is_some(), "{parents:?}");
    let jobs: Vec<String> = (0..3).map(|i| format!("job_{i}")).collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let cancelled = net.cancelled_ids.lock().unwrap().clone();
    assert!(!cancelled.contains(&jobs[0]), "the failed child is not cancelled: {cancelled:?}");
    let mut siblings = cancelled.clone();
    siblings.sort();
    siblings.dedup();
    assert_eq!(siblings.len(), cancelled.len(), "each sibling cancelled once: {cancelled:?}");
    for j in &jobs[1..] {
        assert!(cancelled.contains(j), "{j} cancelled in the network: {cancelled:?}");
    }
}
