//! A task's state rebuilt from its records (specs/batch.md, "Processing
//! queue records"). Nothing of a task's state is stored: every lock is kept
//! under its own key (`/gcs/processing/locks/<task>/<sub>/<lock_id>`, its
//! latest renewal), every result under its subtask and author
//! (`/gcs/processing/results/<task>/<sub>/<node>`), every release under its
//! lock. The records form a grow-only set, so the keyspace's last-writer-
//! wins registers never choose between two of them; [`replay`] feeds them
//! to the sans-IO [`TaskQueue`] in one order that depends only on the
//! records (locks at their origin, releases and results when made), and the
//! queue's rules choose. Every node holding the same records computes the
//! same holders, results, failures and bad marks.
//!
//! Before this, a subtask kept only its newest lock under one key: when two
//! workers contested a subtask, a replica could keep the lock the queue
//! rules made the loser (its write was later), then refuse the winner's
//! result as not signed by the stored lock's holder. The subtask looked
//! free there, and that worker grabbed finished subtasks again and again
//! (found by `batch_bench` at 400 requests: 27–66 refused grabs a run).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use gcs_keyspace::{keys, Keyspace};
use gcs_protocol::{TaskLock, TaskResult};

use super::queue::{origin_ms, Effect, Input, TaskQueue};
use super::release::{TaskCancel, TaskRelease};
use super::task::TaskRecord;
use crate::error::RefusedDelta;

/// The task, locks and results stored for a task.
#[derive(Clone, Debug)]
pub struct Stored {
    /// The task record.
    pub task: TaskRecord,
    /// Every lock of its subtasks (each lock's latest renewal).
    pub locks: Vec<TaskLock>,
    /// Its subtasks' results (counted only under the holder's lock).
    pub results: Vec<TaskResult>,
    /// Locks their holders gave back (some with a failure).
    pub releases: Vec<TaskRelease>,
    /// Its gateway's cancel.
    pub cancel: Option<TaskCancel>,
}

/// The task record alone, without the records about it.
pub fn task(ks: &Keyspace, task_id: &str) -> Result<Option<TaskRecord>, RefusedDelta> {
    Ok(ks.find_cbor::<TaskRecord>(&keys::processing_task(task_id))?)
}

/// Reads what this node holds of a task.
pub fn stored(ks: &Keyspace, task_id: &str) -> Result<Option<Stored>, RefusedDelta> {
    let Some(task) = task(ks, task_id)? else {
        return Ok(None);
    };
    let locks = ks.scan_cbor::<TaskLock>(&keys::processing_locks(task_id))?;
    let results = ks.scan_cbor::<TaskResult>(&keys::processing_results(task_id))?;
    let releases = ks.scan_cbor::<TaskRelease>(&keys::processing_releases(task_id))?;
    Ok(Some(Stored {
        task,
        locks: locks.into_iter().map(|(_, l)| l).collect(),
        results: results.into_iter().map(|(_, r)| r).collect(),
        releases: releases.into_iter().map(|(_, r)| r).collect(),
        cancel: ks.find_cbor::<TaskCancel>(&keys::processing_cancel(task_id))?,
    }))
}

/// Rebuilds a task's queue from its records, then lets time pass to
/// `now_ms`.
pub fn replay(s: &Stored, now_ms: u64) -> TaskQueue {
    run(s, now_ms, None, None).0
}

/// The queue as the records made by `at_ms` leave it at `at_ms` (what a
/// result or an output made then is judged against).
pub fn replay_at(s: &Stored, at_ms: u64) -> TaskQueue {
    run(s, at_ms, Some(at_ms), None).0
}

/// [`replay`], and whether the release of lock `watch` freed its subtask.
pub(super) fn replay_watching(s: &Stored, now_ms: u64, watch: &str) -> (TaskQueue, bool) {
    run(s, now_ms, None, Some(watch))
}

