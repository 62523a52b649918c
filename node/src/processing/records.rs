//! The processing queue in the keyspace (26.2, 26.22; specs/batch.md,
//! "Processing queue records"): a task is one signed [`TaskRecord`] under
//! `/gcs/processing/tasks/<task_id>` (its subtasks inside it), each lock of
//! a subtask a signed `TaskLock` under
//! `/gcs/processing/locks/<task>/<sub>/<lock_id>` and a result a signed
//! `TaskResult` (one subtask) under `/gcs/processing/results/<task>/<sub>/<node>`
//! (the task's state is replayed from them: [`super::replay`]).
//!
//! Authority, checked on every record before it is stored, the node's own
//! as much as a peer's (the record-authority rows of specs/network.md):
//! - a task only from a gateway its tenant admitted (a live
//!   `tenant_gateway` certificate), a task id once;
//! - a lock only signed by the worker it names (its signer), and only if
//!   the queue rules take it (first valid lock wins, renewal by the holder,
//!   expiry), replayed from the stored records;
//! - at most [`MAX_LOCKS_PER_SUBTASK`] locks a subtask;
//! - a result only from the node that held the subtask's lock when it was
//!   made (replayed), covering the subtask's chunks, once per node;
//! - a release (with or without a failure) only from the holder of the
//!   lock it carries, within that lock's lease, once per lock, at most
//!   [`MAX_RELEASES_PER_SUBTASK`] per subtask, and only if the queue rules,
//!   replayed with it, take it;
//! - a cancel only from the task's own gateway, once.
//!
//! The state of a task is never stored: [`replay`] rebuilds the sans-IO
//! [`TaskQueue`] from the records, so every node holding them agrees.

use gcs_keyspace::{keys, CrdtValue, Delta, Keyspace, MergeOutcome, Namespace};
use gcs_protocol::{
    ids, Limits, Message, MessageType, NodeId, NodeKey, ProtocolError, SignedMessage, TaskLock,
    TaskResult, PROTOCOL_VERSION,
};
use serde::Serialize;

use super::queue::{Effect, Input};
use super::release::{TaskCancel, TaskRelease, MAX_RELEASES_PER_SUBTASK};
use super::replay::replay_watching;
pub use super::replay::{replay, replay_at, stored, task, Stored};
pub use super::task::{TaskRecord, MAX_CHUNKS_PER_SUBTASK};
use crate::error::RefusedDelta;
use crate::tenants::TenantTrust;

/// Largest encoded task record (a task of [`MAX_SUBTASKS`] small subtasks).
pub const MAX_TASK_RECORD_BYTES: usize = 1024 * 1024;
/// Locks one subtask may have: each is taken only while the subtask is
/// free (or wins a contest), so honest work uses a handful; a node that
/// locks and releases in a loop is stopped by the release bound first.
pub const MAX_LOCKS_PER_SUBTASK: usize = 64;
/// Largest encoded lock or result record.
pub const MAX_ENTRY_BYTES: usize = 64 * 1024;
fn field(field: &'static str, reason: &str) -> ProtocolError {
    ProtocolError::Field { field, reason: reason.into() }
}

/// The register bytes of a delta (peers never delete these records).
fn register(d: &Delta) -> Result<&[u8], RefusedDelta> {
    match &d.value {
        CrdtValue::Register(r) => r.value().ok_or(RefusedDelta::Tombstone),
        CrdtValue::Set(_) => Err(RefusedDelta::WrongType {
            expected: MessageType::QueueJob,
            found: MessageType::QueueJob,
        }),
    }
}

fn size(bytes: &[u8], max: usize) -> Result<(), RefusedDelta> {
    if bytes.len() > max {
        return Err(RefusedDelta::Envelope(field("record", "over the size bound")));
    }
    Ok(())
}

fn limits() -> Limits {
    Limits { max_message_bytes: MAX_TASK_RECORD_BYTES, ..Default::default() }
}

/// A record checked on its own (signature, bounds, filed under its own key).
#[derive(Clone, Debug)]
pub enum Record {
    /// A task.
    Task(Box<TaskRecord>),
    /// A lock.
    Lock(TaskLock),
    /// A result of one subtask.
    Result(TaskResult),
    /// A holder's release of its lock.
    Release(TaskRelease),
    /// The gateway's cancel of its task.
    Cancel(TaskCancel),
}

fn misfiled(ty: MessageType, id: &str, key: &str) -> RefusedDelta {
    RefusedDelta::Misfiled { message_type: ty, id: id.into(), key: key.into() }
}

