//! The processing queue's rules as a sans-IO machine (26.2, 26.22): tasks
//! split into subtasks, which workers lock (a lease with expiry and
//! renewal), complete with a signed result, release, or fail. The shell
//! verifies every `TaskLock` and `TaskResult` (signature, clock) before it
//! is an [`Input`]; this core decides who holds what, and never reads a
//! clock (`now_ms` is an argument).
//!
//! Rules (specs/batch.md, "Processing queue"):
//! - first valid lock wins: a lock is taken only if the subtask has no
//!   result, is not bad and holds no live lock; a competing lock created
//!   earlier (by at most [`CONTEST_MS`]) replaces it, so replicas that saw
//!   the two in either order agree; one older than that is refused (a
//!   backdated lock cannot steal a held subtask), and a new lock created
//!   more than that before the subtask's newest lock is refused even on a
//!   free subtask (replayed at its origin it would erase that lock's
//!   expiry or failure);
//! - renewal: the holder's lock with the same `lock_id` extends the expiry;
//! - results and releases are fenced by lock id and holder: anyone else's
//!   is refused;
//! - an expired lock moves back (MoveExpiredTaskLock) and counts as a
//!   failure, as does a reported failure or a result of the wrong shape; a
//!   subtask failing [`MAX_FAILURES`] times is marked bad with its reason;
//! - a task is complete when every subtask has a result or is bad;
//! - a cancelled task (its gateway's word) takes no new lock and is never
//!   offered again; results under locks it already held still count.

use std::collections::BTreeMap;

use gcs_protocol::{
    NodeId, ProcessingSubTask, ProcessingTask, SubTaskResult, TaskLock, MAX_TASK_LOCK_MS,
};

/// Failures after which a subtask is bad.
pub const MAX_FAILURES: u32 = 3;
/// How much earlier a competing lock may be created and still win.
pub const CONTEST_MS: u64 = 5_000;
/// Tasks one queue holds.
pub const MAX_TASKS: usize = 1024;
/// Subtasks of one task.
pub const MAX_SUBTASKS: usize = 4096;

/// What happens to the queue.
#[derive(Clone, Debug)]
pub enum Input {
    /// A task and all its subtasks.
    Enqueue(ProcessingTask, Vec<ProcessingSubTask>),
    /// This node has a free processing slot.
    Grab {
        /// This node.
        node: NodeId,
        /// Lease asked for.
        lease_ms: u64,
    },
    /// A verified lock (this node's or a peer's).
    Lock(TaskLock),
    /// A verified result of one subtask, under lock `lock_id`.
    Result {
        /// Signer of the result.
        node: NodeId,
        /// The lock it was produced under.
        lock_id: String,
        /// Its task.
        task_id: String,
        /// The result.
        result: SubTaskResult,
    },
    /// The holder gives a subtask back (preempted by interactive work).
    Release {
        /// Holder.
        node: NodeId,
        /// Lock.
        lock_id: String,
    },
    /// The holder could not do it.
    Failed {
        /// Holder.
        node: NodeId,
        /// Lock.
        lock_id: String,
        /// Why.
        reason: String,
    },
    /// The task's gateway cancelled it.
    Cancel {
        /// Task.
        task_id: String,
    },
    /// Time passes.
    Tick,
}

/// What the shell does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Sign and publish a lock for this subtask (then feed it back).
    ProposeLock {
        /// `<task_id>/<subtask_id>`.
        task_key: String,
        /// Expiry of the proposed lock.
        expires_at_ms: u64,
    },
    /// The lock holds the subtask now.
    Locked {
        /// Subtask key.
        task_key: String,
        /// Winning lock.
        lock_id: String,
    },
    /// The holder extended its lease.
    Renewed {
        /// Lock.
        lock_id: String,
        /// New expiry.
        expires_at_ms: u64,
    },
    /// A lock that lost (a competing earlier one won): its holder stops.
    Superseded {
        /// The lock that lost.
        lock_id: String,
    },
    /// An input that changed nothing, and why.
    Refused {
        /// Why.
        reason: &'static str,
    },
    /// A result was stored.
    Accepted {
        /// Subtask key.
        task_key: String,
    },
    /// The subtask is free again (released or MoveExpiredTaskLock).
    Freed {
        /// Subtask key.
        task_key: String,
        /// Whether the lock expired (else released or failed).
        expired: bool,
    },
    /// The subtask will not be tried again.
    MarkedBad {
        /// Subtask key.
        task_key: String,
        /// The last failure.
        reason: String,
    },
    /// The task takes no new locks.
    Cancelled {
        /// Task.
        task_id: String,
    },
    /// Every subtask has a result or is bad.
    TaskComplete {
        /// Task.
        task_id: String,
        /// Subtasks marked bad.
        bad: u32,
    },
}

