//! Mirrors across four stores (two gateways of one tenant, a worker, and
//! a gateway of no tenant), records carried between them as replication
//! carries them: the second gateway pulls a task's inputs, a worker runs a
//! subtask through it while the task's gateway cannot be reached, and the
//! task's gateway pulls those answers back and collects them.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use gcs_keyspace::{keys, Delta, Keyspace};
use gcs_protocol::{samples, ApiType, MessageType, NodeId, NodeKey};

use super::chunks::{self, Line, ProcessingError, TaskParams, TaskSpec, CHUNK_VERSION};
use super::manifest;
use super::mirror::{self, MirrorPull, MIRROR_VERSION};
use super::records;
use super::worker::{ChunkSource, Processor};
use super::worker_tests::Echo;
use crate::replication::merge_scoped;
use crate::tenants::TrustHandle;

const NOW: u64 = 1_000_000;

struct Net {
    _dirs: Vec<tempfile::TempDir>,
    /// gateway A (the task's), gateway B (same tenant), worker, outsider.
    stores: Vec<Keyspace>,
    trust: TrustHandle,
    a: NodeKey,
    b: NodeKey,
    worker: NodeKey,
}

fn net() -> Net {
    let mut dirs = vec![];
    let mut stores = vec![];
    for name in ["ga", "gb", "w", "x"] {
        let d = tempfile::tempdir().unwrap();
        stores.push(Keyspace::open(d.path(), name, Default::default()).unwrap());
        dirs.push(d);
    }
    let (worker, a) = samples::keys();
    let b = NodeKey::from_seed([77; 32]);
    let refs: Vec<&Keyspace> = stores.iter().collect();
    let trust = crate::tenants::records::admit_sample_gateways(&refs, &[&a, &b]);
    Net { _dirs: dirs, stores, trust, a, b, worker }
}

impl Net {
    fn spread(&self, from: usize, d: &Delta, now: u64) {
        for (i, ks) in self.stores.iter().enumerate() {
            if i != from {
                merge_scoped(ks, d.clone(), &[], &self.trust, now).unwrap();
            }
        }
    }

    /// A task of `n` requests enqueued by gateway A, 2 to a subtask.
    fn enqueue(&self, n: usize) -> String {
        self.enqueue_lines(n, false)
    }

    /// As [`Net::enqueue`], each request with its `custom_id` (`id<i>`)
    /// and the task with its batch's manifest, as a batch enqueues it.
    fn enqueue_batch(&self, n: usize) -> String {
        self.enqueue_lines(n, true)
    }

    fn enqueue_lines(&self, n: usize, batch: bool) -> String {
        let spec = TaskSpec {
            tenant_id: "tenant_123".into(),
            batch_id: Some("batch_00112233445566778899aabb".into()),
            params: TaskParams { v: 1, model: "m".into(), api_type: ApiType::ChatCompletion },
            cache_salt: "salt".into(),
            per_subtask: 2,
        };
        let lines: Vec<Line> = (0..n)
            .map(|i| Line {
                index: i as u64,
                custom_id: batch.then(|| format!("id{i}")),
                body: format!("request {i}").into_bytes(),
            })
            .collect();
        let (id, d) =
            chunks::enqueue(&self.stores[0], &self.a, &self.trust, &spec, &lines, NOW).unwrap();
        if batch {
            let task = records::stored(&self.stores[0], &id).unwrap().unwrap().task;
            manifest::write(&self.stores[0], &self.a, &task, b"the batch".to_vec(), NOW).unwrap();
        }
        self.spread(0, &d, NOW);
        id
    }

    /// Store `to` pulls from store `from` as gateway `asker`.
    fn pull(
        &self,
        from: usize,
        to: usize,
        asker: &NodeKey,
        task: &str,
        now: u64,
    ) -> (usize, usize) {
        let (inputs, outputs) =
            mirror::wanted(&self.stores[to], task, now, &mut Default::default()).unwrap();
        let p = MirrorPull {
            version: MIRROR_VERSION,
            asker: asker.node_id(),
            task_id: task.into(),
            inputs,
            outputs,
            manifest: false,
        };
        let page = mirror::answer(&self.stores[from], &self.trust, None, &p, now).unwrap();
        mirror::store(&self.stores[to], task, &page, now).unwrap()
    }
}