/// Checks a processing record on its own: the namespace's type, a valid
/// signature, its size and field bounds, and the key it names.
pub fn validate(d: &Delta) -> Result<Record, RefusedDelta> {
    validate_bytes(&d.key, register(d)?)
}

fn validate_bytes(key: &str, bytes: &[u8]) -> Result<Record, RefusedDelta> {
    let ns = Namespace::of_key(key)?;
    match ns {
        Namespace::ProcessingTasks => {
            size(bytes, MAX_TASK_RECORD_BYTES)?;
            let t: TaskRecord = gcs_protocol::codec::from_cbor_bytes(bytes)?;
            t.check_fields(&limits())?;
            gcs_protocol::verify(&t)?;
            let id = t.task().map(|t| t.task_id.clone()).unwrap_or_default();
            if keys::processing_task(&id) != key {
                return Err(misfiled(MessageType::QueueJob, &id, key));
            }
            Ok(Record::Task(Box::new(t)))
        }
        Namespace::ProcessingLocks => {
            size(bytes, MAX_ENTRY_BYTES)?;
            let Message::TaskLock(l) = gcs_protocol::decode(bytes, &limits())? else {
                return Err(RefusedDelta::NotFromPeers("processing.locks"));
            };
            l.check_fields(&limits())?;
            gcs_protocol::verify(&l)?;
            let two = l.task_key.split('/').count() == 2;
            if !two || keys::processing_lock(&l.task_key, &l.lock_id) != key {
                return Err(misfiled(MessageType::TaskLock, &l.task_key, key));
            }
            Ok(Record::Lock(l))
        }
        Namespace::ProcessingResults => {
            size(bytes, MAX_ENTRY_BYTES)?;
            let Message::TaskResult(r) = gcs_protocol::decode(bytes, &limits())? else {
                return Err(RefusedDelta::NotFromPeers("processing.results"));
            };
            r.check_fields(&limits())?;
            gcs_protocol::verify(&r)?;
            let [one] = r.subtask_results.as_slice() else {
                return Err(RefusedDelta::Envelope(field("subtask_results", "exactly one")));
            };
            let task_key = format!("{}/{}", r.task_id, one.subtask_id);
            if keys::processing_result(&task_key, &r.node_id.to_string()) != key {
                return Err(misfiled(MessageType::TaskResult, &task_key, key));
            }
            Ok(Record::Result(r))
        }
        Namespace::ProcessingReleases => {
            size(bytes, MAX_ENTRY_BYTES)?;
            let r: TaskRelease = gcs_protocol::codec::from_cbor_bytes(bytes)?;
            r.check_fields(&limits())?;
            gcs_protocol::verify(&r)?;
            let k = &r.lock.task_key;
            if k.split('/').count() != 2 || keys::processing_release(k, &r.lock.lock_id) != key {
                return Err(misfiled(MessageType::TaskRelease, &r.lock.lock_id, key));
            }
            Ok(Record::Release(r))
        }
        Namespace::ProcessingCancels => {
            size(bytes, MAX_ENTRY_BYTES)?;
            let c: TaskCancel = gcs_protocol::codec::from_cbor_bytes(bytes)?;
            c.check_fields(&limits())?;
            gcs_protocol::verify(&c)?;
            if keys::processing_cancel(&c.task_id) != key {
                return Err(misfiled(MessageType::TaskCancel, &c.task_id, key));
            }
            Ok(Record::Cancel(c))
        }
        // Subtasks travel inside their task record.
        _ => Err(RefusedDelta::NotFromPeers(ns.cf())),
    }
}

/// Whether `node` holds a live `tenant_gateway` certificate of `tenant`.
pub(crate) fn admitted_gateway(
    ks: &Keyspace,
    trust: &TenantTrust,
    tenant: &str,
    node: &NodeId,
    now_ms: u64,
) -> Result<(), RefusedDelta> {
    use gcs_protocol::MembershipScope;
    let Some(issuer) = trust.with(|t| t.tenants.get(tenant).cloned()) else {
        return Err(RefusedDelta::TenantUntrusted(tenant.into()));
    };
    let scope = MembershipScope::TenantGateway;
    let stored = ks.get_bytes(&keys::membership(issuer.as_str(), scope.as_str(), node.as_str()))?;
    let ok =
        stored.and_then(|b| gcs_protocol::decode(&b, &Limits::default()).ok()).is_some_and(|m| {
            match m {
                Message::MembershipCertificate(c) => {
                    c.issuer == issuer
                        && c.admits(scope, tenant, node, now_ms)
                        && gcs_protocol::verify(&c).is_ok()
                }
                _ => false,
            }
        });
    if !ok {
        return Err(RefusedDelta::GatewayNotAdmitted(node.to_string()));
    }
    Ok(())
}

