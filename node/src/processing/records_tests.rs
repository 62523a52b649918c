//! One test per authority row of the processing records, and a task's state
//! rebuilt from its records on another node.
#![allow(clippy::unwrap_used)]

use gcs_keyspace::{keys, Delta, Keyspace, MergeOutcome};
use gcs_protocol::{
    samples, Hash32, MessageType, NodeKey, ProcessingSubTask, ProcessingTask, SubTaskResult,
    TaskLock, TaskResult, PROTOCOL_VERSION,
};

use super::records::*;
use crate::error::RefusedDelta;
use crate::replication::merge_scoped;
use crate::tenants::TenantTrust;

pub(super) const NOW: u64 = 1_000_000;
pub(super) const TASK: &str = "task_01JDZ0000000000000000000AA";

pub(super) fn store() -> (tempfile::TempDir, Keyspace) {
    let d = tempfile::tempdir().unwrap();
    let ks = Keyspace::open(d.path(), "a", Default::default()).unwrap();
    (d, ks)
}

pub(super) fn task(subs: u32) -> (ProcessingTask, Vec<ProcessingSubTask>) {
    let t = ProcessingTask {
        version: 1,
        task_id: TASK.into(),
        parent: None,
        input_ref: "file-x".into(),
        results_channel: "batch_x".into(),
        json_data: "{}".into(),
        random_seed: 0,
        subtask_count: subs,
        created_at_ms: NOW,
    };
    let s = (0..subs)
        .map(|i| ProcessingSubTask {
            version: 1,
            task_id: TASK.into(),
            subtask_id: format!("s{i}"),
            chunk_ids: vec!["c0".into(), "c1".into()],
            datablock_hash: Hash32::of(b"x"),
        })
        .collect();
    (t, s)
}

pub(super) fn record(gateway: &NodeKey, subs: u32) -> TaskRecord {
    let (t, s) = task(subs);
    let mut r = TaskRecord::new("tenant_123", &gateway.node_id(), t, s, NOW);
    r.batch_id = Some("batch_00112233445566778899aabb".into());
    r
}

pub(super) fn lock(sub: &str, id: &str, node: &NodeKey, created: u64) -> TaskLock {
    TaskLock {
        message_type: MessageType::TaskLock,
        version: PROTOCOL_VERSION,
        task_key: format!("{TASK}/{sub}"),
        lock_id: id.into(),
        node_id: node.node_id(),
        created_at_ms: created,
        expires_at_ms: created + 60_000,
        signature: None,
    }
}

pub(super) fn result(sub: &str, node: &NodeKey, at: u64) -> TaskResult {
    TaskResult {
        message_type: MessageType::TaskResult,
        version: PROTOCOL_VERSION,
        task_id: TASK.into(),
        node_id: node.node_id(),
        subtask_results: vec![SubTaskResult {
            subtask_id: sub.into(),
            result_hash: Hash32::of(sub.as_bytes()),
            chunk_hashes: vec![Hash32::of(b"c"); 2],
        }],
        created_at_ms: at,
        signature: None,
    }
}

pub(super) const L1: &str = "lock_01JDZ0000000000000000000A1";
pub(super) const L2: &str = "lock_01JDZ0000000000000000000A2";

/// Two nodes' stores with the sample gateway admitted by tenant_123.
pub(super) fn two() -> (
    tempfile::TempDir,
    Keyspace,
    tempfile::TempDir,
    Keyspace,
    std::sync::Arc<TenantTrust>,
    NodeKey,
    NodeKey,
) {
    let (da, a) = store();
    let (db, b) = store();
    let (worker, gateway) = samples::keys();
    let trust = crate::tenants::records::admit_sample_gateway(&[&a, &b], &gateway);
    (da, a, db, b, trust, worker, gateway)
}

pub(super) fn signed_delta<T: gcs_protocol::SignedMessage>(
    ks: &Keyspace,
    key: &str,
    mut m: T,
    k: &NodeKey,
) -> Delta {
    gcs_protocol::sign(&mut m, k).unwrap();
    ks.put(key, gcs_protocol::encode(&m).unwrap(), NOW).unwrap()
}

