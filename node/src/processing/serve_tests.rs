//! The job-protocol side of the processing queue (serve.rs) and the
//! gateway's collection (batch.rs) on real stores: a fetch or delivery is
//! answered only under a lock the asking peer signed, a lock gossip has not
//! carried yet is merged from the request, an output signed by another node
//! than the lock's is refused; each collected answer is metered once, under
//! the same id on every collection; registrations advertise capacity.
#![allow(clippy::unwrap_used)]

use gcs_gateway::backend::ProcessingMeter;
use gcs_keyspace::{keys, Keyspace};
use gcs_protocol::{samples, ApiType, Hash32, MessageType, NodeKey, SubTaskResult};

use super::batch;
use super::chunks::{
    self, Line, OutputChunk, ProcessingError, TaskParams, TaskSpec, CHUNK_VERSION,
};
use super::records;
use super::serve;
use crate::jobs::wire::{ChunkFetch, OutputDelivery, PROCESSING_WIRE_VERSION};
use crate::replication::merge_scoped;

const NOW: u64 = 1_000_000;

struct Net {
    _dirs: Vec<tempfile::TempDir>,
    stores: Vec<Keyspace>,
    trust: crate::tenants::TrustHandle,
    gateway: NodeKey,
    worker: NodeKey,
    other: NodeKey,
}

fn net() -> Net {
    let mut dirs = vec![];
    let mut stores = vec![];
    for name in ["g", "w"] {
        let d = tempfile::tempdir().unwrap();
        stores.push(Keyspace::open(d.path(), name, Default::default()).unwrap());
        dirs.push(d);
    }
    let (worker, gateway) = samples::keys();
    let refs: Vec<&Keyspace> = stores.iter().collect();
    let trust = crate::tenants::records::admit_sample_gateway(&refs, &gateway);
    Net { _dirs: dirs, stores, trust, gateway, worker, other: NodeKey::from_seed([77; 32]) }
}

/// A task of two requests in one subtask, carried to the worker's store.
fn task(n: &Net) -> String {
    let spec = TaskSpec {
        tenant_id: "tenant_123".into(),
        batch_id: Some("batch_00112233445566778899aabb".into()),
        params: TaskParams {
            v: CHUNK_VERSION,
            model: "m".into(),
            api_type: ApiType::ChatCompletion,
        },
        cache_salt: "salt".into(),
        per_subtask: 2,
    };
    let lines = vec![
        Line { index: 0, custom_id: None, body: chat("a") },
        Line { index: 1, custom_id: None, body: chat("b") },
    ];
    let (id, d) = chunks::enqueue(&n.stores[0], &n.gateway, &n.trust, &spec, &lines, NOW).unwrap();
    merge_scoped(&n.stores[1], d, &[], &n.trust, NOW).unwrap();
    id
}

/// A chat request's payload, at most [`MAX_TOKENS`] generated.
fn chat(text: &str) -> Vec<u8> {
    use gcs_gateway::payload::{Generation, JobRequest, Message, Prompt, Role};
    JobRequest::Generation(Generation {
        prompt: Prompt::Chat(vec![Message::text(Role::User, text)]),
        max_tokens: MAX_TOKENS,
        sampling: Default::default(),
        stop: vec![],
        logprobs: None,
        constraint: None,
        tools: None,
    })
    .encode()
    .unwrap()
}

const MAX_TOKENS: u32 = 16;

fn peer(k: &NodeKey) -> Option<libp2p::PeerId> {
    crate::jobs::peer_of(&k.node_id())
}

fn output(n: &Net, by: &NodeKey, task: &str, lock_id: &str, index: u64) -> Vec<u8> {
    metered(n, by, task, lock_id, index, (3, 2), (3, 2))
}

/// An output metering `(input, output)` tokens whose body's usage says `said`.
fn metered(
    n: &Net,
    by: &NodeKey,
    task: &str,
    lock_id: &str,
    index: u64,
    (input_tokens, output_tokens): (u64, u64),
    said: (u64, u64),
) -> Vec<u8> {
    let input = n.stores[0]
        .get_bytes(&keys::processing_chunk(task, &format!("c{index}")))
        .unwrap()
        .unwrap();
    let mut o = OutputChunk {
        message_type: MessageType::TaskResult,
        version: CHUNK_VERSION,
        task_id: task.into(),
        chunk_id: format!("c{index}"),
        index,
        input_hash: Hash32::of(&input),
        lock_id: lock_id.into(),
        node_id: by.node_id(),
        status: 200,
        body: serde_json::json!({"ok": true, "usage": {"prompt_tokens": said.0, "completion_tokens": said.1}})
            .to_string(),
        input_tokens,
        output_tokens,
        created_at_ms: NOW + 2,
        signature: None,
    };
    gcs_protocol::sign(&mut o, by).unwrap();
    gcs_protocol::encode(&o).unwrap()
}

