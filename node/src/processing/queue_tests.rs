//! One test per rule of the processing queue core.
#![allow(clippy::unwrap_used)]

use gcs_protocol::{
    Hash32, MessageType, NodeId, ProcessingSubTask, ProcessingTask, SubTaskResult, TaskLock,
    PROTOCOL_VERSION,
};

use super::queue::*;

fn nodes() -> (NodeId, NodeId) {
    let (a, b) = gcs_protocol::samples::keys();
    (a.node_id(), b.node_id())
}

fn task(id: &str, subs: u32, created: u64) -> (ProcessingTask, Vec<ProcessingSubTask>) {
    let t = ProcessingTask {
        version: 1,
        task_id: id.into(),
        parent: None,
        input_ref: "file-x".into(),
        results_channel: "r".into(),
        json_data: "{}".into(),
        random_seed: 0,
        subtask_count: subs,
        created_at_ms: created,
    };
    let s = (0..subs)
        .map(|i| ProcessingSubTask {
            version: 1,
            task_id: id.into(),
            subtask_id: format!("s{i}"),
            chunk_ids: vec!["c0".into(), "c1".into()],
            datablock_hash: Hash32::of(b"x"),
        })
        .collect();
    (t, s)
}

fn lock(key: &str, id: &str, node: &NodeId, created: u64, expires: u64) -> TaskLock {
    TaskLock {
        message_type: MessageType::TaskLock,
        version: PROTOCOL_VERSION,
        task_key: key.into(),
        lock_id: id.into(),
        node_id: node.clone(),
        created_at_ms: created,
        expires_at_ms: expires,
        signature: None,
    }
}

fn result(sub: &str, chunks: usize) -> SubTaskResult {
    SubTaskResult {
        subtask_id: sub.into(),
        result_hash: Hash32::of(sub.as_bytes()),
        chunk_hashes: vec![Hash32::of(b"c"); chunks],
    }
}

fn queue(subs: u32) -> TaskQueue {
    let mut q = TaskQueue::default();
    let (t, s) = task("task_a", subs, 10);
    assert!(q.handle(Input::Enqueue(t, s), 0).is_empty());
    q
}

fn res(node: &NodeId, lock_id: &str, sub: &str, chunks: usize) -> Input {
    Input::Result {
        node: node.clone(),
        lock_id: lock_id.into(),
        task_id: "task_a".into(),
        result: result(sub, chunks),
    }
}

fn refused(e: &[Effect]) -> bool {
    matches!(e, [Effect::Refused { .. }])
}

#[test]
fn enqueue_checks_the_subtasks_against_the_task() {
    let mut q = TaskQueue::default();
    let (t, mut s) = task("task_a", 2, 0);
    s.pop();
    assert!(refused(&q.handle(Input::Enqueue(t.clone(), s.clone()), 0)), "count mismatch");
    let (_, mut dup) = task("task_a", 2, 0);
    dup[1].subtask_id = "s0".into();
    assert!(refused(&q.handle(Input::Enqueue(t.clone(), dup), 0)), "duplicate id");
    let (_, mut other) = task("task_a", 2, 0);
    other[1].task_id = "task_b".into();
    assert!(refused(&q.handle(Input::Enqueue(t.clone(), other), 0)), "foreign subtask");
    let (_, good) = task("task_a", 2, 0);
    assert!(q.handle(Input::Enqueue(t.clone(), good.clone()), 0).is_empty());
    assert!(refused(&q.handle(Input::Enqueue(t, good), 0)), "queued twice");
}

#[test]
fn grab_proposes_the_oldest_tasks_first_free_subtask_with_a_bounded_lease() {
    let (a, _) = nodes();
    let mut q = queue(2);
    let (t, s) = task("task_0", 1, 5);
    q.handle(Input::Enqueue(t, s), 0);
    let e = q.handle(Input::Grab { node: a.clone(), lease_ms: u64::MAX }, 100);
    assert_eq!(
        e,
        [Effect::ProposeLock {
            task_key: "task_0/s0".into(),
            expires_at_ms: 100 + gcs_protocol::MAX_TASK_LOCK_MS
        }]
    );
    q.handle(Input::Lock(lock("task_0/s0", "lock_1", &a, 100, 1000)), 100);
    let e = q.handle(Input::Grab { node: a, lease_ms: 500 }, 100);
    assert_eq!(e, [Effect::ProposeLock { task_key: "task_a/s0".into(), expires_at_ms: 600 }]);
}

