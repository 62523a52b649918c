//! The authority rows of releases and cancels, and the bad mark that
//! failure records carry to every replica.
#![allow(clippy::unwrap_used)]

use gcs_keyspace::{keys, MergeOutcome};
use gcs_protocol::{MessageType, NodeKey, PROTOCOL_VERSION};

use super::records::*;
use super::records_tests::{lock, record, result, signed_delta, store, two, L1, NOW, TASK};
use super::release::{TaskCancel, TaskRelease, MAX_RELEASES_PER_SUBTASK};
use crate::error::RefusedDelta;
use crate::replication::merge_scoped;

fn held_on_both(
    a: &gcs_keyspace::Keyspace,
    b: &gcs_keyspace::Keyspace,
    trust: &crate::tenants::TenantTrust,
    worker: &NodeKey,
    gateway: &NodeKey,
) -> gcs_protocol::TaskLock {
    let mut signed = lock("s0", L1, worker, NOW);
    for ks in [a, b] {
        write(ks, &keys::processing_task(TASK), record(gateway, 2), gateway, trust, NOW).unwrap();
        let k = keys::processing_lock(&format!("{TASK}/s0"), L1);
        write(ks, &k, lock("s0", L1, worker, NOW), worker, trust, NOW).unwrap();
    }
    gcs_protocol::sign(&mut signed, worker).unwrap();
    signed
}

fn release_of(
    l: &gcs_protocol::TaskLock,
    by: &NodeKey,
    failure: Option<&str>,
    at: u64,
) -> TaskRelease {
    TaskRelease {
        message_type: MessageType::TaskRelease,
        version: PROTOCOL_VERSION,
        lock: l.clone(),
        failure: failure.map(str::to_string),
        node_id: by.node_id(),
        created_at_ms: at,
        signature: None,
    }
}

#[test]
fn a_release_comes_only_from_the_holder_within_its_lease_and_once() {
    let (_da, a, _db, b, trust, worker, gateway) = two();
    let l = held_on_both(&a, &b, &trust, &worker, &gateway);
    let key = keys::processing_release(&l.task_key, &l.lock_id);
    let other = NodeKey::from_seed([9; 32]);
    let (_ds, scratch) = store();
    // Another node releasing the worker's lock.
    let d = signed_delta(&scratch, &key, release_of(&l, &other, Some("x"), NOW + 5), &other);
    assert!(merge_scoped(&b, d, &[], &trust, NOW + 5).is_err(), "not the holder");
    // The holder, after its lease: MoveExpiredTaskLock's, not a release.
    let d = signed_delta(&scratch, &key, release_of(&l, &worker, Some("x"), NOW + 60_001), &worker);
    assert!(merge_scoped(&b, d, &[], &trust, NOW + 60_001).is_err(), "outside the lease");
    // Filed under another lock's key.
    let d = signed_delta(
        &scratch,
        &keys::processing_release(&l.task_key, "lock_01JDZ0000000000000000000ZZ"),
        release_of(&l, &worker, None, NOW + 5),
        &worker,
    );
    let e = merge_scoped(&b, d, &[], &trust, NOW + 5).unwrap_err();
    assert!(matches!(e, RefusedDelta::Misfiled { .. }), "{e}");
    // A reason with control characters, or too long.
    for bad in ["a\nb", &"x".repeat(257)] {
        let d = signed_delta(&scratch, &key, release_of(&l, &worker, Some(bad), NOW + 5), &worker);
        assert!(merge_scoped(&b, d, &[], &trust, NOW + 5).is_err(), "reason {bad:.8}");
    }
    // The holder's plain release frees the subtask everywhere, uncounted.
    let d = give_back(&a, &l, None, &worker, &trust, NOW + 5).unwrap();
    assert!(matches!(merge_scoped(&b, d, &[], &trust, NOW + 5).unwrap(), MergeOutcome::Changed(_)));
    for ks in [&a, &b] {
        let q = replay(&stored(ks, TASK).unwrap().unwrap(), NOW + 6);
        assert!(q.holder(TASK, "s0").is_none() && q.bad(TASK, "s0").is_none());
    }
    assert!(give_back(&a, &l, None, &worker, &trust, NOW + 7).is_err(), "once per lock");
    // Another worker takes the freed subtask at once, not after the lease
    // (s1 too: both are free, in whichever order it ranks them).
    let mut got: Vec<String> = (0..2)
        .map(|i| grab(&b, TASK, &other, 30_000, &trust, NOW + 8 + i).unwrap().unwrap().0.task_key)
        .collect();
    got.sort();
    assert_eq!(got, [l.task_key.clone(), format!("{TASK}/s1")]);
    // The old holder's result under its released lock is refused.
    let rk = keys::processing_result(&l.task_key, &worker.node_id().to_string());
    let late = signed_delta(&scratch, &rk, result("s0", &worker, NOW + 9), &worker);
    assert!(merge_scoped(&b, late, &[], &trust, NOW + 9).is_err());
}