#[derive(Clone, Debug, Default)]
struct Sub {
    chunks: usize,
    lock: Option<TaskLock>,
    result: Option<SubTaskResult>,
    failures: u32,
    bad: Option<String>,
    /// The latest origin of a lock this subtask took.
    newest_origin: u64,
}

impl Sub {
    fn open(&self) -> bool {
        self.result.is_none() && self.bad.is_none()
    }
}

#[derive(Clone, Debug)]
struct Task {
    created_at_ms: u64,
    subs: BTreeMap<String, Sub>,
    complete: bool,
    cancelled: bool,
}

/// The queue as one node sees it.
#[derive(Debug, Default)]
pub struct TaskQueue {
    tasks: BTreeMap<String, Task>,
}

fn key(task: &str, sub: &str) -> String {
    format!("{task}/{sub}")
}

fn task_of(task_key: &str) -> &str {
    task_key.split('/').next().unwrap_or_default()
}

/// When a lock was first made: a renewal keeps the lock id (a ULID of its
/// first creation) and moves `created_at_ms`, so the id's time orders a
/// lock and its renewals alike (contests, and the records' replay). A lock
/// id that is not a ULID of an earlier time (tests' short ids) is ordered
/// by `created_at_ms`.
pub fn origin_ms(l: &TaskLock) -> u64 {
    gcs_protocol::ids::id_time_ms(&l.lock_id, gcs_protocol::ids::LOCK)
        .map_or(l.created_at_ms, |t| t.min(l.created_at_ms))
}

fn refused(reason: &'static str) -> Vec<Effect> {
    vec![Effect::Refused { reason }]
}

impl TaskQueue {
    /// Whether every subtask of the task has a result or is bad.
    pub fn is_complete(&self, task_id: &str) -> bool {
        self.tasks.get(task_id).is_some_and(|t| t.complete)
    }

    /// The result of a subtask, once accepted.
    pub fn result(&self, task_id: &str, subtask_id: &str) -> Option<&SubTaskResult> {
        self.tasks.get(task_id)?.subs.get(subtask_id)?.result.as_ref()
    }

    /// Why a subtask was marked bad, if it was.
    pub fn bad(&self, task_id: &str, subtask_id: &str) -> Option<&str> {
        self.tasks.get(task_id)?.subs.get(subtask_id)?.bad.as_deref()
    }

    /// Whether the task's gateway cancelled it.
    pub fn cancelled(&self, task_id: &str) -> bool {
        self.tasks.get(task_id).is_some_and(|t| t.cancelled)
    }

    /// The live holder of a subtask.
    pub fn holder(&self, task_id: &str, subtask_id: &str) -> Option<&TaskLock> {
        self.tasks.get(task_id)?.subs.get(subtask_id)?.lock.as_ref()
    }

    /// Applies one input at `now_ms`.
    pub fn handle(&mut self, input: Input, now_ms: u64) -> Vec<Effect> {
        match input {
            Input::Enqueue(t, subs) => self.enqueue(t, subs),
            Input::Grab { node, lease_ms } => self.propose(&node, lease_ms, &[], now_ms),
            Input::Lock(l) => self.lock(l, now_ms),
            Input::Result { node, lock_id, task_id, result } => {
                self.complete(&node, &lock_id, &task_id, result, now_ms)
            }
            Input::Release { node, lock_id } => self.free(&node, &lock_id, None, now_ms),
            Input::Failed { node, lock_id, reason } => {
                self.free(&node, &lock_id, Some(reason), now_ms)
            }
            Input::Cancel { task_id } => match self.tasks.get_mut(&task_id) {
                None => refused("unknown task"),
                Some(t) if t.cancelled => refused("task already cancelled"),
                Some(t) => {
                    t.cancelled = true;
                    vec![Effect::Cancelled { task_id }]
                }
            },
            Input::Tick => self.expire(now_ms),
        }
    }

