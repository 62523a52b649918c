//! `gnus.privacy_mode: "encrypted_payload"` over real libp2p and RocksDB:
//! the job completes with the same text as a standard one, the prompt is
//! in clear in no byte of either node's data directory after shutdown
//! (while the standard run's gateway does hold it: the scan can see it),
//! and a node that does not hold the lease gets nothing usable.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gcs_keyspace::keys;
use gcs_node::jobs::announce::GatewayRecord;
use gcs_node::jobs::executor::{ExecError, ExecOutcome, ExecRequest, Executor};
use gcs_node::jobs::wire::{JobRequest, JobResponse};
use gcs_node::jobs::{JobEvent, JobSpec};
use gcs_node::{start, NodeHandle, Role};
use gcs_protocol::{ApiType, FinishReason, JobLimits, PrivacyLevel};

#[path = "../../tests/support/loopback.rs"]
mod loopback;
use loopback::addr;

/// A string that appears nowhere but in the prompt.
const MARKER: &str = "quokka-sealed-4711-marker";

/// Answers with words made of the body's blake3: the same text for the same
/// body, so equal answers prove the worker ran exactly the clear body. The
/// text never contains the prompt itself.
#[derive(Debug)]
struct Digest;

impl Executor for Digest {
    fn run(
        &self,
        req: &ExecRequest,
        cancel: &AtomicBool,
        emit: &mut dyn FnMut(&str, u32, Vec<gcs_protocol::TokenLogprob>) -> bool,
    ) -> Result<ExecOutcome, ExecError> {
        serde_json::from_slice::<serde_json::Value>(&req.body)
            .map_err(|e| ExecError::Invalid(e.to_string()))?;
        let hex = blake3::hash(&req.body).to_hex().to_string();
        let mut n = 0;
        for w in 0..6 {
            if cancel.load(Ordering::SeqCst)
                || !emit(&format!("{} ", &hex[w * 6..w * 6 + 6]), 1, vec![])
            {
                break;
            }
            n += 1;
            // Slow enough for the probes below to run while the lease is held.
            std::thread::sleep(Duration::from_millis(150));
        }
        Ok(ExecOutcome {
            finish_reason: FinishReason::Length,
            input_tokens: 8,
            output_tokens: n,
            cached_tokens: 0,
            body: serde_json::json!({"object": "chat.completion"}),
        })
    }
}

fn spec(privacy: PrivacyLevel) -> JobSpec {
    let mut routing = gcs_protocol::Routing::public();
    routing.privacy_mode = privacy;
    JobSpec {
        api_type: ApiType::ChatCompletion,
        model: "gnus-test".into(),
        stream: true,
        body: format!(r#"{{"messages":[{{"role":"user","content":"tell me about {MARKER}"}}]}}"#)
            .into_bytes(),
        tenant_id: "tenant_1".into(),
        project_id: "proj_1".into(),
        api_key_id: "key_1".into(),
        idempotency_key: "idem_sealed".into(),
        limits: JobLimits { claim_timeout_ms: 3_000, ..JobLimits::default() },
        max_output_tokens: 64,
        routing,
        batch_id: None,
        parent: None,
        price_percent: None,
    }
}

/// Every file under `dir` (RocksDB SSTs, WAL, manifests, identity...) that
/// holds `needle` as raw bytes.
fn files_holding(dir: &std::path::Path, needle: &[u8]) -> Vec<String> {
    let mut hits = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if std::fs::read(&p).unwrap().windows(needle.len()).any(|w| w == needle) {
                hits.push(p.display().to_string());
            }
        }
    }
    hits
}

struct Run {
    text: String,
    /// Which of the probes the gateway refused: a fetch by a node without
    /// the lease.
    stranger_refused: bool,
    /// The holder's own fetch: whether it came sealed (no marker in it).
    holder_answer_sealed: Option<bool>,
}