#[test]
fn a_task_comes_only_from_a_gateway_its_tenant_admitted() {
    let (_da, a, _db, b, trust, worker, gateway) = two();
    let d = write(&a, &keys::processing_task(TASK), record(&gateway, 2), &gateway, &trust, NOW)
        .unwrap();
    assert!(matches!(
        merge_scoped(&b, d.clone(), &[], &trust, NOW).unwrap(),
        MergeOutcome::Changed(_)
    ));
    assert!(matches!(merge_scoped(&b, d, &[], &trust, NOW).unwrap(), MergeOutcome::Unchanged));
    // A worker (no tenant_gateway certificate) signing a task of its own.
    let (_dc, c) = store();
    let mut r = record(&worker, 2);
    r.job =
        gcs_protocol::QueueJob::wrap(gcs_protocol::QueueJobBody::ProcessingTask(ProcessingTask {
            task_id: "task_01JDZ0000000000000000000BB".into(),
            ..task(2).0
        }));
    r.subtasks.iter_mut().for_each(|s| s.task_id = "task_01JDZ0000000000000000000BB".into());
    let forged =
        signed_delta(&c, &keys::processing_task("task_01JDZ0000000000000000000BB"), r, &worker);
    let e = merge_scoped(&b, forged, &[], &trust, NOW).unwrap_err();
    assert!(matches!(e, RefusedDelta::GatewayNotAdmitted(_)), "{e}");
    // The admitted gateway's name on a record the worker signed.
    let mut r = record(&gateway, 2);
    r.gateway_node_id = gateway.node_id();
    let mut bytes_rec = r.clone();
    gcs_protocol::sign(&mut bytes_rec, &gateway).unwrap();
    bytes_rec.subtasks[0].chunk_ids.push("extra".into());
    let tampered = c
        .put(&keys::processing_task(TASK), gcs_protocol::encode(&bytes_rec).unwrap(), NOW)
        .unwrap();
    let (_dd, dks) = store();
    assert!(
        merge_scoped(&dks, tampered, &[], &trust, NOW).is_err(),
        "a changed task fails its signature"
    );
    // A task id once: a second, different record for it is refused.
    let mut again = record(&gateway, 3);
    again.created_at_ms = NOW + 1;
    let d2 = signed_delta(&c, &keys::processing_task(TASK), again, &gateway);
    assert!(matches!(
        merge_scoped(&b, d2, &[], &trust, NOW).unwrap_err(),
        RefusedDelta::NotTheAuthor(_)
    ));
}

#[test]
fn oversized_or_misfiled_task_records_are_refused() {
    let (_da, a, _db, b, trust, _worker, gateway) = two();
    let mut r = record(&gateway, 1);
    r.subtasks[0].chunk_ids = vec!["c".repeat(100); MAX_CHUNKS_PER_SUBTASK + 1];
    assert!(write(&a, &keys::processing_task(TASK), r, &gateway, &trust, NOW).is_err());
    let mut r = record(&gateway, 1);
    r.subtasks[0].chunk_ids = (0..200).map(|i| format!("{i:0>120}")).collect();
    r.job =
        gcs_protocol::QueueJob::wrap(gcs_protocol::QueueJobBody::ProcessingTask(ProcessingTask {
            json_data: "x".repeat(MAX_TASK_RECORD_BYTES),
            ..task(1).0
        }));
    let big = signed_delta(&a, &keys::processing_task(TASK), r, &gateway);
    assert!(merge_scoped(&b, big, &[], &trust, NOW).is_err(), "over the size bound");
    let other = "task_01JDZ0000000000000000000CC";
    let misfiled = signed_delta(&a, &keys::processing_task(other), record(&gateway, 1), &gateway);
    let e = merge_scoped(&b, misfiled, &[], &trust, NOW).unwrap_err();
    assert!(matches!(e, RefusedDelta::Misfiled { .. }), "{e}");
    // Subtasks travel in their task: their own namespace takes nothing.
    let sub = a
        .put(&format!("{}x", gcs_keyspace::Namespace::ProcessingSubtasks.prefix()), vec![1], NOW)
        .unwrap();
    assert!(matches!(
        merge_scoped(&b, sub, &[], &trust, NOW).unwrap_err(),
        RefusedDelta::NotFromPeers(_)
    ));
}

