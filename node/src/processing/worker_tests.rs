//! The processing loop across three stores (a gateway and two workers),
//! records carried between them as replication carries them: a task
//! drained by both workers, a worker dying mid-subtask and its subtask
//! taken over after the lock expired (every request answered once), lock
//! renewal during a long subtask, and the gateway's and worker's checks on
//! chunks.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use gcs_keyspace::{Delta, Keyspace};
use gcs_protocol::{samples, ApiType, NodeId, NodeKey};

use super::chunks::{self, Line, ProcessingError, TaskParams, TaskSpec};
use super::records;
use super::worker::{ChunkSource, Processor};
use crate::jobs::executor::{ExecError, ExecOutcome, ExecRequest, Executor};
use crate::replication::merge_scoped;
use crate::tenants::TenantTrust;

const NOW: u64 = 1_000_000;
const LEASE: u64 = 10_000;

/// Answers each request with its own bytes' length, counting runs; a
/// body of `bad` is refused as invalid, and each run moves `clock` on.
#[derive(Debug, Default)]
pub(super) struct Echo {
    pub(super) runs: AtomicU64,
    pub(super) step_ms: u64,
    pub(super) clock: std::sync::Arc<AtomicU64>,
}

impl Executor for Echo {
    fn run(
        &self,
        req: &ExecRequest,
        _: &AtomicBool,
        _: &mut dyn FnMut(&str, u32, Vec<gcs_protocol::TokenLogprob>) -> bool,
    ) -> Result<ExecOutcome, ExecError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        self.clock.fetch_add(self.step_ms, Ordering::SeqCst);
        if req.body == b"bad" {
            return Err(ExecError::Invalid("prompt too long".into()));
        }
        if req.body == b"boom" {
            return Err(ExecError::Engine("kernel\nfault".into()));
        }
        Ok(ExecOutcome {
            finish_reason: gcs_protocol::FinishReason::Stop,
            input_tokens: req.body.len() as u64,
            // The bodies are no generation payloads: nothing to generate
            // (`chunks::accept_output` bounds the count by max_tokens).
            output_tokens: 0,
            cached_tokens: 0,
            body: serde_json::json!({"echo": String::from_utf8_lossy(&req.body)}),
        })
    }
}

/// The gateway's store as a worker reaches it.
struct Gateway<'a> {
    ks: &'a Keyspace,
    trust: &'a TenantTrust,
    clock: &'a AtomicU64,
    delivered: Mutex<u64>,
}

impl ChunkSource for Gateway<'_> {
    fn fetch(
        &self,
        me: &NodeId,
        _: &NodeId,
        lock: &Delta,
        task: &str,
        chunk: &str,
    ) -> Result<Vec<u8>, ProcessingError> {
        let now = self.clock.load(Ordering::SeqCst);
        chunks::present_lock(self.ks, lock.clone(), self.trust, now)?;
        chunks::serve_chunk(self.ks, me, task, chunk, now)
    }
    fn deliver(&self, _: &NodeId, lock: &Delta, output: Vec<u8>) -> Result<(), ProcessingError> {
        let now = self.clock.load(Ordering::SeqCst);
        chunks::present_lock(self.ks, lock.clone(), self.trust, now)?;
        chunks::accept_output(self.ks, &output, now)?;
        *self.delivered.lock().unwrap() += 1;
        Ok(())
    }
}

struct Net {
    _dirs: Vec<tempfile::TempDir>,
    stores: Vec<Keyspace>,
    trust: std::sync::Arc<TenantTrust>,
    gateway: NodeKey,
    workers: [NodeKey; 2],
    avoid: [super::worker::Avoid; 2],
}