/// Gateways by node id; one of them cannot be reached.
struct Gateways<'a> {
    net: &'a Net,
    down: NodeId,
    clock: &'a AtomicU64,
    /// Requests that went to the gateway that is down.
    tried_down: AtomicU64,
}

impl Gateways<'_> {
    fn store(&self, g: &NodeId) -> Result<&Keyspace, ProcessingError> {
        if *g == self.down {
            self.tried_down.fetch_add(1, Ordering::SeqCst);
            return Err(ProcessingError::Gateway("connection refused".into()));
        }
        let i = if *g == self.net.a.node_id() { 0 } else { 1 };
        Ok(&self.net.stores[i])
    }
}

impl ChunkSource for Gateways<'_> {
    fn fetch(
        &self,
        me: &NodeId,
        g: &NodeId,
        lock: &Delta,
        task: &str,
        chunk: &str,
    ) -> Result<Vec<u8>, ProcessingError> {
        let ks = self.store(g)?;
        let now = self.clock.load(Ordering::SeqCst);
        chunks::present_lock(ks, lock.clone(), &self.net.trust, now)?;
        chunks::serve_chunk(ks, me, task, chunk, now)
            .map_err(|e| ProcessingError::GatewayRefused(e.to_string()))
    }
    fn deliver(&self, g: &NodeId, lock: &Delta, output: Vec<u8>) -> Result<(), ProcessingError> {
        let ks = self.store(g)?;
        let now = self.clock.load(Ordering::SeqCst);
        chunks::present_lock(ks, lock.clone(), &self.net.trust, now)?;
        chunks::accept_output(ks, &output, now)
            .map(|_| ())
            .map_err(|e| ProcessingError::GatewayRefused(e.to_string()))
    }
}

#[test]
fn only_a_gateway_of_the_tenant_pulls_and_it_gets_the_inputs_as_signed() {
    let n = net();
    let task = n.enqueue(6);
    let (inputs, outputs) =
        mirror::wanted(&n.stores[1], &task, NOW, &mut Default::default()).unwrap();
    assert_eq!((inputs.len(), outputs.len()), (6, 0));
    assert_eq!(n.pull(0, 1, &n.b, &task, NOW), (6, 0));
    assert_eq!(
        mirror::wanted(&n.stores[1], &task, NOW, &mut Default::default()).unwrap().0.len(),
        0,
        "nothing left"
    );
    assert_eq!(n.pull(0, 1, &n.b, &task, NOW), (0, 0), "the same pull again stores nothing");
    // The worker, a gateway presenting another's id, and an oversized
    // pull get nothing.
    let pull = |asker: &NodeKey, inputs: Vec<String>| MirrorPull {
        version: MIRROR_VERSION,
        asker: asker.node_id(),
        task_id: task.clone(),
        inputs,
        outputs: vec![],
        manifest: false,
    };
    let all: Vec<String> = (0..6).map(|i| format!("c{i}")).collect();
    let answer = |p: &MirrorPull, peer| mirror::answer(&n.stores[0], &n.trust, peer, p, NOW);
    assert!(answer(&pull(&n.worker, all.clone()), None).is_err(), "not a tenant gateway");
    let other_peer = crate::jobs::peer_of(&n.worker.node_id());
    assert!(answer(&pull(&n.b, all.clone()), other_peer).is_err(), "the sender is not the asker");
    let many: Vec<String> = (0..300).map(|i| format!("c{i}")).collect();
    assert!(answer(&pull(&n.b, many), None).is_err(), "over the pull bound");
    // Chunk ids of no subtask of the task are ignored.
    let page = answer(&pull(&n.b, vec!["c99".into(), "c1".into()]), None).unwrap();
    assert_eq!(page.inputs.len(), 1);
}

