//! The HTTP edge under abuse, over real TCP against the real router (the
//! network behind it is scripted per test, tests/support): a trickled body
//! is cut with 408, one address's connections and failed authentications
//! are capped (429 at once, a valid key from the same address still
//! passes), a stream's status waits for something to stream (a job that
//! fails first is answered as JSON with its own status), and a request
//! counts its jobs against rpm, the in-flight limit and the per-request cap.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::{Duration, Instant};

use gcs_gateway::GatewayConfig;
use gcs_protocol::ErrorInfo;
use support::{chat, exchange, gateway, metric, metrics, post, read_answer, Net, Script};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn stream_ok() -> Script {
    Script::Stream {
        first_after: Duration::from_millis(50),
        gap: Duration::from_millis(5),
        tokens: 3,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_body_is_answered_408_within_the_body_timeout() {
    let mut config = GatewayConfig::default();
    config.edge.body_read_timeout = Duration::from_millis(600);
    let net = Net::new(stream_ok());
    let (addr, key, _dir) = gateway(net.clone(), config, None).await;
    let before = metric(&metrics(addr).await, "gcs_http_body_timeouts_total");
    let body = chat(false);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let t0 = Instant::now();
    // One byte every 200 ms: the body would take seconds.
    let trickle = async {
        for b in body.as_bytes() {
            if s.write_all(&[*b]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(900), trickle).await;
    let a = read_answer(&mut s).await;
    let v = a.assert_envelope(408);
    assert_eq!(v["error"]["code"], "request_timeout");
    assert!(t0.elapsed() < Duration::from_secs(3), "cut after {:?}", t0.elapsed());
    assert_eq!(net.submitted(), 0, "nothing reached the network");
    assert_eq!(metric(&metrics(addr).await, "gcs_http_body_timeouts_total"), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_from_one_address_are_capped_at_accept() {
    let mut config = GatewayConfig::default();
    config.edge.max_connections_per_ip = 4;
    let (addr, _key, _dir) = gateway(Net::new(stream_ok()), config, None).await;
    let refused =
        gcs_gateway::metrics::CONNECTIONS.refused_per_ip.load(std::sync::atomic::Ordering::Relaxed);
    let mut held = vec![];
    for _ in 0..4 {
        held.push(TcpStream::connect(addr).await.unwrap());
    }
    // The fifth is closed at once, with no byte read.
    let mut fifth = TcpStream::connect(addr).await.unwrap();
    let mut b = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(2), fifth.read(&mut b)).await;
    assert!(matches!(n, Ok(Ok(0)) | Ok(Err(_))), "the fifth connection stayed open: {n:?}");
    let now =
        gcs_gateway::metrics::CONNECTIONS.refused_per_ip.load(std::sync::atomic::Ordering::Relaxed);
    assert!(now > refused, "counted");
    // The four held ones still work; one closed frees a place.
    let mut s = held.pop().unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    assert_eq!(read_answer(&mut s).await.status, 200);
    drop(s);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let a = exchange(addr, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
    assert_eq!(a.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_failing_authentication_is_answered_429_but_a_valid_key_passes() {
    let mut config = GatewayConfig::default();
    config.edge.unauthenticated_per_ip_per_minute = 5;
    let (addr, key, _dir) = gateway(Net::new(stream_ok()), config, None).await;
    let bad = format!("gnus_{}", "0".repeat(64));
    for i in 0..5 {
        let a = exchange(addr, &post("/v1/chat/completions", Some(&bad), &chat(false))).await;
        let v = a.assert_envelope(401);
        assert_eq!(v["error"]["code"], "invalid_api_key", "request {i}");
    }
    let t0 = Instant::now();
    let a = exchange(addr, &post("/v1/chat/completions", Some(&bad), &chat(false))).await;
    let v = a.assert_envelope(429);
    assert_eq!(v["error"]["code"], "too_many_authentication_failures");
    assert!(a.head.contains("retry-after: "), "{}", a.head);
    assert!(t0.elapsed() < Duration::from_millis(500));
    // No key at all is limited the same way.
    let get = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    exchange(addr, get).await.assert_envelope(429);
    // A neighbour behind the same address with a valid key is served.
    let ok = format!(
        "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n"
    );
    let a = exchange(addr, ok.as_bytes()).await;
    assert_eq!(a.status, 200, "{}", a.body);
    // Routes outside /v1/ are not limited.
    assert_eq!(
        exchange(addr, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .status,
        200
    );
    assert!(metric(&metrics(addr).await, "gcs_http_unauthenticated_limited_total") >= 2);
}

fn fail(kind: &str, code: &str, leased: bool) -> Script {
    Script::Fail {
        after: Duration::from_millis(150),
        leased,
        error: ErrorInfo { kind: kind.into(), code: code.into(), message: "scripted".into() },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_fails_before_its_first_chunk_gets_its_status_as_json() {
    let net = Net::new(fail("service_unavailable", "gnus_no_capable_nodes", false));
    let (addr, key, _dir) = gateway(net.clone(), GatewayConfig::default(), None).await;
    let cases = [
        (fail("service_unavailable", "gnus_no_capable_nodes", false), 503, true),
        (fail("timeout", "gnus_wall_timeout", true), 504, false),
        (fail("invalid_request_error", "gnus_prompt_too_long", true), 400, false),
        (fail("server_error", "gnus_requeue_exhausted", true), 500, false),
    ];
    for (script, status, retry_after) in cases {
        *net.script.lock().unwrap() = script;
        let a = exchange(addr, &post("/v1/chat/completions", Some(&key), &chat(true))).await;
        a.assert_envelope(status);
        assert!(!a.head.contains("text/event-stream"), "{}", a.head);
        assert_eq!(a.head.contains("retry-after:"), retry_after, "{}", a.head);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_commits_at_its_first_chunk_or_after_the_hold() {
    let config = GatewayConfig { stream_hold: Duration::from_millis(400), ..Default::default() };
    let net = Net::new(stream_ok());
    let (addr, key, _dir) = gateway(net.clone(), config, None).await;
    // A normal stream: 200, SSE, every token, [DONE].
    let a = exchange(addr, &post("/v1/chat/completions", Some(&key), &chat(true))).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.head.contains("content-type: text/event-stream"), "{}", a.head);
    assert!(a.body.starts_with(": gcs job accepted"), "{}", a.body);
    assert_eq!(a.body.matches("tok ").count(), 3, "{}", a.body);
    assert!(a.body.contains("data: [DONE]"), "{}", a.body);
    // A job that says nothing: headers after the hold, then the stream goes
    // on as before (keepalive due at once, since the hold took longer than
    // nothing), and the client may hang up.
    *net.script.lock().unwrap() = Script::Silent;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let t0 = Instant::now();
    s.write_all(&post("/v1/chat/completions", Some(&key), &chat(true))).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf)).await.unwrap().unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase();
    let waited = t0.elapsed();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("text/event-stream"), "{head}");
    assert!(waited >= Duration::from_millis(350) && waited < Duration::from_secs(2), "{waited:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_count_their_jobs_against_rpm_and_the_per_request_cap() {
    let config = GatewayConfig { embed_batch: 4, max_jobs_per_request: 4, ..Default::default() };
    let net = Net::new(Script::Embed);
    let (addr, key, _dir) = gateway(net.clone(), config, Some(6)).await;
    let embed = |n: usize| {
        let input: Vec<String> = (0..n).map(|i| format!("text {i}")).collect();
        serde_json::json!({"model": "gnus-embed", "input": input}).to_string()
    };
    // 12 inputs at 4 a job: 3 jobs of this key's 6 per minute.
    let a = exchange(addr, &post("/v1/embeddings", Some(&key), &embed(12))).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.json()["data"].as_array().unwrap().len(), 12);
    assert_eq!(net.submitted(), 3);
    // 40 inputs: past 4 jobs of 4, so 4 jobs of 10 — 7 of 6 in the minute.
    let a = exchange(addr, &post("/v1/embeddings", Some(&key), &embed(40))).await;
    let v = a.assert_envelope(429);
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert_eq!(net.submitted(), 3, "a refused request submits nothing");
    // More inputs than 4 jobs of 64 can carry: a clear 400.
    let a = exchange(addr, &post("/v1/embeddings", Some(&key), &embed(257))).await;
    let v = a.assert_envelope(400);
    assert_eq!(v["error"]["param"], "input");
    // More choices than the cap.
    let body = serde_json::json!({"model": "gnus-auto", "n": 5,
                                  "messages": [{"role": "user", "content": "hi"}]});
    let a = exchange(addr, &post("/v1/chat/completions", Some(&key), &body.to_string())).await;
    let v = a.assert_envelope(400);
    assert_eq!(v["error"]["param"], "n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_flight_limit_counts_jobs() {
    let config = GatewayConfig {
        max_in_flight: 4,
        stream_hold: Duration::from_millis(50),
        ..Default::default()
    };
    let net = Net::new(Script::Silent);
    let (addr, key, _dir) = gateway(net.clone(), config, None).await;
    let body = |n: u32| {
        serde_json::json!({"model": "gnus-auto", "n": n, "stream": true,
                           "messages": [{"role": "user", "content": "hi"}]})
        .to_string()
    };
    // A stream of 3 choices holds 3 of 4 places while it runs.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&post("/v1/chat/completions", Some(&key), &body(3))).await.unwrap();
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf)).await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let a = exchange(addr, &post("/v1/chat/completions", Some(&key), &body(2))).await;
    let v = a.assert_envelope(429);
    assert_eq!(v["error"]["code"], "gateway_overloaded");
    assert_eq!(net.submitted(), 3);
    // Once it ends (the client hangs up), its places are free again.
    drop(s);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&post("/v1/chat/completions", Some(&key), &body(2))).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf)).await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
}

/// `gateway_local` (26.11.3): only this gateway's own worker or one it
/// attached (a `gateway_worker` certificate of its key) can win the job;
/// without a fresh registration of either, the answer is a 503 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_local_request_without_an_attached_worker_is_a_503_at_once() {
    let body = serde_json::json!({"model": "gnus-auto", "max_tokens": 8,
                                  "messages": [{"role": "user", "content": "hi"}],
                                  "gnus": {"network": "gateway_local"}})
    .to_string();
    let elsewhere = gcs_protocol::NodeKey::from_seed([9; 32]).node_id().to_string();
    let config = GatewayConfig { gateway_id: elsewhere, ..Default::default() };
    let net = Net::new(stream_ok());
    let (addr, key, _dir) = gateway(net.clone(), config, None).await;
    let a = exchange(addr, &post("/v1/chat/completions", Some(&key), &body)).await;
    let v = a.assert_envelope(503);
    assert_eq!(v["error"]["code"], "gnus_no_capable_nodes", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("gateway_local"), "{v}");
    assert_eq!(net.submitted(), 0, "nothing published");
    // The registered worker is this gateway's own (`--role all`): routable.
    let me = gcs_protocol::samples::keys().0.node_id().to_string();
    let config = GatewayConfig { gateway_id: me, ..Default::default() };
    let net = Net::new(stream_ok());
    let (addr, key, _dir) = gateway(net.clone(), config, None).await;
    let a = exchange(addr, &post("/v1/chat/completions", Some(&key), &body)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(net.submitted(), 1);
}