fn net() -> Net {
    let mut dirs = vec![];
    let mut stores = vec![];
    for name in ["g", "a", "b"] {
        let d = tempfile::tempdir().unwrap();
        stores.push(Keyspace::open(d.path(), name, Default::default()).unwrap());
        dirs.push(d);
    }
    let (w1, gateway) = samples::keys();
    let w2 = NodeKey::from_seed([201; 32]);
    let refs: Vec<&Keyspace> = stores.iter().collect();
    let trust = crate::tenants::records::admit_sample_gateway(&refs, &gateway);
    Net { _dirs: dirs, stores, trust, gateway, workers: [w1, w2], avoid: Default::default() }
}

impl Net {
    /// Carries a delta from store `from` to the others, as gossip does.
    fn spread(&self, from: usize, d: &Delta, now: u64) {
        for (i, ks) in self.stores.iter().enumerate() {
            if i != from {
                merge_scoped(ks, d.clone(), &[], &self.trust, now).unwrap();
            }
        }
    }

    fn enqueue(&self, bodies: &[&[u8]], per: usize) -> String {
        let spec = TaskSpec {
            tenant_id: "tenant_123".into(),
            batch_id: Some("batch_00112233445566778899aabb".into()),
            params: TaskParams { v: 1, model: "m".into(), api_type: ApiType::ChatCompletion },
            cache_salt: "salt".into(),
            per_subtask: per,
        };
        let lines: Vec<Line> = bodies
            .iter()
            .enumerate()
            .map(|(i, b)| Line { index: i as u64, custom_id: None, body: b.to_vec() })
            .collect();
        let (id, d) =
            chunks::enqueue(&self.stores[0], &self.gateway, &self.trust, &spec, &lines, NOW)
                .unwrap();
        self.spread(0, &d, NOW);
        id
    }

    fn processor<'a>(&'a self, w: usize, exec: &'a Echo, models: &'a [String]) -> Processor<'a> {
        Processor {
            ks: &self.stores[w + 1],
            key: &self.workers[w],
            trust: &self.trust,
            executor: exec,
            models,
            lease_ms: LEASE,
            avoid: &self.avoid[w],
            unreachable: &self.avoid[w],
        }
    }
}

fn bodies(n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("request {i}").into_bytes()).collect()
}

#[test]
fn two_workers_drain_a_task_and_every_request_is_answered_once() {
    let net = net();
    let b = bodies(10);
    let refs: Vec<&[u8]> = b.iter().map(Vec::as_slice).collect();
    let task = net.enqueue(&refs, 4);
    let clock = std::sync::Arc::new(AtomicU64::new(NOW + 1));
    let execs = [
        Echo { clock: clock.clone(), step_ms: 1, ..Echo::default() },
        Echo { clock: clock.clone(), step_ms: 1, ..Echo::default() },
    ];
    let models = vec!["m".to_string()];
    let gw =
        Gateway { ks: &net.stores[0], trust: &net.trust, clock: &clock, delivered: Mutex::new(0) };
    let cancel = AtomicBool::new(false);
    let mut done = 0;
    for round in 0..10 {
        let w = round % 2;
        let p = net.processor(w, &execs[w], &models);
        let mut out = vec![];
        let now = || clock.load(Ordering::SeqCst);
        let r = p.step(&gw, &cancel, &now, &mut |d| out.push(d)).unwrap();
        for d in &out {
            net.spread(w + 1, d, clock.load(Ordering::SeqCst));
        }
        if let Some(d) = r {
            done += d.lines;
        }
    }
    assert_eq!(done, 10);
    assert!(execs.iter().all(|e| e.runs.load(Ordering::SeqCst) > 0), "both workers ran some");
    assert_eq!(execs.iter().map(|e| e.runs.load(Ordering::SeqCst)).sum::<u64>(), 10);
    let now = clock.load(Ordering::SeqCst);
    let c = chunks::collect(&net.stores[0], &task, now, &Default::default()).unwrap();
    assert_eq!((c.missing, c.open, c.bad.len()), (0, 0, 0));
    let idx: Vec<u64> = c.outputs.iter().map(|o| o.index).collect();
    assert_eq!(idx, (0..10).collect::<Vec<_>>());
    assert_eq!(c.outputs[3].body, r#"{"echo":"request 3"}"#);
    assert_eq!(c.outputs[3].status, 200);
    // Every store agrees the task is done.
    for ks in &net.stores {
        assert!(records::all_results(
            &records::stored(ks, &task).unwrap().unwrap(),
            clock.load(Ordering::SeqCst)
        ));
    }
}

/// Dies after delivering `after` outputs: its deliveries beyond fail.
struct Dies<'a> {
    inner: &'a Gateway<'a>,
    after: u64,
    cancel: &'a AtomicBool,
}