/// An input a mirror serves must be the task's gateway's, for a chunk the
/// task names: one signed by the other gateway, even of the same tenant,
/// is refused, and one for another chunk is not stored.
#[test]
fn a_mirrored_input_not_signed_by_the_tasks_gateway_is_refused() {
    let n = net();
    let task = n.enqueue(2);
    let mut c = chunks::InputChunk {
        message_type: MessageType::QueueJob,
        version: CHUNK_VERSION,
        task_id: task.clone(),
        chunk_id: "c0".into(),
        index: 0,
        custom_id: None,
        tenant_id: "tenant_123".into(),
        gateway_node_id: n.b.node_id(),
        api_type: ApiType::ChatCompletion,
        model: "m".into(),
        body: b"something else".to_vec(),
        cache_salt: "salt".into(),
        created_at_ms: NOW,
        signature: None,
    };
    gcs_protocol::sign(&mut c, &n.b).unwrap();
    let page = page_of_input(&c);
    assert!(mirror::store(&n.stores[2], &task, &page, NOW).is_err());
    assert!(n.stores[2].get_bytes(&keys::processing_chunk(&task, "c0")).unwrap().is_none());
    // Signed by the task's gateway, but for a chunk the task does not name:
    // not stored.
    c.gateway_node_id = n.a.node_id();
    (c.chunk_id, c.index, c.signature) = ("c9".into(), 9, None);
    gcs_protocol::sign(&mut c, &n.a).unwrap();
    let page = page_of_input(&c);
    assert_eq!(mirror::store(&n.stores[2], &task, &page, NOW).unwrap(), (0, 0));
    assert!(n.stores[2].get_bytes(&keys::processing_chunk(&task, "c9")).unwrap().is_none());
    // The task's gateway's own input with a custom_id over the bound:
    // refused, not stored.
    (c.chunk_id, c.index, c.signature) = ("c1".into(), 1, None);
    c.custom_id = Some("x".repeat(chunks::MAX_CUSTOM_ID + 1));
    gcs_protocol::sign(&mut c, &n.a).unwrap();
    let page = page_of_input(&c);
    assert!(mirror::store(&n.stores[2], &task, &page, NOW).is_err());
    assert!(n.stores[2].get_bytes(&keys::processing_chunk(&task, "c1")).unwrap().is_none());
}

/// A mirror page holding the one input chunk `c`.
fn page_of_input(c: &chunks::InputChunk) -> mirror::MirrorPage {
    mirror::MirrorPage {
        inputs: vec![serde_bytes::ByteBuf::from(gcs_protocol::encode(c).unwrap())],
        outputs: vec![],
        manifest: None,
    }
}

