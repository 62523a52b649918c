//! The engine's rules at the edge (gateway::validate, issue 15 §5): over
//! real HTTP against the real router, requests a worker's engine would
//! refuse get a 400 naming the parameter — blocking or streamed, before any
//! job reaches the network — and a worker's client-error refusal reaches
//! the client as a 400 too. The network behind the edge is scripted
//! (tests/support); its registration advertises SmolLM2 (context 8192,
//! vocabulary 49152).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use gcs_gateway::GatewayConfig;
use gcs_protocol::ErrorInfo;
use serde_json::{json, Value};
use support::{exchange, gateway, post, Net, Script};

const CHAT: &str = "/v1/chat/completions";

fn with(extra: Value, stream: bool) -> String {
    let mut body = json!({"model": "gnus-auto", "stream": stream,
                          "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_engine_refuses_is_a_400_at_the_edge() {
    let net = Net::new(Script::Stream {
        first_after: Duration::from_millis(5),
        gap: Duration::from_millis(1),
        tokens: 2,
    });
    let (addr, key, _dir) = gateway(net.clone(), GatewayConfig::default(), None).await;
    let many_bias: serde_json::Map<String, Value> =
        (0..301).map(|i| (i.to_string(), json!(1))).collect();
    let cases: Vec<(&str, Value, &str)> = vec![
        ("logit_bias id = vocabulary", json!({"logit_bias": {"49152": 5}}), "logit_bias"),
        ("logit_bias id far beyond", json!({"logit_bias": {"4000000000": 5}}), "logit_bias"),
        ("301 logit_bias entries", json!({"logit_bias": many_bias}), "logit_bias"),
        ("top_p 0", json!({"top_p": 0}), "top_p"),
        ("a 257-byte stop string", json!({"stop": ["x".repeat(257)]}), "stop"),
        (
            "a prompt past the context",
            json!({"messages": [{"role": "user", "content": "a".repeat(8192 * 128)}]}),
            "messages",
        ),
    ];
    for (what, extra, param) in cases {
        for stream in [false, true] {
            let a = exchange(addr, &post(CHAT, Some(&key), &with(extra.clone(), stream))).await;
            let v = a.assert_envelope(400);
            assert_eq!(v["error"]["param"], param, "{what} (stream {stream}): {v}");
            assert_eq!(v["error"]["type"], "invalid_request_error", "{what}: {v}");
        }
    }
    assert_eq!(net.submitted(), 0, "a refused request reached the network");
    // The boundary values pass and run.
    let ok = json!({"logit_bias": {"49151": 5, "0": -100}, "top_p": 0.01,
                    "stop": ["x".repeat(256)]});
    let a = exchange(addr, &post(CHAT, Some(&key), &with(ok, false))).await;
    assert_eq!(a.status, 200, "{} {}", a.head, a.body);
    assert_eq!(net.submitted(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_client_error_refusal_is_a_400() {
    // What the tracker emits for a worker's invalid_request_error result.
    let error = ErrorInfo::invalid_request("the prompt is 9000 tokens; the context is 8192");
    let net = Net::new(Script::Fail { after: Duration::from_millis(20), leased: true, error });
    let (addr, key, _dir) = gateway(net.clone(), GatewayConfig::default(), None).await;
    for stream in [false, true] {
        let a = exchange(addr, &post(CHAT, Some(&key), &with(json!({}), stream))).await;
        let v = a.assert_envelope(400);
        assert_eq!(v["error"]["code"], ErrorInfo::INVALID_REQUEST_CODE, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("context"), "{v}");
    }
}

/// A model's default wall timeout stretches with its workers' advertised
/// decode speed: `max_tokens` at that speed four times over, between the
/// configured default and 30 minutes; a request's own limit wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_models_long_answer_gets_a_longer_default_wall_timeout() {
    for (speed, cases) in [
        (
            40.0,
            vec![
                // 0.4 s of decoding: the configured default.
                (json!({"max_tokens": 4}), 120_000),
                // 100 s of decoding, four times over.
                (json!({"max_tokens": 4000}), 400_000),
                (json!({"max_tokens": 4000, "gnus": {"limits": {"wall_timeout_ms": 5000}}}), 5_000),
            ],
        ),
        // A (lying) crawl asks for hours: capped at 30 minutes.
        (0.5, vec![(json!({"max_tokens": 4000}), 1_800_000)]),
        // None advertised: the configured default.
        (0.0, vec![(json!({"max_tokens": 4000}), 120_000)]),
    ] {
        let net = Net::new(Script::Stream {
            first_after: Duration::from_millis(5),
            gap: Duration::from_millis(1),
            tokens: 2,
        });
        *net.decode_speed.lock().unwrap() = speed;
        let (addr, key, _dir) = gateway(net.clone(), GatewayConfig::default(), None).await;
        for (i, (extra, want)) in cases.iter().enumerate() {
            let a = exchange(addr, &post(CHAT, Some(&key), &with(extra.clone(), false))).await;
            assert_eq!(a.status, 200, "{}", a.body);
            let got = net.jobs.lock().unwrap()[i].limits.wall_timeout_ms;
            assert_eq!(got, *want, "{speed} tokens/s, {extra}");
        }
    }
}