enum Event<'a> {
    Lock(&'a TaskLock),
    Release(&'a TaskRelease),
    Result(&'a TaskResult),
}

/// Every record as one event, in the order they are replayed: by time (a
/// lock at its origin), then by kind, then by id. Within one millisecond a
/// release of an earlier lock comes before the locks (the subtask was
/// free for them), a release of a lock made in that millisecond after it
/// (and before the next lock: see [`run`]), and results last. A lock seen
/// only inside its release is replayed too.
fn events(s: &Stored) -> Vec<(u64, u8, String, Event<'_>)> {
    let mut out = vec![];
    let mut latest: std::collections::BTreeMap<&str, &TaskLock> = Default::default();
    for l in s.locks.iter().chain(s.releases.iter().map(|r| &r.lock)) {
        let e = latest.entry(l.lock_id.as_str()).or_insert(l);
        if l.expires_at_ms > e.expires_at_ms {
            *e = l;
        }
    }
    for (id, l) in latest {
        out.push((origin_ms(l), 1, id.to_string(), Event::Lock(l)));
    }
    for r in &s.releases {
        let kind = if origin_ms(&r.lock) < r.created_at_ms { 0 } else { 2 };
        out.push((r.created_at_ms, kind, r.lock.lock_id.clone(), Event::Release(r)));
    }
    for r in &s.results {
        out.push((r.created_at_ms, 3, r.node_id.to_string(), Event::Result(r)));
    }
    out.sort_by(|a, b| (a.0, a.1, &a.2).cmp(&(b.0, b.1, &b.2)));
    out
}

fn run(s: &Stored, now_ms: u64, upto: Option<u64>, watch: Option<&str>) -> (TaskQueue, bool) {
    let mut q = TaskQueue::default();
    let mut took = false;
    let Some(t) = s.task.task() else { return (q, took) };
    let tid = t.task_id.clone();
    q.handle(Input::Enqueue(t.clone(), s.task.subtasks.clone()), s.task.created_at_ms);
    let evs = events(s);
    let mut applied = vec![false; evs.len()];
    let mut locked: std::collections::BTreeSet<&str> = Default::default();
    // The expiries of the locks replayed so far, soonest first: a `Tick`
    // walks every subtask, so it runs only when a lock that still holds
    // its subtask has expired (rare), not before every record.
    let mut due: BinaryHeap<Reverse<(u64, &str, &str)>> = BinaryHeap::new();
    for i in 0..evs.len() {
        let (at, _, _, ev) = &evs[i];
        let at = *at;
        if upto.is_some_and(|u| at > u) {
            break;
        }
        if applied[i] {
            continue;
        }
        // MoveExpiredTaskLock as time passes: every lock that expired
        // before this record counts once, on every replica alike.
        let mut expired = false;
        while let Some(Reverse((until, sub, lock_id))) = due.peek().copied() {
            if until > at {
                break;
            }
            due.pop();
            expired |= q.holder(&tid, sub).is_some_and(|h| h.lock_id == lock_id);
        }
        if expired {
            q.handle(Input::Tick, at);
        }
        match ev {
            Event::Lock(l) => {
                // A lock made, used and released within this millisecond
                // was given back before the next lock of it was taken (the
                // next one could not have been taken otherwise).
                for j in i + 1..evs.len() {
                    match &evs[j] {
                        (t, 2, id, Event::Release(r))
                            if *t == at && locked.contains(id.as_str()) =>
                        {
                            took |= release(&mut q, r, at, watch);
                            applied[j] = true;
                        }
                        (t, ..) if *t > at => break,
                        _ => {}
                    }
                }
                q.handle(Input::Lock((*l).clone()), at);
                locked.insert(l.lock_id.as_str());
                let sub = l.task_key.split_once('/').map_or("", |(_, s)| s);
                due.push(Reverse((l.expires_at_ms, sub, l.lock_id.as_str())));
            }
            Event::Release(r) => took |= release(&mut q, r, at, watch),
            Event::Result(r) => {
                let Some(one) = r.subtask_results.first() else { continue };
                // A result counts under the lock its author held when it
                // was made.
                let Some(l) = q.holder(&tid, &one.subtask_id).filter(|l| l.node_id == r.node_id)
                else {
                    continue;
                };
                let input = Input::Result {
                    node: r.node_id.clone(),
                    lock_id: l.lock_id.clone(),
                    task_id: tid.clone(),
                    result: one.clone(),
                };
                q.handle(input, at);
            }
        }
    }
    if let Some(c) = s.cancel.as_ref().filter(|c| upto.is_none_or(|u| c.created_at_ms <= u)) {
        q.handle(Input::Cancel { task_id: c.task_id.clone() }, c.created_at_ms);
    }
    q.handle(Input::Tick, now_ms);
    (q, took)
}

/// Applies one release; whether it is the watched lock's and freed its
/// subtask.
fn release(q: &mut TaskQueue, r: &TaskRelease, at: u64, watch: Option<&str>) -> bool {
    let (node, lock_id) = (r.node_id.clone(), r.lock.lock_id.clone());
    let input = match &r.failure {
        Some(reason) => Input::Failed { node, lock_id, reason: reason.clone() },
        None => Input::Release { node, lock_id },
    };
    let effects = q.handle(input, at);
    watch == Some(r.lock.lock_id.as_str())
        && effects.iter().any(|e| matches!(e, Effect::Freed { .. } | Effect::MarkedBad { .. }))
}