impl ChunkSource for Dies<'_> {
    fn fetch(
        &self,
        me: &NodeId,
        g: &NodeId,
        l: &Delta,
        t: &str,
        c: &str,
    ) -> Result<Vec<u8>, ProcessingError> {
        self.inner.fetch(me, g, l, t, c)
    }
    fn deliver(&self, g: &NodeId, l: &Delta, output: Vec<u8>) -> Result<(), ProcessingError> {
        self.inner.deliver(g, l, output)?;
        if *self.inner.delivered.lock().unwrap() >= self.after {
            self.cancel.store(true, Ordering::SeqCst);
        }
        Ok(())
    }
}

#[test]
fn a_dead_workers_subtask_is_taken_over_after_its_lock_expires() {
    let net = net();
    let b = bodies(4);
    let refs: Vec<&[u8]> = b.iter().map(Vec::as_slice).collect();
    let task = net.enqueue(&refs, 4);
    let clock = std::sync::Arc::new(AtomicU64::new(NOW + 1));
    let (ea, eb) = (
        Echo { clock: clock.clone(), ..Echo::default() },
        Echo { clock: clock.clone(), ..Echo::default() },
    );
    let models = vec!["m".to_string()];
    let gw =
        Gateway { ks: &net.stores[0], trust: &net.trust, clock: &clock, delivered: Mutex::new(0) };
    let now = || clock.load(Ordering::SeqCst);
    // Worker A takes the one subtask, delivers two outputs and dies.
    let dead = AtomicBool::new(false);
    let dies = Dies { inner: &gw, after: 2, cancel: &dead };
    let mut out = vec![];
    let r = net.processor(0, &ea, &models).step(&dies, &dead, &now, &mut |d| out.push(d)).unwrap();
    assert_eq!(r, None, "A stopped before its result");
    // Killed, A releases nothing: only what it stored before is gossiped.
    let release = gcs_keyspace::Namespace::ProcessingReleases.prefix();
    assert!(out.last().is_some_and(|d| d.key.starts_with(release)), "a stop releases the lock");
    out.iter().filter(|d| !d.key.starts_with(release)).for_each(|d| net.spread(1, d, now()));
    // While A's lock lives, B finds nothing to take.
    let live = AtomicBool::new(false);
    let mut out = vec![];
    assert_eq!(
        net.processor(1, &eb, &models).step(&gw, &live, &now, &mut |d| out.push(d)).unwrap(),
        None
    );
    assert_eq!(eb.runs.load(Ordering::SeqCst), 0);
    // After the lease, B takes it over and runs all four.
    clock.fetch_add(LEASE + 1, Ordering::SeqCst);
    let r = net.processor(1, &eb, &models).step(&gw, &live, &now, &mut |d| out.push(d)).unwrap();
    assert_eq!(r.map(|d| d.lines), Some(4));
    out.iter().for_each(|d| net.spread(2, d, now()));
    let c = chunks::collect(&net.stores[0], &task, now(), &Default::default()).unwrap();
    let idx: Vec<u64> = c.outputs.iter().map(|o| o.index).collect();
    assert_eq!(idx, vec![0, 1, 2, 3], "each request once, A's two outputs not counted");
    assert!(c.outputs.iter().all(|o| o.node_id == net.workers[1].node_id()));
    assert_eq!(
        *gw.delivered.lock().unwrap(),
        6,
        "A's two stale outputs are held but not collected"
    );
    // A, back, cannot store a result under its expired lock.
    let late = gcs_protocol::SubTaskResult {
        subtask_id: "s0".into(),
        result_hash: gcs_protocol::Hash32::of(b"x"),
        chunk_hashes: vec![gcs_protocol::Hash32::of(b"x"); 4],
    };
    assert!(
        records::complete(&net.stores[1], &task, late, &net.workers[0], &net.trust, now()).is_err()
    );
}