#[test]
fn only_the_lock_signer_fetches_and_a_lock_not_yet_gossiped_is_merged_from_the_request() {
    let n = net();
    let task = task(&n);
    // The worker's lock, stored only on its own side so far.
    let (lock, d) =
        records::grab(&n.stores[1], &task, &n.worker, 10_000, &n.trust, NOW + 1).unwrap().unwrap();
    let f = ChunkFetch {
        version: PROCESSING_WIRE_VERSION,
        lock: d.encode(),
        task_id: task.clone(),
        chunk_id: "c1".into(),
    };
    // Another peer presenting the holder's lock gets nothing.
    let r = serve::fetch(&n.stores[0], &n.trust, peer(&n.other), &f, NOW + 1);
    assert!(matches!(r, Err(ProcessingError::NotHolder)), "{r:?}");
    let bytes = serve::fetch(&n.stores[0], &n.trust, peer(&n.worker), &f, NOW + 1).unwrap();
    assert_eq!(
        bytes,
        n.stores[0].get_bytes(&keys::processing_chunk(&task, "c1")).unwrap().unwrap()
    );
    assert!(
        n.stores[0]
            .get_bytes(&keys::processing_lock(&lock.task_key, &lock.lock_id))
            .unwrap()
            .is_some(),
        "the lock was merged"
    );
    // Another version of the request, or a record that is no lock, is refused.
    let v2 = ChunkFetch { version: 2, ..f.clone() };
    assert!(serve::fetch(&n.stores[0], &n.trust, peer(&n.worker), &v2, NOW + 1).is_err());
    let task_delta = n.stores[0].get(&keys::processing_task(&task)).unwrap().unwrap();
    let not_lock = gcs_keyspace::Delta { key: keys::processing_task(&task), value: task_delta };
    let bad = ChunkFetch { lock: not_lock.encode(), ..f.clone() };
    assert!(serve::fetch(&n.stores[0], &n.trust, peer(&n.worker), &bad, NOW + 1).is_err());
    // After the lease, the holder's own fetch is refused too.
    let late = serve::fetch(&n.stores[0], &n.trust, peer(&n.worker), &f, NOW + 20_000);
    assert!(late.is_err(), "{late:?}");
}