#[test]
fn a_lock_is_the_signers_and_obeys_first_valid_lock_wins() {
    let (_da, a, _db, b, trust, worker, gateway) = two();
    let t = write(&a, &keys::processing_task(TASK), record(&gateway, 2), &gateway, &trust, NOW)
        .unwrap();
    // A lock for a task this node does not hold yet is refused.
    let (_dc, scratch) = store();
    let early = signed_delta(
        &scratch,
        &keys::processing_lock(&format!("{TASK}/s0"), L1),
        lock("s0", L1, &worker, NOW),
        &worker,
    );
    assert!(merge_scoped(&b, early.clone(), &[], &trust, NOW).is_err());
    merge_scoped(&b, t, &[], &trust, NOW).unwrap();
    let l1 = write(
        &a,
        &keys::processing_lock(&format!("{TASK}/s0"), L1),
        lock("s0", L1, &worker, NOW),
        &worker,
        &trust,
        NOW + 1,
    )
    .unwrap();
    merge_scoped(&b, l1, &[], &trust, NOW + 1).unwrap();
    // Another worker's lock on the held subtask, created later: refused.
    let other = NodeKey::from_seed([9; 32]);
    let late = signed_delta(
        &a,
        &keys::processing_lock(&format!("{TASK}/s0"), L2),
        lock("s0", L2, &other, NOW + 10_000),
        &other,
    );
    assert!(merge_scoped(&b, late, &[], &trust, NOW + 10_000).is_err(), "first valid lock wins");
    // A lock naming the worker but signed by another key: refused.
    let mut forged = lock("s1", L2, &worker, NOW);
    gcs_protocol::sign(&mut forged, &worker).unwrap();
    forged.node_id = other.node_id();
    let fd = a
        .put(
            &keys::processing_lock(&format!("{TASK}/s1"), L2),
            gcs_protocol::encode(&forged).unwrap(),
            NOW,
        )
        .unwrap();
    assert!(merge_scoped(&b, fd, &[], &trust, NOW).is_err(), "forged signer");
    // Once the lock expired the subtask is free for another worker.
    let after = NOW + 70_000;
    let take = signed_delta(
        &a,
        &keys::processing_lock(&format!("{TASK}/s0"), L2),
        lock("s0", L2, &other, after),
        &other,
    );
    assert!(matches!(
        merge_scoped(&b, take, &[], &trust, after).unwrap(),
        MergeOutcome::Changed(_)
    ));
}

/// A lock whose ULID id claims a time before the subtask's earlier lock
/// would, replayed at that origin, hold the subtask through that lock's
/// term and erase its expiry: refused, so three expiries still make the
/// subtask bad.
#[test]
fn a_backdated_lock_id_cannot_erase_a_subtasks_failures() {
    let (_da, a, _db, b, trust, worker, gateway) = two();
    let t = write(&a, &keys::processing_task(TASK), record(&gateway, 1), &gateway, &trust, NOW)
        .unwrap();
    merge_scoped(&b, t, &[], &trust, NOW).unwrap();
    let other = NodeKey::from_seed([9; 32]);
    let sub = format!("{TASK}/s0");
    // Three locks, each left to expire (60 s) unanswered.
    for (i, at) in [NOW, NOW + 70_000, NOW + 140_000].into_iter().enumerate() {
        let id = gcs_protocol::ids::id_from_parts(gcs_protocol::ids::LOCK, at, i as u128);
        let l = lock("s0", &id, &worker, at);
        let d = signed_delta(&a, &keys::processing_lock(&sub, &id), l, &worker);
        merge_scoped(&b, d, &[], &trust, at).unwrap();
        // Between expiries the subtask is free; a lock whose id dates from
        // before the first one is refused.
        let at = at + 65_000;
        let back = gcs_protocol::ids::id_from_parts(gcs_protocol::ids::LOCK, NOW - 10_000, 99);
        let l = lock("s0", &back, &other, at);
        let d = signed_delta(&a, &keys::processing_lock(&sub, &back), l, &other);
        let e = merge_scoped(&b, d, &[], &trust, at);
        assert!(e.is_err(), "backdated lock accepted after expiry {i}: {e:?}");
    }
    let s = super::replay::stored(&b, TASK).unwrap().unwrap();
    let q = super::replay::replay(&s, NOW + 205_000);
    assert_eq!(q.bad(TASK, "s0"), Some("lock expired without a result"));
}