#[test]
fn a_long_subtask_renews_its_lock_and_its_result_counts() {
    let net = net();
    let b = bodies(6);
    let refs: Vec<&[u8]> = b.iter().map(Vec::as_slice).collect();
    let task = net.enqueue(&refs, 6);
    let clock = std::sync::Arc::new(AtomicU64::new(NOW + 1));
    // Each request takes 40% of the lease: six outlive it three times over.
    let e = Echo { clock: clock.clone(), step_ms: LEASE * 2 / 5, ..Echo::default() };
    let models = vec!["m".to_string()];
    let gw =
        Gateway { ks: &net.stores[0], trust: &net.trust, clock: &clock, delivered: Mutex::new(0) };
    let now = || clock.load(Ordering::SeqCst);
    let mut out = vec![];
    let cancel = AtomicBool::new(false);
    let r = net.processor(0, &e, &models).step(&gw, &cancel, &now, &mut |d| out.push(d)).unwrap();
    assert_eq!(r.map(|d| d.lines), Some(6));
    assert!(out.len() >= 4, "lock, renewals and the result were published: {}", out.len());
    // The lock and early renewals have expired by now (gossip would have
    // carried them in time): the latest renewal and the result suffice.
    out[out.len() - 2..].iter().for_each(|d| net.spread(1, d, now()));
    let c = chunks::collect(&net.stores[0], &task, now(), &Default::default()).unwrap();
    assert_eq!(c.outputs.len(), 6);
}

#[test]
fn a_refused_request_is_a_400_line_and_the_rest_run() {
    let net = net();
    let task = net.enqueue(&[b"one", b"bad", b"three"], 8);
    let clock = std::sync::Arc::new(AtomicU64::new(NOW + 1));
    let e = Echo { clock: clock.clone(), ..Echo::default() };
    let models = vec!["m".to_string()];
    let gw =
        Gateway { ks: &net.stores[0], trust: &net.trust, clock: &clock, delivered: Mutex::new(0) };
    let now = || clock.load(Ordering::SeqCst);
    let mut out = vec![];
    let cancel = AtomicBool::new(false);
    net.processor(0, &e, &models).step(&gw, &cancel, &now, &mut |d| out.push(d)).unwrap().unwrap();
    out.iter().for_each(|d| net.spread(1, d, now()));
    let c = chunks::collect(&net.stores[0], &task, now(), &Default::default()).unwrap();
    let status: Vec<u16> = c.outputs.iter().map(|o| o.status).collect();
    assert_eq!(status, vec![200, 400, 200]);
    assert!(c.outputs[1].body.contains("prompt too long"));
}

#[test]
fn a_worker_not_serving_the_model_takes_nothing() {
    let net = net();
    net.enqueue(&[b"one"], 8);
    let clock = std::sync::Arc::new(AtomicU64::new(NOW + 1));
    let e = Echo { clock: clock.clone(), ..Echo::default() };
    let models = vec!["other".to_string()];
    let gw =
        Gateway { ks: &net.stores[0], trust: &net.trust, clock: &clock, delivered: Mutex::new(0) };
    let now = || clock.load(Ordering::SeqCst);
    let cancel = AtomicBool::new(false);
    let r = net.processor(0, &e, &models).step(&gw, &cancel, &now, &mut |_| {}).unwrap();
    assert_eq!(r, None);
    assert_eq!(e.runs.load(Ordering::SeqCst), 0);
}