#[test]
fn three_failure_records_mark_a_subtask_bad_on_every_replica() {
    let (_da, a, _db, b, trust, _worker, gateway) = two();
    let t = write(&a, &keys::processing_task(TASK), record(&gateway, 2), &gateway, &trust, NOW)
        .unwrap();
    merge_scoped(&b, t.clone(), &[], &trust, NOW).unwrap();
    let workers: Vec<NodeKey> = (0..3).map(|i| NodeKey::from_seed([40 + i; 32])).collect();
    let mut releases = vec![];
    for (i, w) in workers.iter().enumerate() {
        let at = NOW + 10 * i as u64;
        // Each worker locks s0, freed by the last failure.
        let mut l = lock("s0", &format!("lock_01JDZ0000000000000000000B{i}"), w, at);
        let k = keys::processing_lock(&l.task_key, &l.lock_id);
        let d = write(&a, &k, l.clone(), w, &trust, at).unwrap();
        gcs_protocol::sign(&mut l, w).unwrap();
        merge_scoped(&b, d, &[], &trust, at).unwrap();
        let r = give_back(&a, &l, Some(format!("engine: out of memory ({i})")), w, &trust, at + 1)
            .unwrap();
        merge_scoped(&b, r.clone(), &[], &trust, at + 1).unwrap();
        releases.push(r);
    }
    // A third node that hears only the releases, newest first, agrees:
    // each carries its lock.
    let (_dc, c) = store();
    let _ = crate::tenants::records::admit_sample_gateway(&[&c], &gateway);
    merge_scoped(&c, t, &[], &trust, NOW).unwrap();
    for r in releases.iter().rev() {
        assert!(matches!(
            merge_scoped(&c, r.clone(), &[], &trust, NOW + 30).unwrap(),
            MergeOutcome::Changed(_)
        ));
    }
    for ks in [&a, &b, &c] {
        let q = replay(&stored(ks, TASK).unwrap().unwrap(), NOW + 40);
        assert_eq!(q.bad(TASK, "s0"), Some("engine: out of memory (2)"));
        assert!(q.bad(TASK, "s1").is_none());
    }
    // Nobody is offered s0 again; s1 is still open.
    let (l, _) = grab(&c, TASK, &workers[0], 30_000, &trust, NOW + 41).unwrap().unwrap();
    assert_eq!(l.task_key, format!("{TASK}/s1"));
}

#[test]
fn releases_of_one_subtask_are_bounded() {
    let (_da, a, _db, _b, trust, worker, gateway) = two();
    write(&a, &keys::processing_task(TASK), record(&gateway, 1), &gateway, &trust, NOW).unwrap();
    for i in 0..MAX_RELEASES_PER_SUBTASK as u64 {
        let (l, _) = grab(&a, TASK, &worker, 30_000, &trust, NOW + 2 * i).unwrap().unwrap();
        give_back(&a, &l, None, &worker, &trust, NOW + 2 * i + 1).unwrap();
    }
    let at = NOW + 2 * MAX_RELEASES_PER_SUBTASK as u64;
    let (l, _) = grab(&a, TASK, &worker, 30_000, &trust, at).unwrap().unwrap();
    let e = give_back(&a, &l, None, &worker, &trust, at + 1).unwrap_err();
    assert!(e.to_string().contains("too many releases"), "{e}");
    // The lock still holds: it expires as any lock does.
    let q = replay(&stored(&a, TASK).unwrap().unwrap(), at + 2);
    assert_eq!(q.holder(TASK, "s0").map(|x| x.lock_id.as_str()), Some(l.lock_id.as_str()));
}

#[test]
fn a_cancel_comes_only_from_the_tasks_gateway_and_ends_new_locks() {
    let (_da, a, _db, b, trust, worker, gateway) = two();
    let l = held_on_both(&a, &b, &trust, &worker, &gateway);
    let key = keys::processing_cancel(TASK);
    let forged = TaskCancel {
        message_type: MessageType::TaskCancel,
        version: PROTOCOL_VERSION,
        task_id: TASK.into(),
        gateway_node_id: worker.node_id(),
        reason: "batch_cancelled".into(),
        created_at_ms: NOW + 1,
        signature: None,
    };
    let (_ds, scratch) = store();
    let d = signed_delta(&scratch, &key, forged.clone(), &worker);
    let e = merge_scoped(&b, d, &[], &trust, NOW + 1).unwrap_err();
    assert!(matches!(e, RefusedDelta::NotTheAuthor(_)), "{e}");
    let d = cancel(&a, TASK, "batch_cancelled", &gateway, &trust, NOW + 2).unwrap().unwrap();
    assert!(matches!(merge_scoped(&b, d, &[], &trust, NOW + 2).unwrap(), MergeOutcome::Changed(_)));
    assert!(cancel(&a, TASK, "batch_cancelled", &gateway, &trust, NOW + 3).unwrap().is_none());
    let again = TaskCancel { gateway_node_id: gateway.node_id(), created_at_ms: NOW + 4, ..forged };
    let d = signed_delta(&scratch, &key, again, &gateway);
    assert!(merge_scoped(&b, d, &[], &trust, NOW + 4).is_err(), "a cancel once");
    for ks in [&a, &b] {
        let q = replay(&stored(ks, TASK).unwrap().unwrap(), NOW + 5);
        assert!(q.cancelled(TASK));
        // s1 was free: nobody is offered it.
        assert!(grab(ks, TASK, &worker, 30_000, &trust, NOW + 5).unwrap().is_none());
    }
    // A lock on the free subtask, signed elsewhere: refused.
    let k1 = keys::processing_lock(&format!("{TASK}/s1"), "lock_01JDZ0000000000000000000A3");
    let other = NodeKey::from_seed([9; 32]);
    let late = signed_delta(
        &scratch,
        &k1,
        lock("s1", "lock_01JDZ0000000000000000000A3", &other, NOW + 6),
        &other,
    );
    assert!(merge_scoped(&b, late, &[], &trust, NOW + 6).is_err(), "no lock after the cancel");
    // The holder of s0 may still give it back (it stops between requests).
    let d = give_back(&a, &l, None, &worker, &trust, NOW + 7).unwrap();
    merge_scoped(&b, d, &[], &trust, NOW + 7).unwrap();
}