/// A node down while a worker held a subtask and answered it gets the lock
/// only after it expired: judged when it was made, it is kept, and so is
/// its result (else the task never completes there). A late lock that
/// would take a result away is refused.
#[test]
fn a_lock_that_arrives_after_it_expired_counts_unless_it_undoes_a_result() {
    let (_da, a, _db, b, trust, worker, gateway) = two();
    let t = write(&a, &keys::processing_task(TASK), record(&gateway, 2), &gateway, &trust, NOW)
        .unwrap();
    merge_scoped(&b, t, &[], &trust, NOW).unwrap();
    let k0 = format!("{TASK}/s0");
    let l1 = write(
        &a,
        &keys::processing_lock(&k0, L1),
        lock("s0", L1, &worker, NOW),
        &worker,
        &trust,
        NOW,
    )
    .unwrap();
    let r = write(
        &a,
        &keys::processing_result(&k0, &worker.node_id().to_string()),
        result("s0", &worker, NOW + 10),
        &worker,
        &trust,
        NOW + 10,
    )
    .unwrap();
    // b hears of both only 100 s later, when the lock has expired.
    let late = NOW + 100_000;
    merge_scoped(&b, l1, &[], &trust, late).unwrap();
    merge_scoped(&b, r, &[], &trust, late).unwrap();
    let q = super::replay::replay(&super::replay::stored(&b, TASK).unwrap().unwrap(), late);
    assert!(q.result(TASK, "s0").is_some(), "the late lock's result counts");
    // s1 answered under L2; a lock dated just before it, expired by now,
    // would have held s1 through L2's grab and erased L2's result.
    let other = NodeKey::from_seed([9; 32]);
    let k1 = format!("{TASK}/s1");
    let l2 = write(
        &a,
        &keys::processing_lock(&k1, L2),
        lock("s1", L2, &worker, NOW + 200),
        &worker,
        &trust,
        NOW + 200,
    )
    .unwrap();
    merge_scoped(&b, l2, &[], &trust, NOW + 200).unwrap();
    let r2 = write(
        &a,
        &keys::processing_result(&k1, &worker.node_id().to_string()),
        result("s1", &worker, NOW + 300),
        &worker,
        &trust,
        NOW + 300,
    )
    .unwrap();
    merge_scoped(&b, r2, &[], &trust, NOW + 300).unwrap();
    let back = gcs_protocol::ids::id_from_parts(gcs_protocol::ids::LOCK, NOW + 100, 5);
    let mut x = lock("s1", &back, &other, NOW + 100);
    x.expires_at_ms = NOW + 400;
    let d = signed_delta(&a, &keys::processing_lock(&k1, &back), x, &other);
    assert!(merge_scoped(&b, d, &[], &trust, late).is_err(), "it would undo s1's result");
    let q = super::replay::replay(&super::replay::stored(&b, TASK).unwrap().unwrap(), late);
    assert!(q.result(TASK, "s1").is_some());
}

#[test]
fn a_result_comes_only_from_the_lock_holder_and_once() {
    let (_da, a, _db, b, trust, worker, gateway) = two();
    for ks in [&a, &b] {
        write(ks, &keys::processing_task(TASK), record(&gateway, 2), &gateway, &trust, NOW)
            .unwrap();
        write(
            ks,
            &keys::processing_lock(&format!("{TASK}/s0"), L1),
            lock("s0", L1, &worker, NOW),
            &worker,
            &trust,
            NOW,
        )
        .unwrap();
    }
    let other = NodeKey::from_seed([9; 32]);
    let key_of =
        |n: &NodeKey| keys::processing_result(&format!("{TASK}/s0"), &n.node_id().to_string());
    let key = key_of(&worker);
    let stolen = signed_delta(&a, &key_of(&other), result("s0", &other, NOW + 5), &other);
    // Not the holder: refused, and not penalised (its lock may be on its
    // way), so gossip only drops it.
    assert!(matches!(
        merge_scoped(&b, stolen, &[], &trust, NOW + 5).unwrap_err(),
        RefusedDelta::Stale(_)
    ));
    let unlocked = signed_delta(
        &a,
        &keys::processing_result(&format!("{TASK}/s1"), &worker.node_id().to_string()),
        result("s1", &worker, NOW + 5),
        &worker,
    );
    assert!(merge_scoped(&b, unlocked, &[], &trust, NOW + 5).is_err(), "no lock on s1");
    let late = signed_delta(&a, &key, result("s0", &worker, NOW + 61_000), &worker);
    assert!(
        merge_scoped(&b, late, &[], &trust, NOW + 61_000).is_err(),
        "made after its lock expired"
    );
    let ok = signed_delta(&a, &key, result("s0", &worker, NOW + 5), &worker);
    // Replicated after the lock expired, it still counts: it was made under it.
    assert!(matches!(
        merge_scoped(&b, ok, &[], &trust, NOW + 90_000).unwrap(),
        MergeOutcome::Changed(_)
    ));
    let again = signed_delta(&a, &key, result("s0", &worker, NOW + 6), &worker);
    assert!(merge_scoped(&b, again, &[], &trust, NOW + 7).is_err(), "a result once");
    let mut two_subs = result("s0", &worker, NOW + 5);
    two_subs.subtask_results.push(two_subs.subtask_results[0].clone());
    let d = signed_delta(&a, &key, two_subs, &worker);
    let (_dc, c) = store();
    assert!(merge_scoped(&c, d, &[], &trust, NOW).is_err(), "one subtask per result record");
}