#[test]
fn the_gateway_serves_chunks_and_takes_outputs_only_from_the_lock_holder() {
    let net = net();
    let task = net.enqueue(&[b"one", b"two"], 8);
    let (a, b) = (&net.workers[0], &net.workers[1]);
    let now = NOW + 1;
    // Nobody holds it yet: no chunk for anyone.
    let err = chunks::serve_chunk(&net.stores[0], &a.node_id(), &task, "c0", now).unwrap_err();
    assert!(matches!(err, ProcessingError::NotHolder), "{err}");
    let (lock, d) =
        records::grab(&net.stores[1], &task, a, LEASE, &net.trust, now).unwrap().unwrap();
    net.spread(1, &d, now);
    let bytes = chunks::serve_chunk(&net.stores[0], &a.node_id(), &task, "c1", now).unwrap();
    let t = records::stored(&net.stores[1], &task).unwrap().unwrap().task;
    let c = chunks::check_input(&t, "c1", &bytes).unwrap();
    assert_eq!((c.index, c.body.as_slice(), c.cache_salt.as_str()), (1, &b"two"[..], "salt"));
    // Another worker gets nothing, and A nothing after its lease.
    assert!(chunks::serve_chunk(&net.stores[0], &b.node_id(), &task, "c1", now).is_err());
    assert!(chunks::serve_chunk(&net.stores[0], &a.node_id(), &task, "c1", now + LEASE).is_err());
    // A chunk served under another id, or altered, is refused by the worker.
    assert!(chunks::check_input(&t, "c0", &bytes).is_err());
    let mut altered = bytes.clone();
    let n = altered.len();
    altered[n - 70] ^= 1;
    assert!(chunks::check_input(&t, "c1", &altered).is_err());
    // An output signed by B under A's lock is refused by the gateway.
    let mut o = chunks::OutputChunk {
        message_type: gcs_protocol::MessageType::TaskResult,
        version: chunks::CHUNK_VERSION,
        task_id: task.clone(),
        chunk_id: "c1".into(),
        index: 1,
        input_hash: gcs_protocol::Hash32::of(&bytes),
        lock_id: lock.lock_id.clone(),
        node_id: b.node_id(),
        status: 200,
        body: "{}".into(),
        input_tokens: 1,
        output_tokens: 0,
        created_at_ms: now,
        signature: None,
    };
    gcs_protocol::sign(&mut o, b).unwrap();
    let enc = gcs_protocol::encode(&o).unwrap();
    assert!(matches!(
        chunks::accept_output(&net.stores[0], &enc, now),
        Err(ProcessingError::NotHolder)
    ));
    // A's own, of another input, is refused; of this input, taken once.
    o.node_id = a.node_id();
    o.input_hash = gcs_protocol::Hash32::of(b"other");
    gcs_protocol::sign(&mut o, a).unwrap();
    let enc = gcs_protocol::encode(&o).unwrap();
    assert!(matches!(
        chunks::accept_output(&net.stores[0], &enc, now),
        Err(ProcessingError::Mismatch(_))
    ));
    o.input_hash = gcs_protocol::Hash32::of(&bytes);
    gcs_protocol::sign(&mut o, a).unwrap();
    let enc = gcs_protocol::encode(&o).unwrap();
    chunks::accept_output(&net.stores[0], &enc, now).unwrap();
    o.body = "{\"x\":1}".into();
    gcs_protocol::sign(&mut o, a).unwrap();
    let enc = gcs_protocol::encode(&o).unwrap();
    assert!(matches!(
        chunks::accept_output(&net.stores[0], &enc, now),
        Err(ProcessingError::Mismatch(_))
    ));
}