#[test]
fn the_first_valid_lock_wins() {
    let (a, b) = nodes();
    let mut q = queue(1);
    let e = q.handle(Input::Lock(lock("task_a/s0", "lock_1", &a, 100, 1000)), 100);
    assert_eq!(e, [Effect::Locked { task_key: "task_a/s0".into(), lock_id: "lock_1".into() }]);
    assert!(refused(&q.handle(Input::Lock(lock("task_a/s0", "lock_2", &b, 150, 1000)), 150)));
    assert_eq!(q.holder("task_a", "s0").unwrap().lock_id, "lock_1");
    assert!(q.handle(Input::Grab { node: b, lease_ms: 100 }, 160).is_empty(), "nothing free");
}

#[test]
fn an_earlier_competing_lock_replaces_the_held_one_within_the_contest_window() {
    let (a, b) = nodes();
    let mut q = queue(1);
    q.handle(Input::Lock(lock("task_a/s0", "lock_2", &b, 10_000, 20_000)), 10_000);
    let e = q.handle(Input::Lock(lock("task_a/s0", "lock_1", &a, 9_000, 20_000)), 10_010);
    assert_eq!(
        e,
        [
            Effect::Superseded { lock_id: "lock_2".into() },
            Effect::Locked { task_key: "task_a/s0".into(), lock_id: "lock_1".into() },
        ]
    );
    // Backdated beyond the window: refused, the holder keeps it.
    let e = q.handle(
        Input::Lock(lock("task_a/s0", "lock_0", &b, 9_000 - CONTEST_MS - 1, 20_000)),
        10_020,
    );
    assert!(refused(&e));
    assert_eq!(q.holder("task_a", "s0").unwrap().lock_id, "lock_1");
}

#[test]
fn a_new_lock_may_not_predate_the_subtasks_newest_lock_beyond_the_window() {
    let (a, b) = nodes();
    let mut q = queue(1);
    q.handle(Input::Lock(lock("task_a/s0", "lock_1", &a, 10_000, 11_000)), 10_000);
    q.handle(Input::Tick, 11_000);
    assert!(q.holder("task_a", "s0").is_none(), "expired: free");
    let old = lock("task_a/s0", "lock_0", &b, 10_000 - CONTEST_MS - 1, 30_000);
    assert!(refused(&q.handle(Input::Lock(old), 12_000)));
    // Within the window, or later: taken.
    let near = lock("task_a/s0", "lock_2", &b, 10_000 - CONTEST_MS, 30_000);
    assert!(matches!(q.handle(Input::Lock(near), 12_000).as_slice(), [Effect::Locked { .. }]));
    // Its holder still renews it.
    let renewed = lock("task_a/s0", "lock_2", &b, 10_000 - CONTEST_MS, 40_000);
    assert!(matches!(q.handle(Input::Lock(renewed), 13_000).as_slice(), [Effect::Renewed { .. }]));
}

#[test]
fn expired_or_unknown_locks_are_refused() {
    let (a, _) = nodes();
    let mut q = queue(1);
    assert!(refused(&q.handle(Input::Lock(lock("task_a/s0", "lock_1", &a, 0, 100)), 100)));
    assert!(refused(&q.handle(Input::Lock(lock("task_a/s9", "lock_1", &a, 0, 500)), 100)));
    assert!(refused(&q.handle(Input::Lock(lock("nope", "lock_1", &a, 0, 500)), 100)));
}

