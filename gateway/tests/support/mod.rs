//! A scripted network behind the real gateway router, served over real TCP
//! by `serve_with`: each test of an edge rule decides what the network does
//! with a job (fail before any token, stream, stay silent, embed), and
//! speaks raw HTTP/1.1 to the edge. Traffic goes to 127.0.0.1 only.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gcs_gateway::serve::serve_with;
use gcs_gateway::{Backend, BackendError, BoxFuture, GatewayConfig, JobEvent, JobSpec, KeyStore};
use gcs_protocol::samples::{self, Params};
use gcs_protocol::{
    ApiType, CancellationReason, ErrorInfo, ModelInfo, NodeRegistration, ResponseBody, UsageRecord,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// What the network does with each job.
#[derive(Clone, Debug)]
pub enum Script {
    /// Fails after `after`, before any chunk (optionally after a lease).
    Fail { after: Duration, leased: bool, error: ErrorInfo },
    /// Leases at once, sends `tokens` chunks `gap` apart, completes.
    Stream { first_after: Duration, gap: Duration, tokens: u64 },
    /// Leases at once, sends each piece as one chunk, completes (a
    /// worker's generated text, as it would stream it).
    Text(Vec<String>),
    /// An exact continuation's seam: leases, sends `before` chunks, is
    /// silent for `lost` (the holder lost), leases again (the
    /// continuation's grant), is silent for `replay`, sends `after` more
    /// chunks, completes.
    Seam { before: u64, lost: Duration, replay: Duration, after: u64 },
    /// Never says anything.
    Silent,
    /// Completes an embeddings job: one 3-float vector per input.
    Embed,
    /// As `Embed`, except that the `nth` job submitted (0-based) fails
    /// with `error` after `after`; the others complete after 20 × `after`
    /// (unless cancelled first).
    EmbedFailing { nth: usize, after: Duration, error: ErrorInfo },
}

/// The scripted network.
#[derive(Debug)]
pub struct Net {
    pub script: Mutex<Script>,
    pub jobs: Mutex<Vec<JobSpec>>,
    pub cancelled: AtomicUsize,
    /// One usage record per `Stream` job (1 prompt token + its tokens),
    /// naming the job's batch as the node's tracker does.
    pub usage: Mutex<Vec<UsageRecord>>,
    /// The parents' roll-ups the gateway recorded.
    pub parents: Mutex<Vec<gcs_gateway::ParentUsage>>,
    /// The ids of the jobs cancelled, in order.
    pub cancelled_ids: Mutex<Vec<String>>,
    /// `(tenant, batch id, the batch)` another gateway of the tenant
    /// created, as `find_batch` finds it.
    pub found: Mutex<Option<(String, String, gcs_gateway::backend::FoundBatch)>>,
    /// What `collect` answers for every task.
    pub progress: Mutex<gcs_gateway::backend::TaskProgress>,
    /// The tasks `cancel_task` was asked to cancel (each is then reported
    /// cancelled by `collect`).
    pub tasks_cancelled: Mutex<Vec<String>>,
    /// The chat model's decode speed the registration advertises (0: none).
    pub decode_speed: Mutex<f64>,
    next: AtomicUsize,
}

impl Net {
    pub fn new(script: Script) -> Arc<Net> {
        Arc::new(Net {
            script: Mutex::new(script),
            jobs: Mutex::default(),
            cancelled: AtomicUsize::new(0),
            usage: Mutex::default(),
            parents: Mutex::default(),
            cancelled_ids: Mutex::default(),
            found: Mutex::default(),
            progress: Mutex::default(),
            tasks_cancelled: Mutex::default(),
            decode_speed: Mutex::new(0.0),
            next: AtomicUsize::new(0),
        })
    }

    pub fn submitted(&self) -> usize {
        self.jobs.lock().unwrap().len()
    }
}

/// A fresh registration serving the chat model of the samples and an
/// embedder.
fn registration() -> NodeRegistration {
    let (worker, _) = samples::keys();
    let now = gcs_protocol::now_ms();
    let mut r = samples::registration(&worker, &Params { now_ms: now, ..Params::default() });
    // SmolLM2's vocabulary, so the edge can check logit_bias ids.
    r.models[0].vocab_size = 49_152;
    r.models.push(ModelInfo {
        model_id: "all-minilm-l6-v2".into(),
        aliases: vec!["gnus-embed".into()],
        context_tokens: 256,
        quantization: "f32".into(),
        backend: "burn-flex".into(),
        tasks: vec![ApiType::Embedding],
        vocab_size: 30_522,
        ..Default::default()
    });
    r
}

fn chunk(job: &str, seq: u64, text: &str) -> JobEvent {
    let (worker, _) = samples::keys();
    let mut c = samples::chunk(&worker, &Params { text: text.into(), n: seq, ..Params::default() });
    c.job_id = job.into();
    JobEvent::Chunk(Box::new(c))
}

fn completed(job: &str, tokens: u64, embed_inputs: Option<usize>) -> JobEvent {
    let (worker, _) = samples::keys();
    let mut r = samples::final_result(&worker, &Params { n: tokens, ..Params::default() });
    r.job_id = job.into();
    if let Some(n) = embed_inputs {
        let data: Vec<_> = (0..n)
            .map(|i| serde_json::json!({"object": "embedding", "index": i, "embedding": [0.5, 0.25, 1.0]}))
            .collect();
        r.response = Some(ResponseBody {
            format: "openai.embedding".into(),
            body: serde_json::json!({"object": "list", "data": data}),
        });
    }
    JobEvent::Completed(Box::new(r))
}

impl Backend for Net {
    fn submit(
        &self,
        spec: JobSpec,
    ) -> BoxFuture<'_, Result<(String, mpsc::Receiver<JobEvent>), BackendError>> {
        let nth = self.next.fetch_add(1, Ordering::Relaxed);
        let id = format!("job_{nth}");
        let inputs = match gcs_gateway::payload::JobRequest::decode(&spec.body) {
            Ok(gcs_gateway::payload::JobRequest::Embedding(e)) => Some(e.inputs.len()),
            _ => None,
        };
        let script = self.script.lock().unwrap().clone();
        if let Script::Stream { tokens, .. } = &script {
            let (w, g) = samples::keys();
            let mut u = samples::usage(&w, &g, &Params::default());
            (u.job_id, u.api_key_id, u.tenant_id) =
                (id.clone(), spec.api_key_id.clone(), spec.tenant_id.clone());
            (u.input_tokens, u.cached_tokens) = (1, 0);
            (u.output_tokens_generated, u.output_tokens_sent_to_client) = (*tokens, *tokens);
            (u.batch_id, u.created_at_ms) = (spec.batch_id.clone(), gcs_protocol::now_ms());
            u.price_percent = spec.price_percent;
            self.usage.lock().unwrap().push(u);
        }
        self.jobs.lock().unwrap().push(spec);
        let (tx, rx) = mpsc::channel(64);
        let job = id.clone();
        let node_id = samples::keys().0.node_id();
        tokio::spawn(async move {
            match script {
                Script::Fail { after, leased, error } => {
                    if leased {
                        let _ = tx.send(JobEvent::Leased { node_id }).await;
                    }
                    tokio::time::sleep(after).await;
                    let _ = tx.send(JobEvent::Failed { error, after_partial_output: false }).await;
                }
                Script::Stream { first_after, gap, tokens } => {
                    let _ = tx.send(JobEvent::Leased { node_id }).await;
                    tokio::time::sleep(first_after).await;
                    for i in 0..tokens {
                        if i > 0 {
                            tokio::time::sleep(gap).await;
                        }
                        if tx.send(chunk(&job, i, "tok ")).await.is_err() {
                            return;
                        }
                    }
                    let _ = tx.send(completed(&job, tokens, None)).await;
                }
                Script::Text(pieces) => {
                    let _ = tx.send(JobEvent::Leased { node_id }).await;
                    for (i, p) in pieces.iter().enumerate() {
                        if tx.send(chunk(&job, i as u64, p)).await.is_err() {
                            return;
                        }
                    }
                    let _ = tx.send(completed(&job, pieces.len() as u64, None)).await;
                }
                Script::Seam { before, lost, replay, after } => {
                    let _ = tx.send(JobEvent::Leased { node_id: node_id.clone() }).await;
                    for i in 0..before {
                        let _ = tx.send(chunk(&job, i, "tok ")).await;
                    }
                    tokio::time::sleep(lost).await;
                    let _ = tx.send(JobEvent::Leased { node_id }).await;
                    tokio::time::sleep(replay).await;
                    for i in before..before + after {
                        if tx.send(chunk(&job, i, "tok ")).await.is_err() {
                            return;
                        }
                    }
                    let _ = tx.send(completed(&job, before + after, None)).await;
                }
                Script::Silent => {
                    tx.closed().await;
                }
                Script::Embed => {
                    let _ = tx.send(JobEvent::Leased { node_id }).await;
                    let _ = tx.send(completed(&job, 0, inputs)).await;
                }
                Script::EmbedFailing { nth: bad, after, error } => {
                    let _ = tx.send(JobEvent::Leased { node_id }).await;
                    let wait = if nth == bad { after } else { after * 20 };
                    tokio::time::sleep(wait).await;
                    let ev = if nth == bad {
                        JobEvent::Failed { error, after_partial_output: false }
                    } else {
                        completed(&job, 0, inputs)
                    };
                    let _ = tx.send(ev).await;
                }
            }
        });
        Box::pin(async move { Ok((id, rx)) })
    }

    fn cancel(&self, job_id: String, _reason: CancellationReason) -> BoxFuture<'_, ()> {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
        self.cancelled_ids.lock().unwrap().push(job_id);
        Box::pin(async {})
    }

    fn registrations(&self) -> Vec<NodeRegistration> {
        let mut r = registration();
        r.models[0].decode_tokens_per_s = *self.decode_speed.lock().unwrap();
        vec![r]
    }

    fn record_parent(
        &self,
        parent: gcs_gateway::ParentUsage,
    ) -> BoxFuture<'_, Result<(), BackendError>> {
        self.parents.lock().unwrap().push(parent);
        Box::pin(async { Ok(()) })
    }

    fn find_batch(
        &self,
        tenant_id: String,
        batch_id: String,
    ) -> BoxFuture<'_, Result<Option<gcs_gateway::backend::FoundBatch>, BackendError>> {
        let f = self.found.lock().unwrap().clone();
        let hit = f.filter(|(t, b, _)| *t == tenant_id && *b == batch_id).map(|(_, _, f)| f);
        Box::pin(async move { Ok(hit) })
    }

    fn cancel_task(&self, task_id: String) -> BoxFuture<'_, Result<(), BackendError>> {
        self.tasks_cancelled.lock().unwrap().push(task_id);
        self.progress.lock().unwrap().cancelled = true;
        Box::pin(async { Ok(()) })
    }

    fn collect(
        &self,
        _task_id: String,
        _meter: gcs_gateway::backend::ProcessingMeter,
        _skip: Arc<std::collections::HashSet<u64>>,
    ) -> BoxFuture<'_, Result<gcs_gateway::backend::TaskProgress, BackendError>> {
        let p = self.progress.lock().unwrap().clone();
        Box::pin(async move { Ok(p) })
    }

    fn usage(&self, key: &str, since: u64, until: u64) -> Result<Vec<UsageRecord>, BackendError> {
        let all = self.usage.lock().unwrap();
        let of =
            |u: &&UsageRecord| u.api_key_id == key && (since..until).contains(&u.created_at_ms);
        Ok(all.iter().filter(of).cloned().collect())
    }
}

