//! The Files and Batch APIs over real HTTP in front of the scripted network
//! of `support` (specs/batch.md): per-tenant files, size and line bounds,
//! batches that validate, run, cancel, resume after a restart, and leave
//! interactive requests their places.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use gcs_gateway::serve::serve_with;
use gcs_gateway::{GatewayConfig, KeyStore, NewKey};
use serde_json::{json, Value};
use support::{exchange, post, Answer, Net, Script};
use tokio::net::TcpListener;

struct Gw {
    addr: std::net::SocketAddr,
    /// Tenant `t`.
    key: String,
    /// Tenant `u`.
    other: String,
}

/// A gateway over `net` with one key of tenant `t` and one of tenant `u`,
/// its data in `dir`.
async fn gateway(net: Arc<Net>, config: GatewayConfig, dir: &std::path::Path) -> Gw {
    let keys = Arc::new(KeyStore::new(dir));
    let mk = |t: &str| {
        let new = NewKey { tenant_id: t.into(), project_id: "p".into(), ..Default::default() };
        keys.create(new, gcs_protocol::now_ms()).unwrap().0
    };
    let (key, other) = (mk("t"), mk("u"));
    serve(net, config, keys).await.with_keys(key, other)
}

async fn serve(net: Arc<Net>, config: GatewayConfig, keys: Arc<KeyStore>) -> Gw {
    let edge = config.edge.clone();
    let app = gcs_gateway::router(net, keys, config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve_with(listener, app, None, edge, std::future::pending()));
    Gw { addr, key: String::new(), other: String::new() }
}

impl Gw {
    fn with_keys(mut self, key: String, other: String) -> Self {
        (self.key, self.other) = (key, other);
        self
    }

    async fn get(&self, path: &str, key: &str) -> Answer {
        let raw = format!(
            "GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n"
        );
        exchange(self.addr, raw.as_bytes()).await
    }

    async fn delete(&self, path: &str, key: &str) -> Answer {
        let raw = format!(
            "DELETE {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n"
        );
        exchange(self.addr, raw.as_bytes()).await
    }

    async fn post(&self, path: &str, key: &str, body: &Value) -> Answer {
        exchange(self.addr, &post(path, Some(key), &body.to_string())).await
    }