#[test]
fn input_chunks_never_leave_the_gateway_by_replication() {
    let net = net();
    let task = net.enqueue(&[b"private prompt"], 8);
    let key = gcs_keyspace::keys::processing_chunk(&task, "c0");
    assert!(net.stores[0].get_bytes(&key).unwrap().is_some());
    let ns = gcs_keyspace::Namespace::of_key(&key).unwrap();
    assert_ne!(ns.scope(), gcs_keyspace::Scope::Global);
    let d = net.stores[0].put(&key, b"x".to_vec(), NOW).unwrap();
    assert!(
        merge_scoped(&net.stores[1], d, &[], &net.trust, NOW).is_err(),
        "a peer cannot push one"
    );
}

#[test]
fn a_worker_stopped_at_shutdown_gives_its_subtask_back_at_once() {
    let net = net();
    let b = bodies(4);
    let refs: Vec<&[u8]> = b.iter().map(Vec::as_slice).collect();
    let task = net.enqueue(&refs, 4);
    let clock = std::sync::Arc::new(AtomicU64::new(NOW + 1));
    let (ea, eb) = (
        Echo { clock: clock.clone(), ..Echo::default() },
        Echo { clock: clock.clone(), ..Echo::default() },
    );
    let models = vec!["m".to_string()];
    let gw =
        Gateway { ks: &net.stores[0], trust: &net.trust, clock: &clock, delivered: Mutex::new(0) };
    let now = || clock.load(Ordering::SeqCst);
    let stop = AtomicBool::new(false);
    let stops = Dies { inner: &gw, after: 1, cancel: &stop };
    let mut out = vec![];
    let r = net.processor(0, &ea, &models).step(&stops, &stop, &now, &mut |d| out.push(d)).unwrap();
    assert_eq!(r, None);
    out.iter().for_each(|d| net.spread(1, d, now()));
    // B takes it over without waiting for the lease, and runs all four.
    let live = AtomicBool::new(false);
    let mut out = vec![];
    let r = net.processor(1, &eb, &models).step(&gw, &live, &now, &mut |d| out.push(d)).unwrap();
    assert_eq!(r.map(|d| d.lines), Some(4));
    out.iter().for_each(|d| net.spread(2, d, now()));
    let q = records::replay(&records::stored(&net.stores[0], &task).unwrap().unwrap(), now());
    assert!(q.bad(&task, "s0").is_none(), "a stop is not a failure");
    let c = chunks::collect(&net.stores[0], &task, now(), &Default::default()).unwrap();
    assert_eq!(c.outputs.len(), 4);
}

#[test]
fn a_request_failing_in_every_engine_marks_its_subtask_bad_after_three_tries() {
    let net = net();
    let task = net.enqueue(&[b"fine", b"boom", b"fine too"], 2);
    let clock = std::sync::Arc::new(AtomicU64::new(NOW + 1));
    let execs = [
        Echo { clock: clock.clone(), step_ms: 1, ..Echo::default() },
        Echo { clock: clock.clone(), step_ms: 1, ..Echo::default() },
    ];
    let models = vec!["m".to_string()];
    let gw =
        Gateway { ks: &net.stores[0], trust: &net.trust, clock: &clock, delivered: Mutex::new(0) };
    let now = || clock.load(Ordering::SeqCst);
    let live = AtomicBool::new(false);
    let mut errors = 0;
    for round in 0..6 {
        let w = round % 2;
        let mut out = vec![];
        match net.processor(w, &execs[w], &models).step(&gw, &live, &now, &mut |d| out.push(d)) {
            Err(ProcessingError::Engine(_)) => errors += 1,
            other => assert!(other.is_ok(), "{other:?}"),
        }
        out.iter().for_each(|d| net.spread(w + 1, d, now()));
    }
    // Three tries of s0 (each released with its failure, no lease waited
    // out), one of s1; then nothing is left to take.
    assert_eq!(errors, 3);
    let c = chunks::collect(&net.stores[0], &task, now(), &Default::default()).unwrap();
    assert_eq!((c.open, c.missing), (0, 0));
    assert_eq!(c.outputs.iter().map(|o| o.index).collect::<Vec<_>>(), vec![2]);
    let bad: Vec<u64> = c.bad.iter().map(|(i, _)| *i).collect();
    assert_eq!(bad, vec![0, 1]);
    assert_eq!(
        c.bad[0].1, "engine: kernel fault",
        "the worker's reason, without control characters"
    );
    for ks in &net.stores {
        let q = records::replay(&records::stored(ks, &task).unwrap().unwrap(), now());
        assert!(q.bad(&task, "s0").is_some(), "every replica agrees");
    }
}