#[test]
fn a_tasks_state_rebuilt_from_its_records_on_another_node_is_the_same() {
    let (_da, a, _db, b, trust, worker, gateway) = two();
    let other = NodeKey::from_seed([9; 32]);
    let mut deltas = vec![];
    deltas.push(
        write(&a, &keys::processing_task(TASK), record(&gateway, 3), &gateway, &trust, NOW)
            .unwrap(),
    );
    let k = |s: &str| format!("{TASK}/{s}");
    deltas.push(
        write(
            &a,
            &keys::processing_lock(&k("s0"), L1),
            lock("s0", L1, &worker, NOW),
            &worker,
            &trust,
            NOW,
        )
        .unwrap(),
    );
    deltas.push(
        write(
            &a,
            &keys::processing_lock(&k("s1"), L2),
            lock("s1", L2, &other, NOW + 1),
            &other,
            &trust,
            NOW + 1,
        )
        .unwrap(),
    );
    deltas.push(
        write(
            &a,
            &keys::processing_result(&k("s0"), &worker.node_id().to_string()),
            result("s0", &worker, NOW + 2),
            &worker,
            &trust,
            NOW + 2,
        )
        .unwrap(),
    );
    for d in deltas {
        merge_scoped(&b, d, &[], &trust, NOW + 3).unwrap();
    }
    let at = NOW + 10;
    let qa = replay(&stored(&a, TASK).unwrap().unwrap(), at);
    let qb = replay(&stored(&b, TASK).unwrap().unwrap(), at);
    for s in ["s0", "s1", "s2"] {
        assert_eq!(qa.result(TASK, s), qb.result(TASK, s), "{s}");
        assert_eq!(
            qa.holder(TASK, s).map(|l| &l.lock_id),
            qb.holder(TASK, s).map(|l| &l.lock_id),
            "{s}"
        );
    }
    assert!(qb.result(TASK, "s0").is_some() && qb.result(TASK, "s1").is_none());
    assert_eq!(qb.holder(TASK, "s1").map(|l| l.lock_id.as_str()), Some(L2));
    assert!(qb.holder(TASK, "s2").is_none());
    // After s1's lock expired, both see it free again.
    let late = NOW + 70_000;
    let (qa, qb) = (
        replay(&stored(&a, TASK).unwrap().unwrap(), late),
        replay(&stored(&b, TASK).unwrap().unwrap(), late),
    );
    assert!(qa.holder(TASK, "s1").is_none() && qb.holder(TASK, "s1").is_none());
}

#[test]
fn workers_grab_distinct_subtasks_and_the_holders_results_finish_the_task() {
    let (_da, a, _db, b, trust, worker, gateway) = two();
    let other = NodeKey::from_seed([9; 32]);
    let t = write(&a, &keys::processing_task(TASK), record(&gateway, 2), &gateway, &trust, NOW)
        .unwrap();
    merge_scoped(&b, t, &[], &trust, NOW).unwrap();
    // The worker on node A locks the first free subtask; B hears of it.
    let (l0, d0) = grab(&a, TASK, &worker, 30_000, &trust, NOW).unwrap().unwrap();
    assert_eq!(l0.task_key, format!("{TASK}/s0"));
    merge_scoped(&b, d0, &[], &trust, NOW).unwrap();
    // Another worker on node B gets the other subtask, not the held one.
    let (l1, d1) = grab(&b, TASK, &other, 30_000, &trust, NOW + 1).unwrap().unwrap();
    assert_eq!(l1.task_key, format!("{TASK}/s1"));
    merge_scoped(&a, d1, &[], &trust, NOW + 1).unwrap();
    assert!(grab(&a, TASK, &worker, 30_000, &trust, NOW + 2).unwrap().is_none(), "nothing free");
    let res = |sub: &str| result(sub, &worker, 0).subtask_results.remove(0);
    // Not the holder of s1: refused, nothing stored.
    assert!(complete(&a, TASK, res("s1"), &worker, &trust, NOW + 3).is_err());
    let r0 = complete(&a, TASK, res("s0"), &worker, &trust, NOW + 3).unwrap();
    merge_scoped(&b, r0, &[], &trust, NOW + 3).unwrap();
    assert!(!all_results(&stored(&b, TASK).unwrap().unwrap(), NOW + 4));
    let r1 = complete(&b, TASK, res("s1"), &other, &trust, NOW + 4).unwrap();
    merge_scoped(&a, r1, &[], &trust, NOW + 4).unwrap();
    for ks in [&a, &b] {
        assert!(all_results(&stored(ks, TASK).unwrap().unwrap(), NOW + 5));
    }
}