    async fn upload(&self, key: &str, purpose: &str, data: &[u8]) -> Answer {
        let b = "gcsboundary42";
        let mut body = format!(
            "--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n{purpose}\r\n--{b}\r\n\
             Content-Disposition: form-data; name=\"file\"; filename=\"../in.jsonl\"\r\n\
             Content-Type: application/jsonl\r\n\r\n"
        )
        .into_bytes();
        body.extend_from_slice(data);
        body.extend_from_slice(format!("\r\n--{b}--\r\n").as_bytes());
        let mut raw = format!(
            "POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
             Content-Type: multipart/form-data; boundary={b}\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        raw.extend_from_slice(&body);
        exchange(self.addr, &raw).await
    }

    /// Uploads `data` and creates a batch of it for `endpoint`.
    async fn batch(&self, endpoint: &str, data: &str) -> Value {
        let f = self.upload(&self.key, "batch", data.as_bytes()).await;
        assert_eq!(f.status, 200, "{}", f.body);
        let body = json!({"input_file_id": f.json()["id"], "endpoint": endpoint,
                          "completion_window": "24h", "metadata": {"run": "test"}});
        let b = self.post("/v1/batches", &self.key, &body).await;
        assert_eq!(b.status, 200, "{}", b.body);
        b.json()
    }

    /// Polls the batch until `done` holds for it (20 s at most).
    async fn until(&self, id: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let b = self.get(&format!("/v1/batches/{id}"), &self.key).await.json();
            if done(&b) {
                return b;
            }
            assert!(Instant::now() < deadline, "batch never got there: {b}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The JSONL lines of a file.
    async fn lines(&self, file_id: &Value) -> Vec<Value> {
        let a =
            self.get(&format!("/v1/files/{}/content", file_id.as_str().unwrap()), &self.key).await;
        assert_eq!(a.status, 200, "{}", a.body);
        a.body.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    }
}

fn chat_lines(n: usize) -> String {
    (0..n)
        .map(|i| {
            json!({"custom_id": format!("req-{i}"), "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": "gnus-auto", "max_tokens": 3,
                            "messages": [{"role": "user", "content": format!("q{i}")}]}})
            .to_string()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn status_is(s: &'static str) -> impl Fn(&Value) -> bool {
    move |b| b["status"] == s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_are_per_tenant_and_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = GatewayConfig::default();
    config.files.max_file_bytes = 2000;
    config.files.max_lines = 5;
    let gw = gateway(Net::new(Script::Embed), config, dir.path()).await;
    let data = b"{\"a\":1}\n{\"b\":2}\n";
    let f = gw.upload(&gw.key, "batch", data).await;
    assert_eq!(f.status, 200, "{}", f.body);
    let f = f.json();
    let id = f["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("file-"), "{f}");
    assert_eq!((f["object"].as_str(), f["bytes"].as_u64()), (Some("file"), Some(16)));
    assert_eq!((f["purpose"].as_str(), f["filename"].as_str()), (Some("batch"), Some("in.jsonl")));
    assert_eq!(f["status"], "processed");
    assert_eq!(gw.get(&format!("/v1/files/{id}"), &gw.key).await.json(), f);
    let c = gw.get(&format!("/v1/files/{id}/content"), &gw.key).await;
    assert_eq!(c.body.as_bytes(), data);
    let l = gw.get("/v1/files", &gw.key).await.json();
    assert_eq!(l["data"][0]["id"], id.as_str());

    // Another tenant's key sees nothing, and cannot delete.
    for path in [format!("/v1/files/{id}"), format!("/v1/files/{id}/content")] {
        gw.get(&path, &gw.other).await.assert_envelope(404);
    }
    gw.delete(&format!("/v1/files/{id}"), &gw.other).await.assert_envelope(404);
    assert_eq!(gw.get("/v1/files", &gw.other).await.json()["data"], json!([]));

    // Bounds: size (413), lines, purpose, no key.
    let big = vec![b'x'; 2001];
    let e = gw.upload(&gw.key, "batch", &big).await.assert_envelope(413);
    assert_eq!(e["error"]["code"], "request_too_large");
    let many = "{}\n".repeat(6);
    let e = gw.upload(&gw.key, "batch", many.as_bytes()).await.assert_envelope(400);
    assert!(e["error"]["message"].as_str().unwrap().contains("at most 5"), "{e}");
    let e = gw.upload(&gw.key, "fine-tune", data).await.assert_envelope(400);
    assert_eq!(e["error"]["param"], "purpose");
    gw.upload("gnus_wrong", "batch", data).await.assert_envelope(401);

    let d = gw.delete(&format!("/v1/files/{id}"), &gw.key).await.json();
    assert_eq!(d, json!({"id": id, "object": "file", "deleted": true}));
    gw.get(&format!("/v1/files/{id}"), &gw.key).await.assert_envelope(404);
}

/// A file larger than one read of the download comes back whole, with its
/// length announced (the content is streamed from disk, not held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_file_downloads_whole() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(Net::new(Script::Embed), GatewayConfig::default(), dir.path()).await;
    let data: String = (0..3000).map(|i| format!("{{\"custom_id\":\"line-{i:05}\",\"pad\":\"{}\"}}\n", "x".repeat(i % 97))).collect();
    assert!(data.len() > 3 * 64 * 1024, "{}", data.len());
    let f = gw.upload(&gw.key, "batch", data.as_bytes()).await;
    assert_eq!(f.status, 200, "{}", f.body);
    let id = f.json()["id"].as_str().unwrap().to_string();
    let c = gw.get(&format!("/v1/files/{id}/content"), &gw.key).await;
    assert_eq!(c.status, 200);
    assert_eq!(c.body.len(), data.len());
    assert!(c.body == data, "the bytes differ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_runs_its_requests_as_its_key_and_writes_openai_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let net =
        Net::new(Script::Stream { first_after: Duration::ZERO, gap: Duration::ZERO, tokens: 3 });
    let gw = gateway(net.clone(), GatewayConfig::default(), dir.path()).await;
    let b = gw.batch("/v1/chat/completions", &chat_lines(6)).await;
    let id = b["id"].as_str().unwrap();
    assert!(id.starts_with("batch_"), "{b}");
    assert_eq!(
        (b["object"].as_str(), b["completion_window"].as_str()),
        (Some("batch"), Some("24h"))
    );
    assert_eq!(b["metadata"], json!({"run": "test"}));
    let b = gw.until(id, status_is("completed")).await;
    assert_eq!(b["request_counts"], json!({"total": 6, "completed": 6, "failed": 0}), "{b}");
    assert!(b["error_file_id"].is_null(), "{b}");
    for k in ["in_progress_at", "finalizing_at", "completed_at"] {
        assert!(b[k].as_u64().is_some(), "{k}: {b}");
    }
    let out = gw.lines(&b["output_file_id"]).await;
    let ids: Vec<&str> = out.iter().map(|l| l["custom_id"].as_str().unwrap()).collect();
    assert_eq!(ids, (0..6).map(|i| format!("req-{i}")).collect::<Vec<_>>());
    for l in &out {
        assert_eq!(l["response"]["status_code"], 200, "{l}");
        assert!(l["id"].as_str().unwrap().starts_with("batch_req_"), "{l}");
        assert!(l["response"]["request_id"].is_string(), "{l}");
        let body = &l["response"]["body"];
        assert_eq!(body["object"], "chat.completion", "{l}");
        assert_eq!(body["choices"][0]["message"]["content"], "tok tok tok ", "{l}");
        assert!(l["error"].is_null());
    }
    {
        let sum = |k: &str| -> u64 {
            out.iter().map(|l| l["response"]["body"]["usage"][k].as_u64().unwrap()).sum()
        };
        let (i, o) = (sum("prompt_tokens"), sum("completion_tokens"));
        assert!(o >= 18, "3 tokens a request: {o}");
        assert_eq!(b["usage"]["input_tokens"], i, "{b}");
        assert_eq!(b["usage"]["output_tokens"], o, "{b}");
        assert_eq!(b["usage"]["total_tokens"], i + o, "{b}");
        let jobs = net.jobs.lock().unwrap();
        assert_eq!(jobs.len(), 6);
        assert!(jobs.iter().all(|j| j.tenant_id == "t" && j.idempotency_key.starts_with(id)));
    }
    // The output belongs to the tenant, as a batch_output file.
    let f = gw.get(&format!("/v1/files/{}", b["output_file_id"].as_str().unwrap()), &gw.key).await;
    assert_eq!(f.json()["purpose"], "batch_output");
    gw.get(&format!("/v1/batches/{id}"), &gw.other).await.assert_envelope(404);
    let l = gw.get("/v1/batches?limit=1", &gw.key).await.json();
    assert_eq!((l["data"][0]["id"].as_str(), l["has_more"].as_bool()), (Some(id), Some(false)));
    let e = gw.post(&format!("/v1/batches/{id}/cancel"), &gw.key, &json!({})).await;
    e.assert_envelope(409);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_input_fails_validation_with_the_errors_of_its_lines() {
    let dir = tempfile::tempdir().unwrap();
    let net = Net::new(Script::Embed);
    let gw = gateway(net.clone(), GatewayConfig::default(), dir.path()).await;
    let good = |id: &str, model: &str| {
        json!({"custom_id": id, "method": "POST", "url": "/v1/embeddings",
               "body": {"model": model, "input": "hello"}})
        .to_string()
    };
    let input = [good("a", "gnus-embed"), "{oops".into(), good("a", "gnus-embed")].join("\n");
    let b = gw.batch("/v1/embeddings", &input).await;
    let b = gw.until(b["id"].as_str().unwrap(), status_is("failed")).await;
    let errs: Vec<(&str, u64)> = b["errors"]["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["code"].as_str().unwrap(), e["line"].as_u64().unwrap()))
        .collect();
    assert_eq!(errs, [("invalid_json_line", 2), ("duplicate_custom_id", 3)], "{b}");
    assert!(b["failed_at"].as_u64().is_some());
    // An unknown model is caught before anything runs.
    let input = [good("a", "gnus-embed"), good("b", "no-such-model")].join("\n");
    let b = gw.batch("/v1/embeddings", &input).await;
    let b = gw.until(b["id"].as_str().unwrap(), status_is("failed")).await;
    assert_eq!(b["errors"]["data"][0]["code"], "model_not_found", "{b}");
    assert_eq!(b["errors"]["data"][0]["line"], 2);
    assert_eq!(net.submitted(), 0, "nothing ran");
    // Bad creation requests are refused at once.
    let e = gw
        .post(
            "/v1/batches",
            &gw.key,
            &json!({"input_file_id": "file-x", "endpoint": "/v1/embeddings",
                                              "completion_window": "24h"}),
        )
        .await
        .assert_envelope(404);
    assert_eq!(e["error"]["code"], "file_not_found");
    let e = gw
        .post(
            "/v1/batches",
            &gw.key,
            &json!({"input_file_id": "file-x", "endpoint": "/v1/embeddings",
                                              "completion_window": "1h"}),
        )
        .await
        .assert_envelope(400);
    assert_eq!(e["error"]["param"], "completion_window");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_batch_stops_its_requests_and_ends_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let net = Net::new(Script::Silent);
    let gw = gateway(net.clone(), GatewayConfig::default(), dir.path()).await;
    let b = gw.batch("/v1/chat/completions", &chat_lines(10)).await;
    let id = b["id"].as_str().unwrap();
    gw.until(id, status_is("in_progress")).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while net.submitted() < 4 {
        assert!(Instant::now() < deadline, "the batch's requests never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(net.submitted(), 4, "at most per_batch requests in flight");
    let c = gw.post(&format!("/v1/batches/{id}/cancel"), &gw.key, &json!({})).await.json();
    assert!(matches!(c["status"].as_str(), Some("cancelling" | "cancelled")), "{c}");
    let b = gw.until(id, status_is("cancelled")).await;
    assert!(b["cancelling_at"].as_u64().is_some() && b["cancelled_at"].as_u64().is_some());
    assert_eq!(b["request_counts"]["completed"], 0, "{b}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while net.cancelled.load(std::sync::atomic::Ordering::Relaxed) < 4 {
        assert!(Instant::now() < deadline, "in-flight requests were not cancelled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(net.submitted(), 4, "nothing started after the cancel");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_leaves_interactive_requests_half_of_the_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let net = Net::new(Script::Silent);
    let config = GatewayConfig {
        max_in_flight: 4,
        stream_hold: Duration::from_millis(50),
        ..Default::default()
    };
    let gw = gateway(net.clone(), config, dir.path()).await;
    let b = gw.batch("/v1/chat/completions", &chat_lines(10)).await;
    gw.until(b["id"].as_str().unwrap(), status_is("in_progress")).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(net.submitted(), 2, "a batch holds at most half of max_in_flight");
    // Two interactive streams are admitted beside it.
    for n in 3..=4 {
        let addr = gw.addr;
        let raw = post("/v1/chat/completions", Some(&gw.key), &support::chat(true));
        tokio::spawn(async move { exchange(addr, &raw).await });
        let deadline = Instant::now() + Duration::from_secs(5);
        while net.submitted() < n {
            assert!(Instant::now() < deadline, "interactive request {n} was not admitted");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(net.submitted(), 4, "the batch waits while interactive requests hold the rest");
}

/// A gateway "crash" (its runtime dropped mid-batch) and a fresh gateway
/// over the same data directory: the batch completes, every request once in
/// the output, and what finished before the crash does not run again.
#[test]
fn a_batch_resumes_after_a_gateway_restart() {
    let dir = tempfile::tempdir().unwrap();
    let slow =
        Script::Stream { first_after: Duration::from_millis(400), gap: Duration::ZERO, tokens: 1 };
    let rt1 = tokio::runtime::Runtime::new().unwrap();
    let (id, keys, seen) = rt1.block_on(async {
        let gw = gateway(Net::new(slow), GatewayConfig::default(), dir.path()).await;
        let b = gw.batch("/v1/chat/completions", &chat_lines(8)).await;
        let id = b["id"].as_str().unwrap().to_string();
        let b = gw.until(&id, |b| b["request_counts"]["completed"].as_u64() >= Some(1)).await;
        (id, (gw.key, gw.other), b["request_counts"]["completed"].as_u64().unwrap())
    });
    assert!(seen < 8, "the batch finished before the crash");
    rt1.shutdown_background();

    let rt2 = tokio::runtime::Runtime::new().unwrap();
    rt2.block_on(async {
        let net = Net::new(Script::Stream {
            first_after: Duration::ZERO,
            gap: Duration::ZERO,
            tokens: 1,
        });
        let store = Arc::new(KeyStore::new(dir.path()));
        let gw =
            serve(net.clone(), GatewayConfig::default(), store).await.with_keys(keys.0, keys.1);
        let b = gw.until(&id, status_is("completed")).await;
        assert_eq!(b["request_counts"], json!({"total": 8, "completed": 8, "failed": 0}), "{b}");
        let out = gw.lines(&b["output_file_id"]).await;
        let mut ids: Vec<&str> = out.iter().map(|l| l["custom_id"].as_str().unwrap()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 8, "every request exactly once: {out:?}");
        assert!(net.submitted() as u64 <= 8 - seen, "{} re-run, {seen} were done", net.submitted());
    });
}

/// A batch found at start with its 24 h window over: the requests not run
/// get `batch_expired` error lines and the batch ends `expired`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_past_its_window_ends_expired() {
    let dir = tempfile::tempdir().unwrap();
    let net = Net::new(Script::Embed);
    let gw = gateway(net.clone(), GatewayConfig::default(), dir.path()).await;
    let input = chat_lines(3);
    let f = gw.upload(&gw.key, "batch", input.as_bytes()).await.json();
    let now = gcs_protocol::now_ms() / 1000;
    let rec: gcs_gateway::batch::BatchRecord = serde_json::from_value(json!({
        "v": 1, "id": "batch_00112233445566778899aabb", "tenant_id": "t", "project_id": "p",
        "api_key_id": "key_x", "endpoint": "/v1/chat/completions", "input_file_id": f["id"],
        "completion_window": "24h", "metadata": null, "status": "in_progress",
        "created_at": now - 86_401, "expires_at": now - 1, "in_progress_at": now - 86_400,
        "finalizing_at": null, "completed_at": null, "failed_at": null, "expired_at": null,
        "cancelling_at": null, "cancelled_at": null, "total": 3, "completed": 0, "failed": 0,
        "input_tokens": 0, "output_tokens": 0,
        "output_file_id": null, "error_file_id": null, "errors": []}))
    .unwrap();
    gcs_gateway::batch::BatchStore::new(dir.path().join("batches")).save(&rec).unwrap();
    // A second gateway over the same directory resumes it at start.
    let gw2 = serve(net.clone(), GatewayConfig::default(), Arc::new(KeyStore::new(dir.path())))
        .await
        .with_keys(gw.key.clone(), gw.other.clone());
    let b = gw2.until(&rec.id, status_is("expired")).await;
    assert_eq!(b["request_counts"], json!({"total": 3, "completed": 0, "failed": 3}), "{b}");
    assert!(b["output_file_id"].is_null() && b["expired_at"].as_u64().is_some(), "{b}");
    let errs = gw2.lines(&b["error_file_id"]).await;
    assert_eq!(errs.len(), 3);
    assert!(errs.iter().all(|l| l["error"]["code"] == "batch_expired" && l["response"].is_null()));
    assert_eq!(net.submitted(), 0, "nothing ran past the window");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batchs_jobs_are_metered_under_its_id_and_spend_the_key_budget() {
    let dir = tempfile::tempdir().unwrap();
    let net =
        Net::new(Script::Stream { first_after: Duration::ZERO, gap: Duration::ZERO, tokens: 3 });
    let keys = Arc::new(KeyStore::new(dir.path()));
    // Each request reserves ~4 prompt tokens + max_tokens 3 and spends
    // 1 + 3: a budget of 30 covers a few of the 12 requests, not all.
    let new = NewKey {
        tenant_id: "t".into(),
        project_id: "p".into(),
        budget_tokens: Some(30),
        ..Default::default()
    };
    let key = keys.create(new, gcs_protocol::now_ms()).unwrap().0;
    // At the full price (the pricing test below takes the default).
    let config = GatewayConfig { batch_price_percent: 100, ..Default::default() };
    let gw = serve(net.clone(), config, keys).await.with_keys(key, String::new());
    let b = gw.batch("/v1/chat/completions", &chat_lines(12)).await;
    let id = b["id"].as_str().unwrap();
    let b = gw.until(id, status_is("completed")).await;
    let (ok, failed) =
        (b["request_counts"]["completed"].as_u64().unwrap(), b["request_counts"]["failed"].as_u64().unwrap());
    assert_eq!(ok + failed, 12, "{b}");
    assert!(ok >= 1 && failed >= 1, "the budget admits some requests, not all: {b}");
    assert!(ok * 4 <= 30, "no more was spent than the budget: {b}");
    // The requests past the budget are answered at once, not retried.
    let errs = gw.lines(&b["error_file_id"]).await;
    assert!(errs.iter().all(|l| l["response"]["status_code"] == 429
        && l["response"]["body"]["error"]["code"] == "insufficient_quota"), "{errs:?}");
    assert_eq!(net.submitted() as u64, ok, "one job per admitted request");
    assert!(net.jobs.lock().unwrap().iter().all(|j| j.batch_id.as_deref() == Some(id)));
    // /v1/usage names the batch on each record and can filter by it.
    let u = gw.get(&format!("/v1/usage?batch_id={id}"), &gw.key).await.json();
    let data = u["data"].as_array().unwrap();
    assert_eq!(data.len() as u64, ok, "{u}");
    assert!(data.iter().all(|r| r["batch_id"] == id), "{u}");
    let tokens: u64 = data
        .iter()
        .map(|r| r["input_tokens"].as_u64().unwrap() + r["output_tokens_generated"].as_u64().unwrap())
        .sum();
    assert_eq!(tokens, ok * 4, "{u}");
    let none = gw.get("/v1/usage?batch_id=batch_ffffffffffffffffffffffff", &gw.key).await.json();
    assert_eq!(none["data"], json!([]), "{none}");
    // An interactive request of the same key is now refused: the batch
    // spent its budget.
    let body = json!({"model": "gnus-auto", "max_tokens": 3,
                      "messages": [{"role": "user", "content": "q"}]});
    let a = gw.post("/v1/chat/completions", &gw.key, &body).await;
    assert_eq!(a.status, 429, "{}", a.body);
    assert_eq!(a.json()["error"]["code"], "insufficient_quota");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_work_is_charged_at_the_batch_price_with_its_real_tokens_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let net =
        Net::new(Script::Stream { first_after: Duration::ZERO, gap: Duration::ZERO, tokens: 3 });
    let keys = Arc::new(KeyStore::new(dir.path()));
    // Each scripted answer meters 100 + 3 tokens (its usage record 1 + 3):
    // 12 requests are 1236 at the full price, past a budget of 400; at 25 %
    // they are charged 12 × 26, so all of them fit.
    let new = NewKey {
        tenant_id: "t".into(),
        project_id: "p".into(),
        budget_tokens: Some(400),
        ..Default::default()
    };
    let key = keys.create(new, gcs_protocol::now_ms()).unwrap().0;
    let config = GatewayConfig { batch_price_percent: 25, ..Default::default() };
    let gw = serve(net.clone(), config, keys).await.with_keys(key, String::new());
    let b = gw.batch("/v1/chat/completions", &chat_lines(12)).await;
    let id = b["id"].as_str().unwrap();
    let b = gw.until(id, status_is("completed")).await;
    assert_eq!(b["request_counts"]["completed"], 12, "all fit at the batch price: {b}");
    assert!(net.jobs.lock().unwrap().iter().all(|j| j.price_percent == Some(25)));
    let u = gw.get(&format!("/v1/usage?batch_id={id}"), &gw.key).await.json();
    let data = u["data"].as_array().unwrap();
    assert_eq!(data.len(), 12, "{u}");
    for r in data {
        assert_eq!(r["price_percent"], 25, "{r}");
        let real = r["input_tokens"].as_u64().unwrap() + r["output_tokens_generated"].as_u64().unwrap();
        assert_eq!(real, 4, "the record keeps the real tokens: {r}");
        assert_eq!(r["charged_tokens"], 1, "25 % of 4: {r}");
    }
    // Interactive work of the same key pays the full price (its record: 4).
    let body = json!({"model": "gnus-auto", "max_tokens": 3,
                      "messages": [{"role": "user", "content": "q"}]});
    let a = gw.post("/v1/chat/completions", &gw.key, &body).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let u = gw.get("/v1/usage", &gw.key).await.json();
    let api: Vec<&Value> =
        u["data"].as_array().unwrap().iter().filter(|r| r["batch_id"].is_null()).collect();
    assert_eq!(api.len(), 1, "{u}");
    assert_eq!((api[0]["price_percent"].as_u64(), api[0]["charged_tokens"].as_u64()), (Some(100), Some(4)));
}