fn task_of(task_key: &str) -> &str {
    task_key.split('/').next().unwrap_or_default()
}

fn rule(field_name: &'static str, effects: &[Effect]) -> RefusedDelta {
    let why = effects.iter().find_map(|e| match e {
        Effect::Refused { reason } => Some(*reason),
        _ => None,
    });
    RefusedDelta::Stale(field(field_name, why.unwrap_or("refused by the queue rules")))
}

/// Whether `effects` took (or renewed) lock `l`.
fn took(effects: &[Effect], l: &TaskLock) -> bool {
    effects.iter().any(|e| match e {
        Effect::Locked { lock_id, .. } | Effect::Renewed { lock_id, .. } => lock_id == &l.lock_id,
        _ => false,
    })
}

/// A lock that expired before it reached this node (the node was down, or
/// cut off, while its holder ran): judged when it was made, as a result
/// is, and kept only if counting it undoes nothing the records decided by
/// now (no result and no bad mark goes). Without it, its holder's result
/// would be refused here for good, and the task would never complete on
/// this node.
fn late_lock_fits(s: &Stored, l: &TaskLock, now_ms: u64) -> bool {
    let at = l.created_at_ms.min(now_ms);
    if !took(&replay_at(s, at).handle(Input::Lock(l.clone()), at), l) {
        return false;
    }
    let Some(task_id) = s.task.task().map(|t| t.task_id.clone()) else { return false };
    let before = replay(s, now_ms);
    let mut with = s.clone();
    with.locks.push(l.clone());
    let after = replay(&with, now_ms);
    s.task.subtasks.iter().all(|st| {
        let id = st.subtask_id.as_str();
        let kept =
            before.result(&task_id, id).is_none_or(|r| after.result(&task_id, id) == Some(r));
        kept && (before.bad(&task_id, id).is_none() || after.bad(&task_id, id).is_some())
    })
}

/// Checks a processing record against what this node holds, then stores
/// it: the authority rows of the module comment. The same record again
/// changes nothing.
pub fn merge(
    ks: &Keyspace,
    d: Delta,
    trust: &TenantTrust,
    now_ms: u64,
) -> Result<MergeOutcome, RefusedDelta> {
    let bytes = register(&d)?;
    if ks.get_bytes(&d.key)?.as_deref() == Some(bytes) {
        return Ok(MergeOutcome::Unchanged);
    }
    if let Err(e) = check(ks, &d.key, bytes, trust, now_ms) {
        // A concurrent merge of the same record stored it meanwhile (a
        // lock comes both by gossip and presented with a fetch): a copy,
        // not a refusal, so gossip still forwards it.
        if ks.get_bytes(&d.key)?.as_deref() == Some(bytes) {
            return Ok(MergeOutcome::Unchanged);
        }
        return Err(e);
    }
    Ok(ks.merge(d, now_ms)?)
}