/// Delivers through `inner`; the first delivery makes the gateway cancel
/// the task, and the cancel reaches every store (as gossip carries it).
struct CancelsOnFirst<'a> {
    inner: &'a Gateway<'a>,
    net: &'a Net,
}

impl ChunkSource for CancelsOnFirst<'_> {
    fn fetch(
        &self,
        me: &NodeId,
        g: &NodeId,
        l: &Delta,
        t: &str,
        c: &str,
    ) -> Result<Vec<u8>, ProcessingError> {
        self.inner.fetch(me, g, l, t, c)
    }
    fn deliver(&self, g: &NodeId, l: &Delta, output: Vec<u8>) -> Result<(), ProcessingError> {
        let o: chunks::OutputChunk = gcs_protocol::codec::from_cbor_bytes(&output).unwrap();
        self.inner.deliver(g, l, output)?;
        let now = self.inner.clock.load(Ordering::SeqCst);
        let d = super::records::cancel(
            self.inner.ks,
            &o.task_id,
            "batch_cancelled",
            &self.net.gateway,
            self.inner.trust,
            now,
        )
        .unwrap();
        if let Some(d) = d {
            self.net.spread(0, &d, now);
        }
        Ok(())
    }
}

#[test]
fn a_cancelled_task_stops_between_requests_and_is_offered_to_no_one() {
    let net = net();
    let b = bodies(8);
    let refs: Vec<&[u8]> = b.iter().map(Vec::as_slice).collect();
    let task = net.enqueue(&refs, 4);
    let clock = std::sync::Arc::new(AtomicU64::new(NOW + 1));
    let (ea, eb) = (
        Echo { clock: clock.clone(), step_ms: 1, ..Echo::default() },
        Echo { clock: clock.clone(), step_ms: 1, ..Echo::default() },
    );
    let models = vec!["m".to_string()];
    let gw =
        Gateway { ks: &net.stores[0], trust: &net.trust, clock: &clock, delivered: Mutex::new(0) };
    let now = || clock.load(Ordering::SeqCst);
    let live = AtomicBool::new(false);
    let src = CancelsOnFirst { inner: &gw, net: &net };
    // Gossip carries each record as it is stored.
    let r =
        net.processor(0, &ea, &models).step(&src, &live, &now, &mut |d| net.spread(1, &d, now()));
    assert_eq!(r.unwrap(), None, "stopped by the cancel");
    assert_eq!(ea.runs.load(Ordering::SeqCst), 1, "no request after the cancel");
    // The other worker takes nothing: neither the released s0 nor the free s1.
    let mut out = vec![];
    assert_eq!(
        net.processor(1, &eb, &models).step(&gw, &live, &now, &mut |d| out.push(d)).unwrap(),
        None
    );
    assert_eq!(eb.runs.load(Ordering::SeqCst), 0);
    assert!(out.is_empty());
    // And the gateway serves a cancelled task's chunks to no one.
    let e = chunks::serve_chunk(&net.stores[0], &net.workers[0].node_id(), &task, "c0", now());
    assert!(matches!(e, Err(ProcessingError::Cancelled)), "{e:?}");
}