/// A gateway, a worker that wins and a second worker with no model (it
/// probes); one job of `privacy`; everyone shut down; dirs returned.
async fn run(privacy: PrivacyLevel) -> (Run, [tempfile::TempDir; 3]) {
    let dirs =
        [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let gw = start(loopback::config(Role::Gateway, &dirs[0], vec![])).await.unwrap();
    let a = addr(&gw).await;
    let mut wc = loopback::config(Role::Worker, &dirs[1], vec![a.clone()]);
    wc.executor = Some(Arc::new(Digest) as Arc<dyn Executor>);
    let worker = start(wc).await.unwrap();
    let mut sc = loopback::config(Role::Worker, &dirs[2], vec![a]);
    sc.models = vec![loopback::model("other-model", &[])];
    sc.executor = Some(Arc::new(Digest) as Arc<dyn Executor>);
    let stranger = start(sc).await.unwrap();
    let t = Instant::now();
    while !gw.fresh_registrations().iter().any(|r| r.node_id == worker.node_id) {
        assert!(t.elapsed() < Duration::from_secs(30), "no worker registration");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let (job, mut rx) = gw.submit(spec(privacy)).await.unwrap();
    let mut text = String::new();
    let mut probed = None;
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(30), rx.recv()).await.unwrap().unwrap();
        match ev {
            JobEvent::Leased { node_id } => assert_eq!(node_id, worker.node_id),
            JobEvent::Chunk(c) => {
                text.push_str(c.delta.content.as_deref().unwrap_or_default());
                if probed.is_none() {
                    probed = Some(probe(&gw, &worker, &stranger, &job).await);
                }
            }
            JobEvent::Completed(_) => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    let (stranger_refused, holder_answer_sealed) = probed.unwrap();
    if privacy == PrivacyLevel::EncryptedPayload {
        let job_rec: gcs_protocol::ApiRequestJob =
            gw.keyspace().get_cbor(&keys::job(&job)).unwrap().unwrap();
        assert!(job_rec.request.payload_ref.encrypted, "the signed job says sealed");
        let rec = gw.keyspace().get_bytes(&keys::payload(&job)).unwrap().unwrap();
        let rec = GatewayRecord::decode(&rec).unwrap();
        assert!(rec.sealed, "the gateway keeps the body sealed");
        assert_eq!(rec.billing.api_key_id, "key_1", "billing stays readable");
    }
    for n in [stranger, worker, gw] {
        n.shutdown().await;
    }
    (Run { text, stranger_refused, holder_answer_sealed }, dirs)
}

/// While the lease is held: a node without it asks for the payload under
/// the real lease id; the holder asks again and its answer is inspected.
async fn probe(
    gw: &NodeHandle,
    worker: &NodeHandle,
    stranger: &NodeHandle,
    job: &str,
) -> (bool, Option<bool>) {
    let lease: gcs_protocol::LeaseGrant =
        gw.keyspace().get_cbor(&keys::lease(job)).unwrap().expect("lease recorded");
    let fetch =
        || JobRequest::FetchPayload { job_id: job.into(), lease_id: lease.lease_id.clone() };
    let refused = matches!(
        stranger.network().request(gw.peer_id, fetch()).await,
        Ok(JobResponse::Refused(_))
    );
    let holder = match worker.network().request(gw.peer_id, fetch()).await {
        Ok(JobResponse::Payload(p)) => {
            Some(!p.body.windows(MARKER.len()).any(|w| w == MARKER.as_bytes()))
        }
        _ => None,
    };
    (refused, holder)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encrypted_payload_job_matches_a_standard_one_and_leaves_no_clear_prompt_on_disk() {
    let (standard, std_dirs) = run(PrivacyLevel::Standard).await;
    let (sealed, dirs) = run(PrivacyLevel::EncryptedPayload).await;
    assert_eq!(standard.text.split_whitespace().count(), 6, "{:?}", standard.text);
    assert_eq!(sealed.text, standard.text, "the worker ran exactly the clear body");

    // The scan sees a clear prompt where one is stored: the standard
    // gateway keeps the body in clear under keys::payload.
    let control = files_holding(std_dirs[0].path(), MARKER.as_bytes());
    assert!(!control.is_empty(), "the scan must find the standard job's clear prompt");
    for (who, d) in ["gateway", "worker", "stranger"].iter().zip(&dirs) {
        let hits = files_holding(d.path(), MARKER.as_bytes());
        assert!(hits.is_empty(), "{who} holds the sealed job's prompt in clear: {hits:?}");
    }

    // Nobody but the holder gets the payload; the holder gets it sealed.
    assert!(standard.stranger_refused && sealed.stranger_refused);
    assert_eq!(standard.holder_answer_sealed, Some(false), "standard: the holder gets it in clear");
    assert_eq!(sealed.holder_answer_sealed, Some(true), "sealed: no clear text on the wire");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_all_node_seals_its_own_job_to_itself() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = loopback::config(Role::All, &dir, vec![]);
    c.executor = Some(Arc::new(Digest) as Arc<dyn Executor>);
    let node = start(c).await.unwrap();
    let t = Instant::now();
    while !node.fresh_registrations().iter().any(|r| r.node_id == node.node_id) {
        assert!(t.elapsed() < Duration::from_secs(30), "no own registration");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let (_job, mut rx) = node.submit(spec(PrivacyLevel::EncryptedPayload)).await.unwrap();
    let mut text = String::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await.unwrap().unwrap() {
            JobEvent::Chunk(c) => text.push_str(c.delta.content.as_deref().unwrap_or_default()),
            JobEvent::Completed(_) => break,
            JobEvent::Leased { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let body = spec(PrivacyLevel::Standard).body;
    let hex = blake3::hash(&body).to_hex().to_string();
    let want: String = (0..6).map(|w| format!("{} ", &hex[w * 6..w * 6 + 6])).collect();
    assert_eq!(text, want, "the engine ran the clear body");
    node.shutdown().await;
    let hits = files_holding(dir.path(), MARKER.as_bytes());
    assert!(hits.is_empty(), "the node holds its sealed job's prompt in clear: {hits:?}");
}