/// The authority rows over one record, against what this node holds.
fn check(
    ks: &Keyspace,
    key: &str,
    bytes: &[u8],
    trust: &TenantTrust,
    now_ms: u64,
) -> Result<(), RefusedDelta> {
    let record = validate_bytes(key, bytes)?;
    match &record {
        Record::Task(t) => {
            admitted_gateway(ks, trust, &t.tenant_id, &t.gateway_node_id, now_ms)?;
            if ks.get_bytes(key)?.is_some() {
                return Err(RefusedDelta::NotTheAuthor("processing.tasks"));
            }
        }
        Record::Lock(l) => {
            let Some(s) = stored(ks, task_of(&l.task_key))? else {
                return Err(RefusedDelta::Stale(field("task_key", "no such task here")));
            };
            // Released is final: a late copy of the lock (or a renewal)
            // must not take the subtask back from its next holder.
            if s.releases.iter().any(|r| r.lock.lock_id == l.lock_id) {
                return Err(RefusedDelta::Stale(field("lock", "lock already released")));
            }
            let others = s
                .locks
                .iter()
                .filter(|x| x.task_key == l.task_key && x.lock_id != l.lock_id)
                .count();
            if others >= MAX_LOCKS_PER_SUBTASK {
                return Err(RefusedDelta::Envelope(field("lock", "too many locks of the subtask")));
            }
            let mut q = replay(&s, now_ms);
            let effects = q.handle(Input::Lock(l.clone()), now_ms);
            if !took(&effects, l) && !(l.expires_at_ms <= now_ms && late_lock_fits(&s, l, now_ms)) {
                return Err(rule("lock", &effects));
            }
        }
        Record::Result(r) => {
            if ks.get_bytes(key)?.is_some() {
                return Err(RefusedDelta::NotTheAuthor("processing.results"));
            }
            let Some(s) = stored(ks, &r.task_id)? else {
                return Err(RefusedDelta::Stale(field("task_id", "no such task here")));
            };
            let one = &r.subtask_results[0];
            // Judged when it was made: a result replicated after its lock
            // expired still counts, one made after does not, and only from
            // the node the queue rules made the holder then.
            let mut q = replay_at(&Stored { results: vec![], ..s }, r.created_at_ms);
            // No holder, or another: its lock may not have reached this
            // node yet (a forged result is refused the same way).
            let not_holder =
                || RefusedDelta::Stale(field("node_id", "not the subtask's holder then"));
            let Some(l) = q.holder(&r.task_id, &one.subtask_id).cloned() else {
                return Err(not_holder());
            };
            if l.node_id != r.node_id {
                return Err(not_holder());
            }
            let input = Input::Result {
                node: r.node_id.clone(),
                lock_id: l.lock_id.clone(),
                task_id: r.task_id.clone(),
                result: one.clone(),
            };
            let effects = q.handle(input, r.created_at_ms);
            if !effects.iter().any(|e| matches!(e, Effect::Accepted { .. })) {
                return Err(rule("result", &effects));
            }
        }
        Record::Release(r) => {
            if ks.get_bytes(key)?.is_some() {
                return Err(RefusedDelta::NotTheAuthor("processing.releases"));
            }
            let Some(mut s) = stored(ks, task_of(&r.lock.task_key))? else {
                return Err(RefusedDelta::Stale(field("lock", "no such task here")));
            };
            let of_sub = s.releases.iter().filter(|x| x.lock.task_key == r.lock.task_key).count();
            if of_sub >= MAX_RELEASES_PER_SUBTASK {
                return Err(RefusedDelta::Envelope(field(
                    "lock",
                    "too many releases of the subtask",
                )));
            }
            s.releases.push(r.clone());
            if !replay_watching(&s, now_ms, &r.lock.lock_id).1 {
                return Err(RefusedDelta::Stale(field("lock", "not a live lock of its holder")));
            }
        }
        Record::Cancel(c) => {
            if ks.get_bytes(key)?.is_some() {
                return Err(RefusedDelta::NotTheAuthor("processing.cancels"));
            }
            let Some(s) = stored(ks, &c.task_id)? else {
                return Err(RefusedDelta::Stale(field("task_id", "no such task here")));
            };
            // The task's gateway, or another its tenant admitted (one that
            // took the batch over, specs/batch.md "Adoption").
            if s.task.gateway_node_id != c.gateway_node_id
                && admitted_gateway(ks, trust, &s.task.tenant_id, &c.gateway_node_id, now_ms)
                    .is_err()
            {
                return Err(RefusedDelta::NotTheAuthor("processing.cancels"));
            }
        }
    }
    Ok(())
}

/// Signs and stores a record of this node (through the same checks as a
/// peer's); returns the delta to publish.
pub fn write<T: SignedMessage + Serialize>(
    ks: &Keyspace,
    key: &str,
    mut record: T,
    node_key: &NodeKey,
    trust: &TenantTrust,
    now_ms: u64,
) -> Result<Delta, RefusedDelta> {
    gcs_protocol::sign(&mut record, node_key)?;
    let bytes = gcs_protocol::encode(&record)?;
    check(ks, key, &bytes, trust, now_ms)?;
    Ok(ks.put(key, bytes, now_ms)?)
}

/// The worker's side of the shell: replays `task_id` and, if the queue
/// offers a free subtask, signs a lock on it for `lease_ms` and stores it
/// (through the authority rows); returns the lock and the delta to publish.
pub fn grab(
    ks: &Keyspace,
    task_id: &str,
    node_key: &NodeKey,
    lease_ms: u64,
    trust: &TenantTrust,
    now_ms: u64,
) -> Result<Option<(TaskLock, Delta)>, RefusedDelta> {
    grab_avoiding(ks, task_id, node_key, lease_ms, &[], trust, now_ms)
}

