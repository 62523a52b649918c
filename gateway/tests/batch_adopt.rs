//! A batch another gateway of the tenant created, taken over here
//! (specs/batch.md, "Adoption"), over real HTTP in front of the scripted
//! network of `support`: the network's `find_batch` holds the creator's
//! manifest and the requests' `custom_id`s, its `collect` the answers.
//! Only a key of the batch's tenant finds it; the batch is collected to
//! its output file here, and a cancel here, or in the network, ends it
//! `cancelled`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use gcs_gateway::backend::{FoundBatch, ProcessedLine, TaskProgress};
use gcs_gateway::serve::serve_with;
use gcs_gateway::{GatewayConfig, KeyStore, NewKey};
use serde_json::{json, Value};
use support::{exchange, post, Net, Script};
use tokio::net::TcpListener;

const ID: &str = "batch_0123456789abcdef01234567";

/// The creator's manifest of a 2-request chat batch of tenant `t`.
fn found() -> FoundBatch {
    found_of(ID)
}

fn found_of(id: &str) -> FoundBatch {
    let record = json!({"v": 1, "id": id, "tenant_id": "t", "project_id": "p",
        "api_key_id": "key_of_the_creator", "endpoint": "/v1/chat/completions",
        "input_file_id": "file-000000000000000000000000", "completion_window": "24h",
        "metadata": {"run": "adopted"}, "status": "in_progress",
        "created_at": gcs_protocol::now_ms() / 1000, "expires_at": gcs_protocol::now_ms() / 1000 + 86_400,
        "in_progress_at": 1, "finalizing_at": null, "completed_at": null, "failed_at": null,
        "expired_at": null, "cancelling_at": null, "cancelled_at": null,
        "total": 2, "completed": 0, "failed": 0, "output_file_id": null, "error_file_id": null,
        "errors": []});
    let manifest = json!({"v": 1, "record": record, "tasks": 1, "price_percent": 50});
    FoundBatch {
        creator: "gnusnode_creator".into(),
        manifest: manifest.to_string().into_bytes(),
        tasks: vec![("smollm2".into(), "task_01".into())],
        custom_ids: vec![(1, "second".into()), (0, "first".into())],
    }
}

fn answer(index: u64, text: &str) -> ProcessedLine {
    ProcessedLine {
        index,
        status: 200,
        body: json!({"choices": [{"message": {"content": text}}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 2}}),
        request_id: format!("job_{index}"),
    }
}

struct Gw {
    addr: std::net::SocketAddr,
    key: String,
    other: String,
    _dir: tempfile::TempDir,
}

impl Gw {
    async fn new(net: Arc<Net>) -> Gw {
        Gw::with(net, GatewayConfig::default()).await
    }