/// A gateway over `net` on 127.0.0.1: its address, a valid key, and the
/// key store's directory (kept alive by the caller).
pub async fn gateway(
    net: Arc<Net>,
    config: GatewayConfig,
    rpm: Option<u32>,
) -> (std::net::SocketAddr, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let keys = Arc::new(KeyStore::new(dir.path()));
    let new = gcs_gateway::NewKey {
        tenant_id: "t".into(),
        project_id: "p".into(),
        rpm,
        ..Default::default()
    };
    let (secret, _) = keys.create(new, gcs_protocol::now_ms()).unwrap();
    let edge = config.edge.clone();
    let app = gcs_gateway::router(net, keys, config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve_with(listener, app, None, edge, std::future::pending()));
    (addr, secret, dir)
}

/// A response: status, lower-cased head, body (de-chunked when chunked).
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.head, self.body))
    }

    /// Asserts an OpenAI error envelope with this status and a string code.
    pub fn assert_envelope(&self, status: u16) -> serde_json::Value {
        assert_eq!(self.status, status, "{} {}", self.head, self.body);
        assert!(self.head.contains("content-type: application/json"), "{}", self.head);
        let v = self.json();
        let e = &v["error"];
        assert!(e["message"].is_string() && e["type"].is_string(), "{v}");
        assert!(e["code"].is_string(), "{v}");
        assert!(e.as_object().unwrap().contains_key("param"), "{v}");
        v
    }
}