#[test]
fn a_subtask_whose_gateway_names_another_holder_is_passed_over_for_a_lease() {
    let net = net();
    let task = net.enqueue(&[b"one", b"two"], 2);
    let clock = std::sync::Arc::new(AtomicU64::new(NOW + 1));
    let e = Echo { clock: clock.clone(), ..Echo::default() };
    let models = vec!["m".to_string()];
    let gw =
        Gateway { ks: &net.stores[0], trust: &net.trust, clock: &clock, delivered: Mutex::new(0) };
    let now = || clock.load(Ordering::SeqCst);
    // The gateway holds worker B's lock on s0 (taken first, so it wins the
    // contest A's lock starts there); A's store never heard of it.
    records::grab(&net.stores[0], &task, &net.workers[1], LEASE, &net.trust, now() - 1)
        .unwrap()
        .unwrap();
    let live = AtomicBool::new(false);
    let mut out = vec![];
    let r = net.processor(0, &e, &models).step(&gw, &live, &now, &mut |d| out.push(d));
    assert!(matches!(r, Err(ProcessingError::NotHolder)), "{r:?}");
    assert_eq!(out.len(), 2, "its lock, then its release");
    // Asked again at once, A takes nothing (no lock, no record) ...
    let mut again = vec![];
    let r = net.processor(0, &e, &models).step(&gw, &live, &now, &mut |d| again.push(d)).unwrap();
    assert_eq!((r, again.len()), (None, 0));
    // ... until a lease has passed, when B's lock has expired too.
    clock.fetch_add(LEASE + 1, Ordering::SeqCst);
    let r = net.processor(0, &e, &models).step(&gw, &live, &now, &mut |d| again.push(d)).unwrap();
    assert_eq!(r.map(|d| d.lines), Some(2));
    assert_eq!(e.runs.load(Ordering::SeqCst), 2);
}

/// A bench, not a test (`cargo test -p gcs-node --lib collect_cost --
/// --ignored --nocapture`): one poll of a drained 1,000-request task,
/// reading every answer vs. skipping all but 4 (what the batch runner
/// holds already). It asserts only what each poll returns.
#[test]
#[ignore]
fn collect_cost_with_and_without_skip() {
    let net = net();
    let n = 1000u64;
    let b: Vec<Vec<u8>> =
        (0..n).map(|i| format!("request {i} {}", "x".repeat(2000)).into_bytes()).collect();
    let refs: Vec<&[u8]> = b.iter().map(Vec::as_slice).collect();
    let task = net.enqueue(&refs, 4);
    let clock = std::sync::Arc::new(AtomicU64::new(NOW + 1));
    let exec = Echo { clock: clock.clone(), step_ms: 1, ..Echo::default() };
    let models = vec!["m".to_string()];
    let gw =
        Gateway { ks: &net.stores[0], trust: &net.trust, clock: &clock, delivered: Mutex::new(0) };
    let cancel = AtomicBool::new(false);
    loop {
        let p = net.processor(0, &exec, &models);
        let mut out = vec![];
        let now = || clock.load(Ordering::SeqCst);
        let r = p.step(&gw, &cancel, &now, &mut |d| out.push(d)).unwrap();
        for d in &out {
            net.spread(1, d, clock.load(Ordering::SeqCst));
        }
        if r.is_none() {
            break;
        }
    }
    let now = clock.load(Ordering::SeqCst);
    let held: std::collections::HashSet<u64> = (0..n - 4).collect();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let c = chunks::collect(&net.stores[0], &task, now, &Default::default()).unwrap();
        let full = t.elapsed();
        assert_eq!(c.outputs.len() as u64, n);
        let t = std::time::Instant::now();
        let c = chunks::collect(&net.stores[0], &task, now, &held).unwrap();
        let skip = t.elapsed();
        assert_eq!(c.outputs.iter().map(|o| o.index).collect::<Vec<_>>(), [996, 997, 998, 999]);
        eprintln!("collect of {n} answers: every one {full:?}, all but 4 skipped {skip:?}");
    }
}