#[test]
fn the_holder_renews_by_lock_id_and_no_one_else_can() {
    let (a, b) = nodes();
    let mut q = queue(1);
    q.handle(Input::Lock(lock("task_a/s0", "lock_1", &a, 0, 1000)), 0);
    let e = q.handle(Input::Lock(lock("task_a/s0", "lock_1", &a, 500, 2000)), 500);
    assert_eq!(e, [Effect::Renewed { lock_id: "lock_1".into(), expires_at_ms: 2000 }]);
    assert!(refused(&q.handle(Input::Lock(lock("task_a/s0", "lock_1", &b, 600, 3000)), 600)));
    assert!(refused(&q.handle(Input::Lock(lock("task_a/s0", "lock_1", &a, 700, 1500)), 700)));
    assert_eq!(q.holder("task_a", "s0").unwrap().expires_at_ms, 2000);
}

#[test]
fn results_are_fenced_by_lock_id_holder_and_expiry() {
    let (a, b) = nodes();
    let mut q = queue(2);
    q.handle(Input::Lock(lock("task_a/s0", "lock_1", &a, 0, 1000)), 0);
    assert!(refused(&q.handle(res(&b, "lock_1", "s0", 2), 10)), "not the holder");
    assert!(refused(&q.handle(res(&a, "lock_9", "s0", 2), 10)), "not the lock");
    assert!(refused(&q.handle(res(&a, "lock_1", "s1", 2), 10)), "another subtask's");
    assert!(refused(&q.handle(res(&a, "lock_1", "s0", 2), 1000)), "lock expired");
    assert!(q.result("task_a", "s0").is_none());
    let e = q.handle(res(&a, "lock_1", "s0", 2), 999);
    assert_eq!(e, [Effect::Accepted { task_key: "task_a/s0".into() }]);
    assert!(q.result("task_a", "s0").is_some());
    assert!(q.holder("task_a", "s0").is_none());
    assert!(refused(&q.handle(Input::Lock(lock("task_a/s0", "lock_2", &b, 1000, 2000)), 1000)));
}

#[test]
fn a_task_completes_when_every_subtask_has_a_result() {
    let (a, _) = nodes();
    let mut q = queue(2);
    q.handle(Input::Lock(lock("task_a/s0", "lock_1", &a, 0, 1000)), 0);
    q.handle(Input::Lock(lock("task_a/s1", "lock_2", &a, 0, 1000)), 0);
    assert_eq!(q.handle(res(&a, "lock_1", "s0", 2), 1).len(), 1);
    let e = q.handle(res(&a, "lock_2", "s1", 2), 2);
    assert_eq!(e[1], Effect::TaskComplete { task_id: "task_a".into(), bad: 0 });
}

#[test]
fn release_frees_the_subtask_for_the_holder_only() {
    let (a, b) = nodes();
    let mut q = queue(1);
    q.handle(Input::Lock(lock("task_a/s0", "lock_1", &a, 0, 1000)), 0);
    assert!(refused(&q.handle(Input::Release { node: b.clone(), lock_id: "lock_1".into() }, 1)));
    let e = q.handle(Input::Release { node: a, lock_id: "lock_1".into() }, 1);
    assert_eq!(e, [Effect::Freed { task_key: "task_a/s0".into(), expired: false }]);
    assert!(matches!(
        q.handle(Input::Grab { node: b, lease_ms: 10 }, 2)[..],
        [Effect::ProposeLock { .. }]
    ));
}

#[test]
fn expired_locks_move_back() {
    let (a, _) = nodes();
    let mut q = queue(1);
    q.handle(Input::Lock(lock("task_a/s0", "lock_1", &a, 0, 1000)), 0);
    assert!(q.handle(Input::Tick, 999).is_empty());
    let e = q.handle(Input::Tick, 1000);
    assert_eq!(e, [Effect::Freed { task_key: "task_a/s0".into(), expired: true }]);
    assert!(q.holder("task_a", "s0").is_none());
}