fn dechunk(raw: &str) -> String {
    let mut out = String::new();
    let mut rest = raw;
    while let Some((len, tail)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(len.trim(), 16) else { break };
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

/// Sends `raw` (a whole request) on a fresh connection, reads to EOF.
pub async fn exchange(addr: std::net::SocketAddr, raw: &[u8]) -> Answer {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(raw).await.unwrap();
    read_answer(&mut s).await
}

/// Reads one response to EOF (requests say `Connection: close`).
pub async fn read_answer(s: &mut TcpStream) -> Answer {
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut buf))
        .await
        .expect("an answer within 20 s")
        .ok();
    let text = String::from_utf8_lossy(&buf).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let head = head.to_ascii_lowercase();
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body =
        if head.contains("transfer-encoding: chunked") { dechunk(body) } else { body.into() };
    Answer { status, head, body }
}

/// A POST with a JSON body and the key (if any), `Connection: close`.
pub fn post(path: &str, key: Option<&str>, body: &str) -> Vec<u8> {
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A chat body for the samples' model.
pub fn chat(stream: bool) -> String {
    serde_json::json!({"model": "gnus-auto", "stream": stream, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "hi"}]})
    .to_string()
}

/// `GET /metrics` as text.
pub async fn metrics(addr: std::net::SocketAddr) -> String {
    exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .await
        .body
}

/// The value of one unlabelled metric.
pub fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name}"))
}