#[test]
fn a_delivery_is_kept_only_from_the_lock_holder_and_collected_answers_are_metered_once() {
    let n = net();
    let task = task(&n);
    let (lock, d) =
        records::grab(&n.stores[1], &task, &n.worker, 10_000, &n.trust, NOW + 1).unwrap().unwrap();
    let deliver = |by: &NodeKey, from: &NodeKey, index: u64| {
        let o = OutputDelivery {
            version: PROCESSING_WIRE_VERSION,
            lock: d.encode(),
            output: output(&n, by, &task, &lock.lock_id, index),
        };
        serve::deliver(&n.stores[0], &n.trust, peer(from), &o, NOW + 2)
    };
    // Signed by another node than the lock's, or sent by one: refused.
    assert!(deliver(&n.other, &n.worker, 0).is_err());
    assert!(deliver(&n.worker, &n.other, 0).is_err());
    let mut hashes = vec![];
    for i in 0..2 {
        deliver(&n.worker, &n.worker, i).unwrap();
        hashes.push(Hash32::of(&output(&n, &n.worker, &task, &lock.lock_id, i)));
    }
    let result = SubTaskResult {
        subtask_id: "s0".into(),
        result_hash: chunks::block_hash(&hashes),
        chunk_hashes: hashes,
    };
    let rd = records::complete(&n.stores[1], &task, result, &n.worker, &n.trust, NOW + 3).unwrap();
    merge_scoped(&n.stores[0], rd, &[], &n.trust, NOW + 3).unwrap();
    let meter = ProcessingMeter {
        batch_id: "batch_00112233445566778899aabb".into(),
        tenant_id: "tenant_123".into(),
        project_id: "p".into(),
        api_key_id: "key_1".into(),
        api_type: ApiType::ChatCompletion,
        model: "m".into(),
        price_percent: Some(50),
    };
    let none = Default::default();
    let (p, deltas) =
        batch::collect_here(&n.stores[0], &n.gateway, &task, &meter, &none, NOW + 4).unwrap();
    assert_eq!((p.answered.len(), p.open, p.bad.len(), deltas.len()), (2, 0, 0, 2));
    assert_eq!(p.answered[1].index, 1);
    assert_eq!(p.answered[1].body["usage"]["completion_tokens"], 2);
    let u: gcs_protocol::UsageRecord =
        n.stores[0].get_cbor(&keys::usage(&p.answered[0].request_id)).unwrap().unwrap();
    assert_eq!(u.batch_id.as_deref(), Some("batch_00112233445566778899aabb"));
    assert_eq!((u.price_percent, u.input_tokens, u.output_tokens_generated), (Some(50), 3, 2));
    assert_eq!(u.node_id, Some(n.worker.node_id()));
    // Collected again (a restart): the same ids, nothing metered twice.
    let (again, deltas) =
        batch::collect_here(&n.stores[0], &n.gateway, &task, &meter, &none, NOW + 9).unwrap();
    assert!(deltas.is_empty());
    let ids = |p: &gcs_gateway::backend::TaskProgress| {
        p.answered.iter().map(|a| a.request_id.clone()).collect::<Vec<_>>()
    };
    assert_eq!(ids(&again), ids(&p));
    // A request the caller holds already is left out, and only it.
    let skip = [0u64].into_iter().collect();
    let (rest, _) =
        batch::collect_here(&n.stores[0], &n.gateway, &task, &meter, &skip, NOW + 9).unwrap();
    let idx: Vec<u64> = rest.answered.iter().map(|a| a.index).collect();
    assert_eq!((idx, rest.open, rest.bad.len()), (vec![1], 0, 0));
}

/// A worker that over-reports what an answer cost is refused before its
/// counts reach the gateway-signed usage record: more generated tokens than
/// the request's max_tokens, more prompt tokens than its payload can hold,
/// or counts its own answer's `usage` contradicts. The honest answer under
/// the same lock is then taken.
#[test]
fn an_output_metering_past_the_requests_bounds_is_refused() {
    let n = net();
    let task = task(&n);
    let (lock, d) =
        records::grab(&n.stores[1], &task, &n.worker, 10_000, &n.trust, NOW + 1).unwrap().unwrap();
    let deliver = |m: (u64, u64), said: (u64, u64)| {
        let output = metered(&n, &n.worker, &task, &lock.lock_id, 0, m, said);
        let o = OutputDelivery { version: PROCESSING_WIRE_VERSION, lock: d.encode(), output };
        serve::deliver(&n.stores[0], &n.trust, peer(&n.worker), &o, NOW + 2)
    };
    let max = u64::from(MAX_TOKENS);
    let r = deliver((3, max + 1), (3, max + 1));
    assert!(matches!(r, Err(ProcessingError::TooLarge(_))), "{r:?}");
    let big = 1_000_000;
    let r = deliver((big, 2), (big, 2));
    assert!(matches!(r, Err(ProcessingError::TooLarge(_))), "{r:?}");
    let r = deliver((3, 2), (3, 9));
    assert!(matches!(r, Err(ProcessingError::Mismatch(_))), "{r:?}");
    let key = keys::processing_output(&task, "c0", &lock.lock_id);
    assert!(n.stores[0].get_bytes(&key).unwrap().is_none(), "nothing refused was kept");
    deliver((3, max), (3, max)).unwrap();
    assert!(n.stores[0].get_bytes(&key).unwrap().is_some());
}

#[test]
fn capacity_needs_processing_slots_for_the_model() {
    let (w, _) = samples::keys();
    let mut reg = samples::registration(&w, &samples::Params::default());
    let model = reg.models[0].model_id.clone();
    assert!(!batch::capacity(std::slice::from_ref(&reg), &model), "no processing capability");
    reg.capabilities.processing_chunk_job = true;
    assert!(!batch::capacity(std::slice::from_ref(&reg), &model), "no processing slots");
    reg.queue.max_concurrent_processing_jobs = 1;
    assert!(batch::capacity(std::slice::from_ref(&reg), &model));
    assert!(!batch::capacity(std::slice::from_ref(&reg), "another-model"));
}