#[test]
fn a_subtask_failing_repeatedly_is_marked_bad_and_its_task_still_completes() {
    let (a, _) = nodes();
    let mut q = queue(1);
    let mut t = 0;
    let mut next = |q: &mut TaskQueue, id: &str| {
        t += 10;
        q.handle(Input::Lock(lock("task_a/s0", id, &a, t, t + 100)), t);
        t
    };
    // A failure report, an expiry, a result of the wrong shape.
    next(&mut q, "lock_1");
    let e = q.handle(
        Input::Failed { node: a.clone(), lock_id: "lock_1".into(), reason: "oom".into() },
        11,
    );
    assert_eq!(e, [Effect::Freed { task_key: "task_a/s0".into(), expired: false }]);
    let now = next(&mut q, "lock_2");
    q.handle(Input::Tick, now + 100);
    next(&mut q, "lock_3");
    let e = q.handle(res(&a, "lock_3", "s0", 1), 31);
    assert_eq!(
        e,
        [
            Effect::MarkedBad {
                task_key: "task_a/s0".into(),
                reason: "result does not cover the subtask's chunks".into()
            },
            Effect::TaskComplete { task_id: "task_a".into(), bad: 1 },
        ]
    );
    assert!(
        q.handle(Input::Grab { node: a.clone(), lease_ms: 10 }, 40).is_empty(),
        "bad is not retried"
    );
    assert!(refused(&q.handle(Input::Lock(lock("task_a/s0", "lock_4", &a, 40, 140)), 40)));
}

#[test]
fn a_release_after_the_lock_expired_is_refused() {
    let (a, _) = nodes();
    let mut q = queue(1);
    q.handle(Input::Lock(lock("task_a/s0", "lock_1", &a, 0, 1000)), 0);
    let late = Input::Failed { node: a.clone(), lock_id: "lock_1".into(), reason: "oom".into() };
    assert!(refused(&q.handle(late, 1000)), "the expiry already counts it");
    assert!(refused(&q.handle(Input::Release { node: a, lock_id: "lock_1".into() }, 1001)));
}

#[test]
fn a_cancelled_task_takes_no_new_lock_and_keeps_what_its_holders_finish() {
    let (a, b) = nodes();
    let mut q = queue(2);
    q.handle(Input::Lock(lock("task_a/s0", "lock_1", &a, 0, 1000)), 0);
    let e = q.handle(Input::Cancel { task_id: "task_a".into() }, 1);
    assert_eq!(e, [Effect::Cancelled { task_id: "task_a".into() }]);
    assert!(q.cancelled("task_a"));
    assert!(refused(&q.handle(Input::Cancel { task_id: "task_a".into() }, 2)), "once");
    assert!(refused(&q.handle(Input::Cancel { task_id: "task_b".into() }, 2)), "unknown task");
    assert!(q.handle(Input::Grab { node: b.clone(), lease_ms: 10 }, 3).is_empty(), "s1 not offered");
    assert!(refused(&q.handle(Input::Lock(lock("task_a/s1", "lock_2", &b, 3, 100)), 3)));
    // The running holder's result still counts; its renewal does not.
    assert!(refused(&q.handle(Input::Lock(lock("task_a/s0", "lock_1", &a, 4, 2000)), 4)));
    let e = q.handle(res(&a, "lock_1", "s0", 2), 5);
    assert_eq!(e, [Effect::Accepted { task_key: "task_a/s0".into() }]);
}

#[test]
fn workers_grabbing_at_once_are_offered_different_subtasks() {
    let (a, b) = nodes();
    let mut q = queue(12);
    let pick = |q: &mut TaskQueue, n: &NodeId| match &q.handle(Input::Grab { node: n.clone(), lease_ms: 10 }, 1)[..] {
        [Effect::ProposeLock { task_key, .. }] => task_key.clone(),
        e => panic!("{e:?}"),
    };
    let (ka, kb) = (pick(&mut q, &a), pick(&mut q, &b));
    assert_ne!(ka, kb, "each node ranks the free subtasks its own way");
    // The same node, asked again, proposes the same one (nothing changed).
    assert_eq!(pick(&mut q, &a), ka);
}
