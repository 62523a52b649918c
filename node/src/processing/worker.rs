//! A worker's processing loop (specs/batch.md, "Processing on workers"):
//! with a free processing slot, take the oldest open subtask of a task
//! whose model this node serves ([`records::grab`]: a signed lock, first
//! valid lock wins), fetch its input chunks from the task's gateway (served
//! only to the lock holder) and check them against the subtask's signed
//! `datablock_hash`, run each through the executor exactly as the same
//! request sent alone, renew the lock while it runs, deliver one signed
//! output per request to the gateway and store the signed `TaskResult`
//! naming their hashes ([`records::complete`]).
//!
//! Blocking (the executor is): the node's shell runs [`Processor::step`]
//! on a blocking thread and publishes the deltas it hands out. A subtask
//! that fails in the engine, or whose inputs do not match, is released
//! with the failure (three make it bad everywhere); one stopped at
//! shutdown or by the task's cancel is released without. A worker
//! that dies leaves its lock to expire; the queue then frees the subtask
//! for another (MoveExpiredTaskLock), and the gateway keeps only the
//! outputs the accepted result names, so no request is answered twice.

use std::sync::atomic::{AtomicBool, Ordering};

use gcs_keyspace::{keys, Delta, Keyspace};
use gcs_protocol::{Hash32, MessageType, NodeId, NodeKey, SubTaskResult, TaskLock};
use serde_json::json;

use super::chunks::{self, OutputChunk, ProcessingError, TaskParams, CHUNK_VERSION};
use super::records::{self, TaskRecord};
use crate::jobs::executor::{ExecError, ExecRequest, Executor};
use crate::tenants::TenantTrust;

/// Default lease of a processing lock (renewed at half of it).
pub const DEFAULT_LEASE_MS: u64 = 30_000;

/// How a worker reaches a task's gateway (a direct stream in the node; the
/// gateway's keyspace in tests).
pub trait ChunkSource {
    /// The encoded input chunk `chunk_id` of `task_id`, asked by `me`,
    /// who presents its lock (the delta it stored: the gateway merges it
    /// through the authority rows first, gossip may not have carried it yet).
    fn fetch(
        &self,
        me: &NodeId,
        gateway: &NodeId,
        lock: &Delta,
        task_id: &str,
        chunk_id: &str,
    ) -> Result<Vec<u8>, ProcessingError>;
    /// Hands one encoded, signed output to the gateway, with the lock (its
    /// latest renewal) it ran under.
    fn deliver(
        &self,
        gateway: &NodeId,
        lock: &Delta,
        output: Vec<u8>,
    ) -> Result<(), ProcessingError>;
}

/// One finished subtask.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Done {
    /// `<task>/<subtask>`.
    pub task_key: String,
    /// Requests it ran.
    pub lines: usize,
}

/// What a worker needs to take subtasks.
#[allow(missing_debug_implementations)]
pub struct Processor<'a> {
    /// This node's store (where the queue records replicate to).
    pub ks: &'a Keyspace,
    /// This node's key (signs locks, outputs, results).
    pub key: &'a NodeKey,
    /// Which gateways tenants admitted.
    pub trust: &'a TenantTrust,
    /// The engine.
    pub executor: &'a dyn Executor,
    /// Model ids and aliases this node serves.
    pub models: &'a [String],
    /// Lease of each lock.
    pub lease_ms: u64,
    /// Subtasks this worker passes over until the time given: their
    /// gateway named another holder than this store knows of (a lock this
    /// store refused in a contest it decided otherwise), so grabbing them
    /// again would only be refused again until that holder's lease ends.
    pub avoid: &'a Avoid,
    /// Gateways (by node id) that could not be reached, and until when
    /// they are asked last: a gateway that is down costs one failed
    /// request a lease, not one per request.
    pub unreachable: &'a Avoid,
}

/// A worker's list of subtasks to pass over, and until when.
pub type Avoid = std::sync::Mutex<std::collections::BTreeMap<String, u64>>;

/// The gateways a subtask's requests go to, in order: the one that
/// answered last, the task's own, then the tenant's others; one that could
/// not be reached lately goes last.
struct Via<'a> {
    gateways: Vec<NodeId>,
    last_good: std::cell::Cell<Option<usize>>,
    unreachable: &'a Avoid,
    hold_ms: u64,
    clock: &'a dyn Fn() -> u64,
}