    async fn with(net: Arc<Net>, config: GatewayConfig) -> Gw {
        let dir = tempfile::tempdir().unwrap();
        let keys = Arc::new(KeyStore::new(dir.path()));
        let mk = |t: &str| {
            let new = NewKey { tenant_id: t.into(), project_id: "p".into(), ..Default::default() };
            keys.create(new, gcs_protocol::now_ms()).unwrap().0
        };
        let (key, other) = (mk("t"), mk("u"));
        let edge = config.edge.clone();
        let app = gcs_gateway::router(net, keys, config);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve_with(listener, app, None, edge, std::future::pending()));
        Gw { addr, key, other, _dir: dir }
    }

    async fn get(&self, path: &str, key: &str) -> (u16, Value) {
        let raw = format!(
            "GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n"
        );
        let a = exchange(self.addr, raw.as_bytes()).await;
        (a.status, serde_json::from_str(&a.body).unwrap_or(Value::String(a.body.clone())))
    }

    async fn until(&self, status: &str) -> Value {
        self.until_of(ID, status).await
    }

    async fn until_of(&self, id: &str, status: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (_, b) = self.get(&format!("/v1/batches/{id}"), &self.key).await;
            if b["status"] == status {
                return b;
            }
            assert!(Instant::now() < deadline, "batch never got {status}: {b}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_another_gateway_is_taken_over_collected_and_served() {
    let net = Net::new(Script::Silent);
    *net.found.lock().unwrap() = Some(("t".into(), ID.into(), found()));
    net.progress.lock().unwrap().answered = vec![answer(1, "two")];
    let gw = Gw::new(net.clone()).await;
    let (status, e) = gw.get(&format!("/v1/batches/{ID}"), &gw.other).await;
    assert_eq!(status, 404, "another tenant's key finds nothing: {e}");
    // ...and its asking first does not keep the owner from finding it.
    let (status, b) = gw.get(&format!("/v1/batches/{ID}"), &gw.key).await;
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["metadata"]["run"], "adopted");
    net.progress.lock().unwrap().answered.push(answer(0, "one"));
    let b = gw.until("completed").await;
    assert_eq!(b["request_counts"], json!({"total": 2, "completed": 2, "failed": 0}));
    let file = b["output_file_id"].as_str().unwrap();
    let raw = format!(
        "GET /v1/files/{file}/content HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
        gw.key
    );
    let out = exchange(gw.addr, raw.as_bytes()).await;
    let lines: Vec<Value> = out.body.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let got: Vec<(&str, &str)> = lines
        .iter()
        .map(|l| {
            let text = l["response"]["body"]["choices"][0]["message"]["content"].as_str().unwrap();
            (l["custom_id"].as_str().unwrap(), text)
        })
        .collect();
    assert_eq!(
        got,
        [("first", "one"), ("second", "two")],
        "each answer under its custom_id, in order"
    );
    assert!(net.submitted() == 0, "nothing was run through the handlers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_batch_ends_cancelled_when_cancelled_here_or_in_the_network() {
    // Cancelled here: its task is cancelled in the network.
    let net = Net::new(Script::Silent);
    *net.found.lock().unwrap() = Some(("t".into(), ID.into(), found()));
    let gw = Gw::new(net.clone()).await;
    let c =
        exchange(gw.addr, &post(&format!("/v1/batches/{ID}/cancel"), Some(&gw.key), "{}")).await;
    assert_eq!(c.status, 200, "{}", c.body);
    gw.until("cancelled").await;
    assert_eq!(*net.tasks_cancelled.lock().unwrap(), ["task_01"]);
    // Cancelled in the network (by its creator): it ends cancelled here,
    // with what was answered.
    let net = Net::new(Script::Silent);
    *net.found.lock().unwrap() = Some(("t".into(), ID.into(), found()));
    *net.progress.lock().unwrap() =
        TaskProgress { answered: vec![answer(0, "one")], cancelled: true, ..Default::default() };
    let gw = Gw::new(net.clone()).await;
    let b = gw.until("cancelled").await;
    assert_eq!(b["request_counts"]["completed"], 1, "{b}");
}

/// An adopted batch counts against the tenant's record limit as one
/// created here: the oldest ended record gives way to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_batch_keeps_the_tenants_record_limit() {
    let net = Net::new(Script::Silent);
    *net.found.lock().unwrap() = Some(("t".into(), ID.into(), found()));
    net.progress.lock().unwrap().answered = vec![answer(0, "one"), answer(1, "two")];
    let mut config = GatewayConfig::default();
    config.batch.max_records_per_tenant = 1;
    let gw = Gw::with(net.clone(), config).await;
    gw.until("completed").await;
    const ID2: &str = "batch_0123456789abcdef01234568";
    *net.found.lock().unwrap() = Some(("t".into(), ID2.into(), found_of(ID2)));
    gw.until_of(ID2, "completed").await;
    let (status, list) = gw.get("/v1/batches", &gw.key).await;
    assert_eq!(status, 200, "{list}");
    let ids: Vec<&str> = list["data"].as_array().unwrap().iter().map(|b| b["id"].as_str().unwrap()).collect();
    assert_eq!(ids, [ID2], "the ended batch gave way to the adopted one");
}