/// The task's gateway cannot be reached: the worker fetches and delivers
/// through the tenant's other gateway, which mirrored the inputs; the
/// task's gateway, back, pulls the answers and collects every one.
#[test]
fn a_subtask_runs_through_the_other_gateway_and_its_answers_come_back() {
    let n = net();
    let task = n.enqueue(4);
    assert_eq!(n.pull(0, 1, &n.b, &task, NOW), (4, 0));
    let clock = std::sync::Arc::new(AtomicU64::new(NOW + 1));
    let exec = Echo { clock: clock.clone(), step_ms: 1, ..Echo::default() };
    let models = vec!["m".to_string()];
    let (avoid, unreachable) = Default::default();
    let p = Processor {
        ks: &n.stores[2],
        key: &n.worker,
        trust: &n.trust,
        executor: &exec,
        models: &models,
        lease_ms: 10_000,
        avoid: &avoid,
        unreachable: &unreachable,
    };
    let src =
        Gateways { net: &n, down: n.a.node_id(), clock: &clock, tried_down: AtomicU64::new(0) };
    let cancel = AtomicBool::new(false);
    let mut ran = 0;
    for _ in 0..2 {
        let mut out = vec![];
        let now = || clock.load(Ordering::SeqCst);
        let done = p.step(&src, &cancel, &now, &mut |d| out.push(d)).unwrap();
        ran += done.map_or(0, |d| d.lines);
        for d in &out {
            n.spread(2, d, clock.load(Ordering::SeqCst));
        }
    }
    assert_eq!(ran, 4, "both subtasks ran with gateway A down");
    // 4 fetches and 4 deliveries; A was asked once, then passed over for a lease.
    assert_eq!(src.tried_down.load(Ordering::SeqCst), 1);
    let now = clock.load(Ordering::SeqCst);
    let none = Default::default();
    assert_eq!(chunks::collect(&n.stores[1], &task, now, &none).unwrap().outputs.len(), 4);
    let before = chunks::collect(&n.stores[0], &task, now, &none).unwrap();
    assert_eq!(
        (before.outputs.len(), before.missing),
        (0, 4),
        "A holds the results, not the answers"
    );
    assert_eq!(
        mirror::wanted(&n.stores[0], &task, now, &mut Default::default()).unwrap().1.len(),
        4
    );
    assert_eq!(n.pull(1, 0, &n.a, &task, now), (0, 4));
    let after = chunks::collect(&n.stores[0], &task, now, &none).unwrap();
    let idx: Vec<u64> = after.outputs.iter().map(|o| o.index).collect();
    assert_eq!((idx, after.missing, after.open), (vec![0, 1, 2, 3], 0, 0));
    assert_eq!(after.outputs[2].body, r#"{"echo":"request 2"}"#);
    // The outsider store (no gateway of the tenant) was never asked; a
    // gateway that is the tenant's only one has no one to pull from.
    assert!(mirror::tenant_gateways(&n.stores[3], &n.trust, &task_record(&n, &task), now)
        .contains(&n.b.node_id()));
}

fn task_record(n: &Net, task: &str) -> super::records::TaskRecord {
    super::records::stored(&n.stores[0], task).unwrap().unwrap().task
}

/// A batch's manifest goes only to the tenant's gateways, as its task's
/// gateway signed it; with it and every input, the other gateway finds the
/// whole batch (its tasks and each request's `custom_id`) and may cancel
/// the task in the network. A manifest signed by another gateway, or
/// asked for under another tenant, finds nothing.
#[test]
fn a_batch_manifest_reaches_the_tenants_other_gateway_which_then_finds_the_batch() {
    let n = net();
    let task = n.enqueue_batch(4);
    let batch = "batch_00112233445566778899aabb";
    let find =
        |ks: &Keyspace, tenant: &str| manifest::find(ks, &n.trust, tenant, batch, NOW).unwrap();
    assert!(find(&n.stores[1], "tenant_123").is_none(), "nothing mirrored yet");
    let t = records::stored(&n.stores[1], &task).unwrap().unwrap().task;
    let mut held = mirror::Held::default();
    assert!(mirror::wants_manifest(&n.stores[1], &t, &mut held).unwrap());
    let (inputs, outputs) = mirror::wanted(&n.stores[1], &task, NOW, &mut held).unwrap();
    let p = MirrorPull {
        version: MIRROR_VERSION,
        asker: n.b.node_id(),
        task_id: task.clone(),
        inputs,
        outputs,
        manifest: true,
    };
    let worker_asks = MirrorPull { asker: n.worker.node_id(), ..p.clone() };
    assert!(mirror::answer(&n.stores[0], &n.trust, None, &worker_asks, NOW).is_err());
    let page = mirror::answer(&n.stores[0], &n.trust, None, &p, NOW).unwrap();
    let m = page.manifest.clone().unwrap();
    // Another gateway's signature over the same manifest: refused.
    let mut forged = manifest::check(&t, &m).unwrap();
    (forged.gateway_node_id, forged.signature) = (n.b.node_id(), None);
    gcs_protocol::sign(&mut forged, &n.b).unwrap();
    let forged = gcs_protocol::encode(&forged).unwrap();
    assert!(mirror::store_manifest(&n.stores[1], &task, &forged, NOW).is_err());
    assert!(mirror::store_manifest(&n.stores[1], &task, &m, NOW).unwrap());
    assert!(!mirror::store_manifest(&n.stores[1], &task, &m, NOW).unwrap(), "once");
    assert!(find(&n.stores[1], "tenant_123").is_none(), "the inputs are not here yet");
    mirror::store(&n.stores[1], &task, &page, NOW).unwrap();
    let f = find(&n.stores[1], "tenant_123").unwrap();
    assert_eq!(f.creator, n.a.node_id());
    assert_eq!(f.batch, b"the batch");
    assert_eq!(f.tasks, vec![("m".to_string(), task.clone())]);
    let ids: Vec<(u64, String)> = (0..4).map(|i| (i, format!("id{i}"))).collect();
    assert_eq!(f.custom_ids, ids);
    assert!(find(&n.stores[1], "tenant_other").is_none(), "another tenant's");
    assert!(!mirror::wants_manifest(&n.stores[1], &t, &mut mirror::Held::default()).unwrap());
    // The taking-over gateway cancels the task; the worker's store takes it.
    let d = records::cancel(&n.stores[1], &task, "batch_cancelled", &n.b, &n.trust, NOW + 1)
        .unwrap()
        .unwrap();
    merge_scoped(&n.stores[2], d, &[], &n.trust, NOW + 1).unwrap();
    assert!(records::replay(&records::stored(&n.stores[2], &task).unwrap().unwrap(), NOW + 2)
        .cancelled(&task));
}
