//! A streamed request's HTTP status waits for something to stream (issue
//! 15 §4), end to end: a gateway node and workers over real libp2p on
//! loopback, the real tracker, the real router served by `serve_with`, raw
//! HTTP/1.1. Workers run a scripted executor (a stand-in for the engine,
//! only inside these tests) that streams words, or refuses the request as
//! a client error when the prompt says "refuse".
//!
//! - no worker will claim (the only one takes jobs from another gateway
//!   only): the tracker gives up with `gnus_no_capable_nodes`, and the
//!   client gets 503 JSON with Retry-After — not a 200 with an SSE error;
//! - a worker refuses the request as the engine would: 400 JSON;
//! - a normal stream: 200, SSE, every word, `[DONE]`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gcs_node::jobs::executor::{ExecError, ExecOutcome, ExecRequest, Executor};
#[path = "../../tests/support/loopback.rs"]
mod loopback;
use loopback::addr;

use gcs_gateway::payload::{JobRequest, Prompt};
use gcs_node::{start, NodeHandle, Role};
use gcs_protocol::FinishReason;

#[derive(Debug)]
struct Words;

impl Executor for Words {
    fn run(
        &self,
        req: &ExecRequest,
        _cancel: &AtomicBool,
        emit: &mut dyn FnMut(&str, u32, Vec<gcs_protocol::TokenLogprob>) -> bool,
    ) -> Result<ExecOutcome, ExecError> {
        let Ok(JobRequest::Generation(g)) = JobRequest::decode(&req.body) else {
            return Err(ExecError::Invalid("not a generation".into()));
        };
        let text = match &g.prompt {
            Prompt::Chat(m) => m.iter().map(|m| m.content.clone()).collect::<String>(),
            Prompt::Text(t) => t.clone(),
        };
        if text.contains("refuse") {
            return Err(ExecError::Invalid(
                "logit_bias token 999999 is beyond the vocabulary".into(),
            ));
        }
        for i in 0..3 {
            std::thread::sleep(Duration::from_millis(20));
            if !emit(&format!("w{i} "), 1, vec![]) {
                break;
            }
        }
        Ok(ExecOutcome {
            finish_reason: FinishReason::Length,
            input_tokens: 3,
            output_tokens: 3,
            cached_tokens: 0,
            body: serde_json::json!({"object": "chat.completion"}),
        })
    }
}

async fn registered(gw: &NodeHandle, id: &gcs_protocol::NodeId) {
    let t = Instant::now();
    while !gw.fresh_registrations().iter().any(|r| &r.node_id == id) {
        assert!(t.elapsed() < Duration::from_secs(30), "worker never registered");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// One request on a fresh connection: (status, lower-cased head, body).
async fn post(http: std::net::SocketAddr, key: &str, content: &str) -> (u16, String, String) {
    let body = serde_json::json!({"model": "gnus-test", "stream": true, "max_tokens": 8,
                                  "messages": [{"role": "user", "content": content}]})
    .to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(http).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(req.as_bytes()).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let text = String::from_utf8_lossy(&out).to_string();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let head = head.to_ascii_lowercase();
        let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        (status, head, body.to_string())
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_that_fails_before_its_first_token_is_answered_with_its_status() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let mut gc = loopback::config(Role::Gateway, &dirs[0], vec![]);
    // Unclaimed jobs give up after their requeues (3 claim windows of 1 s).
    gc.tracker.queue_timeout_ms = 0;
    let gw = start(gc).await.unwrap();
    let boot = addr(&gw).await;
    // A worker that takes jobs only from some other gateway: registered and
    // fresh, so admission submits, but it never claims.
    let mut aloof = loopback::config(Role::Worker, &dirs[1], vec![boot.clone()]);
    aloof.executor = Some(Arc::new(Words));
    let other = gcs_protocol::NodeKey::from_seed([9u8; 32]).node_id();
    aloof.gateways = Some([other].into_iter().collect());
    let aloof = start(aloof).await.unwrap();
    registered(&gw, &aloof.node_id).await;

    let keys = tempfile::tempdir().unwrap();
    let store = Arc::new(gcs_gateway::KeyStore::new(keys.path()));
    let new =
        gcs_gateway::NewKey { tenant_id: "t".into(), project_id: "p".into(), ..Default::default() };
    let (key, _) = store.create(new, gcs_protocol::now_ms()).unwrap();
    let config = gcs_gateway::GatewayConfig {
        stream_hold: Duration::from_secs(10),
        keepalive: Duration::from_secs(15),
        ..Default::default()
    };
    let edge = config.edge.clone();
    let app = gcs_gateway::router(Arc::new(gw.client()), store, config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = listener.local_addr().unwrap();
    tokio::spawn(gcs_gateway::serve::serve_with(listener, app, None, edge, std::future::pending()));

    let t0 = Instant::now();
    let (status, head, body) = post(http, &key, "hello").await;
    assert_eq!(status, 503, "{head}\n{body}");
    assert!(head.contains("content-type: application/json"), "{head}");
    assert!(head.contains("retry-after:"), "{head}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "gnus_no_capable_nodes", "{v}");
    assert!(t0.elapsed() < Duration::from_secs(10), "answered after {:?}", t0.elapsed());

    // A worker that takes our jobs, and refuses this one as a client error.
    let mut w = loopback::config(Role::Worker, &dirs[2], vec![boot]);
    w.executor = Some(Arc::new(Words));
    let w = start(w).await.unwrap();
    registered(&gw, &w.node_id).await;
    let (status, head, body) = post(http, &key, "please refuse").await;
    assert_eq!(status, 400, "{head}\n{body}");
    assert!(!head.contains("text/event-stream"), "{head}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");

    // And a normal stream is a stream.
    let (status, head, body) = post(http, &key, "hello").await;
    assert_eq!(status, 200, "{head}\n{body}");
    assert!(head.contains("content-type: text/event-stream"), "{head}");
    assert!(body.contains(": gcs job accepted"), "{body}");
    for wd in ["w0 ", "w1 ", "w2 "] {
        assert!(body.contains(wd), "{wd} missing: {body}");
    }
    assert!(body.contains("data: [DONE]"), "{body}");
    w.shutdown().await;
    aloof.shutdown().await;
    gw.shutdown().await;
}