impl Via<'_> {
    fn order(&self) -> Vec<usize> {
        let now = (self.clock)();
        let down = {
            let mut u = self.unreachable.lock().unwrap_or_else(|p| p.into_inner());
            u.retain(|_, until| *until > now);
            u.keys().cloned().collect::<std::collections::BTreeSet<String>>()
        };
        let mut order: Vec<usize> = (0..self.gateways.len()).collect();
        // Stable: among the reachable (and among the others) the task's
        // own gateway stays first.
        order.sort_by_key(|&i| {
            (Some(i) != self.last_good.get(), down.contains(self.gateways[i].as_str()))
        });
        order
    }

    /// `f` on each gateway in turn until one answers. The task's own
    /// gateway's refusal is final (it decides who holds what); another's
    /// (it has not mirrored the input yet) passes to the next. The first
    /// error is returned when none answers.
    fn call<T>(
        &self,
        mut f: impl FnMut(&NodeId) -> Result<T, ProcessingError>,
    ) -> Result<T, ProcessingError> {
        let mut first = None;
        for i in self.order() {
            let g = &self.gateways[i];
            match f(g) {
                Err(ProcessingError::GatewayRefused(r)) if i == 0 => {
                    return Err(ProcessingError::GatewayRefused(r))
                }
                Err(e @ ProcessingError::Gateway(_)) => {
                    let until = (self.clock)().saturating_add(self.hold_ms);
                    let mut u = self.unreachable.lock().unwrap_or_else(|p| p.into_inner());
                    u.insert(g.to_string(), until);
                    first.get_or_insert(e);
                }
                Err(e @ ProcessingError::GatewayRefused(_)) => {
                    first.get_or_insert(e);
                }
                other => {
                    self.last_good.set(Some(i));
                    self.unreachable.lock().unwrap_or_else(|p| p.into_inner()).remove(g.as_str());
                    return other;
                }
            }
        }
        Err(first.unwrap_or(ProcessingError::Unknown))
    }

    /// `f` on one more gateway than the one that answered last, reachable
    /// lately, if the tenant has one: best effort (an output held by two
    /// gateways outlives the loss of either before a mirror pulls it).
    fn also(&self, mut f: impl FnMut(&NodeId) -> Result<(), ProcessingError>) {
        let now = (self.clock)();
        let Some(i) = self.order().into_iter().find(|&i| {
            Some(i) != self.last_good.get() && {
                let u = self.unreachable.lock().unwrap_or_else(|p| p.into_inner());
                u.get(self.gateways[i].as_str()).is_none_or(|until| *until <= now)
            }
        }) else {
            return;
        };
        let g = &self.gateways[i];
        if let Err(e) = f(g) {
            tracing::debug!(gateway = %g, error = %e, "second copy of an output not delivered");
            if matches!(e, ProcessingError::Gateway(_)) {
                let until = now.saturating_add(self.hold_ms);
                self.unreachable
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(g.to_string(), until);
            }
        }
    }
}

/// A failure as a release carries it: at most 256 bytes, no control
/// characters.
fn failure_reason(s: &str) -> String {
    let mut out: String = s.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    let mut end = out.len().min(super::release::MAX_REASON_BYTES);
    while !out.is_char_boundary(end) {
        end -= 1;
    }
    out.truncate(end);
    if out.is_empty() {
        out.push_str("failed");
    }
    out
}

/// The error envelope a request refused by the engine gets (what the same
/// request sent alone answers: 400 `invalid_request_error`).
fn invalid_body(message: &str) -> String {
    json!({"error": {"message": message, "type": "invalid_request_error",
                     "param": null, "code": "invalid_request"}})
    .to_string()
}