/// [`grab`], passing over the subtask keys in `avoid`.
pub fn grab_avoiding(
    ks: &Keyspace,
    task_id: &str,
    node_key: &NodeKey,
    lease_ms: u64,
    avoid: &[String],
    trust: &TenantTrust,
    now_ms: u64,
) -> Result<Option<(TaskLock, Delta)>, RefusedDelta> {
    let Some(s) = stored(ks, task_id)? else { return Ok(None) };
    let mut q = replay(&s, now_ms);
    let me = node_key.node_id();
    let effects = q.propose(&me, lease_ms, avoid, now_ms);
    let Some((task_key, expires_at_ms)) = effects.into_iter().find_map(|e| match e {
        Effect::ProposeLock { task_key, expires_at_ms } => Some((task_key, expires_at_ms)),
        _ => None,
    }) else {
        return Ok(None);
    };
    let lock = TaskLock {
        message_type: MessageType::TaskLock,
        version: PROTOCOL_VERSION,
        lock_id: ids::new_id(ids::LOCK, now_ms)?,
        task_key,
        node_id: me,
        created_at_ms: now_ms,
        expires_at_ms,
        signature: None,
    };
    let key = keys::processing_lock(&lock.task_key, &lock.lock_id);
    let d = write(ks, &key, lock.clone(), node_key, trust, now_ms)?;
    let mut signed = lock;
    gcs_protocol::sign(&mut signed, node_key)?;
    Ok(Some((signed, d)))
}

/// The holder's result of one subtask, signed and stored (refused unless
/// this node holds the subtask's live lock); returns the delta to publish.
pub fn complete(
    ks: &Keyspace,
    task_id: &str,
    result: gcs_protocol::SubTaskResult,
    node_key: &NodeKey,
    trust: &TenantTrust,
    now_ms: u64,
) -> Result<Delta, RefusedDelta> {
    let key = keys::processing_result(
        &format!("{task_id}/{}", result.subtask_id),
        &node_key.node_id().to_string(),
    );
    let r = TaskResult {
        message_type: MessageType::TaskResult,
        version: PROTOCOL_VERSION,
        task_id: task_id.into(),
        node_id: node_key.node_id(),
        subtask_results: vec![result],
        created_at_ms: now_ms,
        signature: None,
    };
    write(ks, &key, r, node_key, trust, now_ms)
}

/// The holder gives `lock` (its latest renewal) back, with the failure
/// that made it stop if any; stored through the authority rows (refused
/// once the lock expired); returns the delta to publish.
pub fn give_back(
    ks: &Keyspace,
    lock: &TaskLock,
    failure: Option<String>,
    node_key: &NodeKey,
    trust: &TenantTrust,
    now_ms: u64,
) -> Result<Delta, RefusedDelta> {
    let r = TaskRelease {
        message_type: MessageType::TaskRelease,
        version: PROTOCOL_VERSION,
        lock: lock.clone(),
        failure,
        node_id: node_key.node_id(),
        created_at_ms: now_ms,
        signature: None,
    };
    write(ks, &keys::processing_release(&lock.task_key, &lock.lock_id), r, node_key, trust, now_ms)
}

/// The task's gateway cancels it (no new locks); returns the delta to
/// publish, or `None` when it was cancelled already.
pub fn cancel(
    ks: &Keyspace,
    task_id: &str,
    reason: &str,
    node_key: &NodeKey,
    trust: &TenantTrust,
    now_ms: u64,
) -> Result<Option<Delta>, RefusedDelta> {
    let key = keys::processing_cancel(task_id);
    if ks.get_bytes(&key)?.is_some() {
        return Ok(None);
    }
    let c = TaskCancel {
        message_type: MessageType::TaskCancel,
        version: PROTOCOL_VERSION,
        task_id: task_id.into(),
        gateway_node_id: node_key.node_id(),
        reason: reason.into(),
        created_at_ms: now_ms,
        signature: None,
    };
    write(ks, &key, c, node_key, trust, now_ms).map(Some)
}

/// Whether every subtask of the task has an accepted result.
pub fn all_results(s: &Stored, now_ms: u64) -> bool {
    let Some(t) = s.task.task() else { return false };
    let q = replay(s, now_ms);
    s.task.subtasks.iter().all(|sub| q.result(&t.task_id, &sub.subtask_id).is_some())
}