    fn enqueue(&mut self, t: ProcessingTask, subs: Vec<ProcessingSubTask>) -> Vec<Effect> {
        if self.tasks.contains_key(&t.task_id) {
            return refused("task already queued");
        }
        if self.tasks.len() >= MAX_TASKS {
            return refused("queue full");
        }
        if subs.is_empty() || subs.len() > MAX_SUBTASKS || subs.len() != t.subtask_count as usize {
            return refused("subtask count does not match the task");
        }
        let mut map = BTreeMap::new();
        for s in subs {
            if s.task_id != t.task_id {
                return refused("a subtask of another task");
            }
            let sub = Sub { chunks: s.chunk_ids.len(), ..Sub::default() };
            if map.insert(s.subtask_id, sub).is_some() {
                return refused("duplicate subtask id");
            }
        }
        self.tasks.insert(
            t.task_id,
            Task { created_at_ms: t.created_at_ms, subs: map, complete: false, cancelled: false },
        );
        vec![]
    }

    /// An open, unlocked subtask of the oldest task that has one: of those,
    /// the first in this node's own order (BLAKE3 of node and subtask), so
    /// workers grabbing at the same moment mostly pick different subtasks
    /// instead of contesting one lock.
    /// [`Input::Grab`], passing over the subtask keys in `avoid` (a worker's
    /// own short list of subtasks whose gateway named another holder).
    pub fn propose(
        &mut self,
        node: &NodeId,
        lease_ms: u64,
        avoid: &[String],
        now_ms: u64,
    ) -> Vec<Effect> {
        let mut order: Vec<(&String, &Task)> = self.tasks.iter().collect();
        order.sort_by_key(|(id, t)| (t.created_at_ms, *id));
        let rank = |sid: &str| *blake3::hash(format!("{node}/{sid}").as_bytes()).as_bytes();
        for (id, t) in order.into_iter().filter(|(_, t)| !t.cancelled) {
            let free = t.subs.iter().filter(|(sid, s)| {
                s.open() && s.lock.is_none() && !avoid.iter().any(|k| *k == key(id, sid))
            });
            if let Some((sid, _)) = free.min_by_key(|(sid, _)| rank(sid)) {
                let lease = lease_ms.clamp(1, MAX_TASK_LOCK_MS);
                return vec![Effect::ProposeLock {
                    task_key: key(id, sid),
                    expires_at_ms: now_ms + lease,
                }];
            }
        }
        vec![]
    }

    fn sub_mut(&mut self, task_key: &str) -> Option<&mut Sub> {
        let (t, s) = task_key.split_once('/')?;
        self.tasks.get_mut(t)?.subs.get_mut(s)
    }

    fn lock(&mut self, l: TaskLock, now_ms: u64) -> Vec<Effect> {
        if l.expires_at_ms <= now_ms {
            return refused("lock already expired");
        }
        if self.cancelled(task_of(&l.task_key)) {
            return refused("task cancelled");
        }
        let Some(sub) = self.sub_mut(&l.task_key) else { return refused("unknown subtask") };
        if !sub.open() {
            return refused("subtask already done or bad");
        }
        let renewal = sub.lock.as_ref().is_some_and(|c| c.lock_id == l.lock_id);
        // A lock taken before the subtask's newest lock (beyond the contest
        // window) would, replayed at its origin, have held the subtask
        // through that lock's term and erased its expiry or failure: a
        // backdated lock id must not reset the subtask's history.
        if !renewal && origin_ms(&l).saturating_add(CONTEST_MS) < sub.newest_origin {
            return refused("lock created too long before the subtask's newest lock");
        }
        let Some(cur) = sub.lock.as_mut() else {
            let e = Effect::Locked { task_key: l.task_key.clone(), lock_id: l.lock_id.clone() };
            sub.newest_origin = sub.newest_origin.max(origin_ms(&l));
            sub.lock = Some(l);
            return vec![e];
        };
        if cur.lock_id == l.lock_id {
            if cur.node_id != l.node_id {
                return refused("lock id of another holder");
            }
            if l.expires_at_ms <= cur.expires_at_ms {
                return refused("renewal does not extend the lease");
            }
            cur.expires_at_ms = l.expires_at_ms;
            return vec![Effect::Renewed { lock_id: l.lock_id, expires_at_ms: l.expires_at_ms }];
        }
        let earlier = (origin_ms(&l), &l.lock_id) < (origin_ms(cur), &cur.lock_id);
        if !earlier {
            return refused("subtask locked by an earlier lock");
        }
        if origin_ms(&l) + CONTEST_MS < origin_ms(cur) {
            return refused("lock created too long before the held one");
        }
        sub.newest_origin = sub.newest_origin.max(origin_ms(&l));
        let lost = std::mem::replace(cur, l);
        vec![
            Effect::Superseded { lock_id: lost.lock_id },
            Effect::Locked { task_key: cur.task_key.clone(), lock_id: cur.lock_id.clone() },
        ]
    }