impl Processor<'_> {
    /// Tasks held here with a subtask still open whose model this node
    /// serves, oldest first.
    pub fn candidates(&self, now_ms: u64) -> Result<Vec<TaskRecord>, ProcessingError> {
        let mut out: Vec<TaskRecord> = self
            .ks
            .scan_cbor::<TaskRecord>(&keys::processing_task(""))?
            .into_iter()
            .map(|(_, t)| t)
            .filter(|t| TaskParams::of(t).is_some_and(|p| self.models.contains(&p.model)))
            .collect();
        out.sort_by_key(|t| t.created_at_ms);
        let mut open = vec![];
        for t in out {
            let Some(id) = t.task().map(|x| x.task_id.clone()) else { continue };
            if let Some(s) = records::stored(self.ks, &id)? {
                let q = records::replay(&s, now_ms);
                let free = !q.cancelled(&id)
                    && s.task.subtasks.iter().any(|st| {
                        q.result(&id, &st.subtask_id).is_none()
                            && q.bad(&id, &st.subtask_id).is_none()
                            && q.holder(&id, &st.subtask_id).is_none()
                    });
                if free {
                    open.push(t);
                }
            }
        }
        Ok(open)
    }

    /// Takes and runs one subtask, if any is free: `Ok(None)` when there
    /// is none (or `cancel` was set before it finished: its lock expires).
    /// `publish` gets every delta of a replicated record (the lock, its
    /// renewals, the result) as soon as it is stored.
    pub fn step(
        &self,
        src: &dyn ChunkSource,
        cancel: &AtomicBool,
        clock: &dyn Fn() -> u64,
        publish: &mut dyn FnMut(Delta),
    ) -> Result<Option<Done>, ProcessingError> {
        let now = clock();
        for t in self.candidates(now)? {
            let Some(task_id) = t.task().map(|x| x.task_id.clone()) else { continue };
            let avoid: Vec<String> = {
                let mut a = self.avoid.lock().unwrap_or_else(|p| p.into_inner());
                a.retain(|_, until| *until > now);
                a.keys().cloned().collect()
            };
            let got = records::grab_avoiding(
                self.ks,
                &task_id,
                self.key,
                self.lease_ms,
                &avoid,
                self.trust,
                now,
            )?;
            let Some(mut held) = got else { continue };
            // Operators (and netsim's `lock_holder` target) read what a
            // worker holds from this line and the one that ends it.
            tracing::info!(subtask = %held.0.task_key, lock_id = %held.0.lock_id, lease_ms = self.lease_ms, "processing subtask locked");
            publish(held.1.clone());
            let r = self.run(&t, &mut held, src, cancel, clock, publish);
            self.give_back(&held.0, &r, clock(), publish);
            return r;
        }
        Ok(None)
    }

    /// A subtask that did not finish: its lock goes back at once (a
    /// failure of the engine or of the inputs counts towards the bad mark
    /// on every replica), rather than after its lease; so does a lock the
    /// gateway does not see as the holder's (a contest it decided the
    /// other way), uncounted, so the subtask does not wait out a lease no
    /// one works under. A gateway that could not be reached, or a record
    /// this node refused, leaves the lock to expire: the lease paces the
    /// retries.
    fn give_back(
        &self,
        lock: &TaskLock,
        r: &Result<Option<Done>, ProcessingError>,
        now_ms: u64,
        publish: &mut dyn FnMut(Delta),
    ) {
        if let Err(ProcessingError::NotHolder | ProcessingError::GatewayRefused(_)) = r {
            let mut a = self.avoid.lock().unwrap_or_else(|p| p.into_inner());
            a.insert(lock.task_key.clone(), now_ms + self.lease_ms);
        }
        let failure = match r {
            Ok(Some(_)) => return,
            Ok(None)
            | Err(
                ProcessingError::Cancelled
                | ProcessingError::NotHolder
                | ProcessingError::GatewayRefused(_),
            ) => None,
            Err(e @ (ProcessingError::Engine(_) | ProcessingError::Mismatch(_))) => {
                Some(failure_reason(&e.to_string()))
            }
            Err(_) => return,
        };
        let failed = failure.clone();
        match records::give_back(self.ks, lock, failure, self.key, self.trust, now_ms) {
            Ok(d) => {
                tracing::info!(subtask = %lock.task_key, failure = ?failed, "processing lock released");
                publish(d)
            }
            // Expired meanwhile: MoveExpiredTaskLock has it.
            Err(e) => tracing::debug!(lock_id = %lock.lock_id, error = %e, "lock not released"),
        }
    }

    fn run(
        &self,
        t: &TaskRecord,
        (lock, lock_delta): &mut (TaskLock, Delta),
        src: &dyn ChunkSource,
        cancel: &AtomicBool,
        clock: &dyn Fn() -> u64,
        publish: &mut dyn FnMut(Delta),
    ) -> Result<Option<Done>, ProcessingError> {
        let (task_id, sub_id) = lock
            .task_key
            .split_once('/')
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .unwrap_or_default();
        let sub =
            t.subtasks.iter().find(|s| s.subtask_id == sub_id).ok_or(ProcessingError::Unknown)?;
        let me = self.key.node_id();
        let cancelled = || -> Result<bool, ProcessingError> {
            Ok(cancel.load(Ordering::Relaxed)
                || self.ks.get_bytes(&keys::processing_cancel(&task_id))?.is_some())
        };
        // The task's gateway first; while it cannot be reached, the
        // tenant's other gateways, which mirror its tasks (mirror.rs).
        let gateways = Via {
            gateways: super::mirror::tenant_gateways(self.ks, self.trust, t, clock()),
            last_good: Default::default(),
            unreachable: self.unreachable,
            hold_ms: self.lease_ms,
            clock,
        };
        let mut inputs = vec![];
        let mut hashes = vec![];
        for c in &sub.chunk_ids {
            let bytes = gateways.call(|g| src.fetch(&me, g, lock_delta, &task_id, c))?;
            hashes.push(Hash32::of(&bytes));
            inputs.push((chunks::check_input(t, c, &bytes)?, Hash32::of(&bytes)));
        }
        if chunks::block_hash(&hashes) != sub.datablock_hash {
            return Err(ProcessingError::Mismatch("inputs differ from the signed datablock hash"));
        }
        let mut out_hashes = vec![];
        for (input, input_hash) in inputs {
            if cancelled()? {
                return Ok(None);
            }
            self.renew(lock, lock_delta, clock(), publish)?;
            let req = ExecRequest {
                api_type: input.api_type,
                model: input.model.clone(),
                body: input.body.clone(),
                cache_salt: input.cache_salt.clone(),
                priority: crate::jobs::executor::Priority::Batch,
            };
            let (status, body, itok, otok) =
                match self
                    .executor
                    .run(&req, cancel, &mut |_, _, _| !cancel.load(Ordering::Relaxed))
                {
                    Ok(o) => (200, o.body.to_string(), o.input_tokens, o.output_tokens),
                    Err(ExecError::Invalid(m)) => (400, invalid_body(&m), 0, 0),
                    Err(ExecError::Engine(m)) => return Err(ProcessingError::Engine(m)),
                };
            if cancel.load(Ordering::Relaxed) {
                return Ok(None);
            }
            let mut o = OutputChunk {
                message_type: MessageType::TaskResult,
                version: CHUNK_VERSION,
                task_id: task_id.clone(),
                chunk_id: input.chunk_id.clone(),
                index: input.index,
                input_hash,
                lock_id: lock.lock_id.clone(),
                node_id: me.clone(),
                status,
                body,
                input_tokens: itok,
                output_tokens: otok,
                created_at_ms: clock(),
                signature: None,
            };
            gcs_protocol::sign(&mut o, self.key)?;
            let bytes = gcs_protocol::encode(&o)?;
            out_hashes.push(Hash32::of(&bytes));
            gateways.call(|g| src.deliver(g, lock_delta, bytes.clone()))?;
            gateways.also(|g| src.deliver(g, lock_delta, bytes.clone()));
            // A copy here too (unless this node is the gateway that took
            // it): a gateway that lost it pulls it from the result's signer.
            let key = keys::processing_output(&task_id, &o.chunk_id, &o.lock_id);
            if self.ks.get_bytes(&key)?.is_none() {
                self.ks.put(&key, bytes, clock())?;
            }
        }
        let result = SubTaskResult {
            subtask_id: sub_id,
            result_hash: chunks::block_hash(&out_hashes),
            chunk_hashes: out_hashes,
        };
        let now = clock();
        self.renew(lock, lock_delta, now, publish)?;
        let d = records::complete(self.ks, &task_id, result, self.key, self.trust, now)?;
        publish(d);
        Ok(Some(Done { task_key: lock.task_key.clone(), lines: sub.chunk_ids.len() }))
    }

    /// Extends the lease once half of it has passed (a renewal is the same
    /// lock id with a later expiry, stored and published like the lock).
    fn renew(
        &self,
        lock: &mut TaskLock,
        lock_delta: &mut Delta,
        now_ms: u64,
        publish: &mut dyn FnMut(Delta),
    ) -> Result<(), ProcessingError> {
        let lease = lock.expires_at_ms.saturating_sub(lock.created_at_ms);
        if now_ms < lock.expires_at_ms.saturating_sub(lease / 2) {
            return Ok(());
        }
        let mut next = lock.clone();
        next.created_at_ms = now_ms;
        next.expires_at_ms = now_ms + self.lease_ms.clamp(1, gcs_protocol::MAX_TASK_LOCK_MS);
        next.signature = None;
        let key = keys::processing_lock(&next.task_key, &next.lock_id);
        let d = records::write(self.ks, &key, next.clone(), self.key, self.trust, now_ms)?;
        publish(d.clone());
        *lock = next;
        *lock_delta = d;
        Ok(())
    }
}
