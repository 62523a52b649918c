//! `gnus.continuation` at the edge (specs/lifecycle.md "Exact
//! continuation"): the policy reaches the signed job's limits, anything but
//! auto/off is a 400 envelope, and an SSE stream stays open across a
//! continuation's seam — a gap longer than the idle timeout, but with a new
//! lease inside it — and ends with every token and no error. The network
//! behind the edge is scripted (tests/support).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use gcs_gateway::GatewayConfig;
use serde_json::{json, Value};
use support::{exchange, gateway, post, Net, Script};

const CHAT: &str = "/v1/chat/completions";

fn body(extra: Value) -> String {
    let mut b = json!({"model": "gnus-auto", "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_reaches_the_job_and_unknown_values_are_a_400() {
    let script =
        Script::Stream { first_after: Duration::ZERO, gap: Duration::from_millis(1), tokens: 2 };
    let net = Net::new(script);
    let (addr, key, _dir) = gateway(net.clone(), GatewayConfig::default(), None).await;
    for (policy, max) in [(json!(null), 4), (json!("auto"), 4), (json!("off"), 0)] {
        let a = exchange(
            addr,
            &post(CHAT, Some(&key), &body(json!({"gnus": {"continuation": policy}}))),
        )
        .await;
        assert_eq!(a.status, 200, "{policy}: {}", a.body);
        let jobs = net.jobs.lock().unwrap();
        let last = jobs.last().expect("a job");
        assert_eq!(last.limits.max_continuations, max, "{policy}");
    }
    let before = net.jobs.lock().unwrap().len();
    for bad in [json!("on"), json!(true), json!({"mode": "auto"})] {
        for stream in [false, true] {
            let b = body(json!({"stream": stream, "gnus": {"continuation": bad}}));
            let a = exchange(addr, &post(CHAT, Some(&key), &b)).await;
            let v = a.assert_envelope(400);
            assert_eq!(v["error"]["param"], "gnus.continuation", "{bad}: {v}");
            assert_eq!(v["error"]["code"], "invalid_value", "{bad}: {v}");
        }
    }
    assert_eq!(net.jobs.lock().unwrap().len(), before, "no job for a refused request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_stays_open_across_a_continuation_seam() {
    // Idle timeout 100 ms + the edge's 2 s grace: the seam (1.4 s lost, then
    // 1.4 s replay after the new lease) is longer than that from the last
    // chunk, but no part of it is, counted from the new lease.
    let seam = Duration::from_millis(1_400);
    let net = Net::new(Script::Seam { before: 3, lost: seam, replay: seam, after: 4 });
    let (addr, key, _dir) = gateway(net.clone(), GatewayConfig::default(), None).await;
    let b = body(json!({"stream": true, "stream_options": {"include_usage": true},
                        "gnus": {"limits": {"idle_stream_timeout_ms": 100}}}));
    let a = exchange(addr, &post(CHAT, Some(&key), &b)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(!a.body.contains("\"error\""), "no error event: {}", a.body);
    assert!(a.body.contains("data: [DONE]"), "{}", a.body);
    let text: String = a
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(text, "tok ".repeat(7), "every token once, in order");
}