    fn complete(
        &mut self,
        node: &NodeId,
        lock_id: &str,
        task_id: &str,
        result: SubTaskResult,
        now_ms: u64,
    ) -> Vec<Effect> {
        let task_key = key(task_id, &result.subtask_id);
        let Some(sub) = self.sub_mut(&task_key) else { return refused("unknown subtask") };
        let held = sub.lock.as_ref().is_some_and(|l| {
            l.lock_id == lock_id && &l.node_id == node && l.expires_at_ms > now_ms
        });
        if !held {
            return refused("result not under the subtask's live lock");
        }
        if result.chunk_hashes.len() != sub.chunks {
            let reason = "result does not cover the subtask's chunks".to_string();
            return self.failure(&task_key, reason, false);
        }
        sub.lock = None;
        sub.result = Some(result);
        let mut out = vec![Effect::Accepted { task_key }];
        out.extend(self.completion(task_id));
        out
    }

    fn free(
        &mut self,
        node: &NodeId,
        lock_id: &str,
        failure: Option<String>,
        now_ms: u64,
    ) -> Vec<Effect> {
        let found = self.tasks.iter().find_map(|(tid, t)| {
            t.subs.iter().find_map(|(sid, s)| {
                s.lock
                    .as_ref()
                    .filter(|l| l.lock_id == lock_id)
                    .map(|l| (key(tid, sid), l.node_id == *node, l.expires_at_ms > now_ms))
            })
        });
        let Some((task_key, by_holder, live)) = found else { return refused("no such lock") };
        if !by_holder {
            return refused("lock of another holder");
        }
        // An expired lock is MoveExpiredTaskLock's: it already counts.
        if !live {
            return refused("lock already expired");
        }
        match failure {
            Some(reason) => self.failure(&task_key, reason, false),
            None => {
                if let Some(s) = self.sub_mut(&task_key) {
                    s.lock = None;
                }
                vec![Effect::Freed { task_key, expired: false }]
            }
        }
    }

    /// One failure of the subtask: its lock goes; bad after MAX_FAILURES.
    fn failure(&mut self, task_key: &str, reason: String, expired: bool) -> Vec<Effect> {
        let Some(sub) = self.sub_mut(task_key) else { return vec![] };
        sub.lock = None;
        sub.failures += 1;
        if sub.failures < MAX_FAILURES {
            return vec![Effect::Freed { task_key: task_key.to_string(), expired }];
        }
        sub.bad = Some(reason.clone());
        let mut out = vec![Effect::MarkedBad { task_key: task_key.to_string(), reason }];
        if let Some((t, _)) = task_key.split_once('/') {
            out.extend(self.completion(t));
        }
        out
    }

    /// MoveExpiredTaskLock for every lock expired at `now_ms`.
    fn expire(&mut self, now_ms: u64) -> Vec<Effect> {
        let expired: Vec<String> = self
            .tasks
            .iter()
            .flat_map(|(tid, t)| {
                t.subs
                    .iter()
                    .filter(|(_, s)| s.lock.as_ref().is_some_and(|l| l.expires_at_ms <= now_ms))
                    .map(move |(sid, _)| key(tid, sid))
            })
            .collect();
        let mut out = vec![];
        for k in expired {
            out.extend(self.failure(&k, "lock expired without a result".into(), true));
        }
        out
    }

    fn completion(&mut self, task_id: &str) -> Vec<Effect> {
        let Some(t) = self.tasks.get_mut(task_id) else { return vec![] };
        if t.complete || t.subs.values().any(Sub::open) {
            return vec![];
        }
        t.complete = true;
        let bad = t.subs.values().filter(|s| s.bad.is_some()).count() as u32;
        vec![Effect::TaskComplete { task_id: task_id.to_string(), bad }]
    }
}
