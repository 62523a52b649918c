//! The data of a processing task (specs/batch.md, "Processing chunks"):
//! each request of a batch is one signed [`InputChunk`] held by the task's
//! gateway under `/gcs/processing/chunks/<task>/<chunk>` (job-participant
//! scope: never gossiped, never in anti-entropy; the gateway hands it only
//! to the live lock holder of a subtask naming it, [`serve_chunk`]), and a
//! worker's answer to it is one signed [`OutputChunk`] the gateway keeps
//! under `/gcs/processing/outputs/<task>/<chunk>/<lock>` ([`accept_output`]).
//!
//! The public `TaskRecord` names chunk ids and, per subtask, the
//! `datablock_hash` of its inputs (BLAKE3 over their record hashes), so a
//! worker checks what a gateway serves against what that gateway signed;
//! the `TaskResult` names the hashes of the outputs it stands for, so the
//! gateway keeps exactly the outputs of the accepted result, one per
//! request, whoever ran the subtask before ([`collect`]).

use gcs_keyspace::{keys, Delta, Keyspace, KeyspaceError};
use gcs_protocol::{
    ids, ApiType, Hash32, Limits, MessageType, NodeId, NodeKey, ProcessingSubTask, ProcessingTask,
    ProtocolError, Signature, SignedMessage,
};
use serde::{Deserialize, Serialize};

use super::records::{self, Stored, TaskRecord};
use crate::error::RefusedDelta;
use crate::tenants::TenantTrust;

/// Version of the chunk records and of the task parameters.
pub const CHUNK_VERSION: u16 = 1;
/// Largest encoded input chunk (one rendered request).
pub const MAX_INPUT_BYTES: usize = 256 << 10;
/// Largest encoded output chunk (one response body: a long embedding list).
pub const MAX_OUTPUT_BYTES: usize = 1 << 20;
/// Requests one subtask may hold.
pub const MAX_LINES_PER_SUBTASK: usize = 32;
/// Requests one task may hold (the batch API's own bound).
pub const MAX_LINES_PER_TASK: usize = 50_000;
/// Longest `custom_id` an input chunk carries (the batch API's bound).
pub const MAX_CUSTOM_ID: usize = 512;

/// Why a processing step did not happen.
#[derive(Debug, thiserror::Error)]
pub enum ProcessingError {
    /// A record failed its authority or bounds check.
    #[error("record refused: {0}")]
    Refused(#[from] RefusedDelta),
    /// A record did not decode or verify.
    #[error("protocol: {0}")]
    Protocol(#[from] ProtocolError),
    /// Storage failed.
    #[error("keyspace: {0}")]
    Keyspace(#[from] KeyspaceError),
    /// The asker holds no live lock on a subtask naming this chunk.
    #[error("not the holder of a live lock on a subtask naming this chunk")]
    NotHolder,
    /// No such task or chunk here.
    #[error("no such task or chunk here")]
    Unknown,
    /// The task's gateway cancelled it.
    #[error("the task was cancelled by its gateway")]
    Cancelled,
    /// A record that does not belong where it was put.
    #[error("record does not match its task: {0}")]
    Mismatch(&'static str),
    /// A bound was exceeded.
    #[error("over a bound: {0}")]
    TooLarge(&'static str),
    /// The engine failed (the subtask is left to expire and be retried).
    #[error("engine: {0}")]
    Engine(String),
    /// The task's gateway could not be reached.
    #[error("gateway: {0}")]
    Gateway(String),
    /// The task's gateway answered with a refusal (this node does not hold
    /// the subtask there, an output it refused, ...).
    #[error("gateway refused: {0}")]
    GatewayRefused(String),
    /// A usage record was not stored, or a blocking task failed.
    #[error("{0}")]
    Runtime(String),
}

/// The task's parameters (`ProcessingTask.json_data`): what a worker must
/// serve to take its subtasks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskParams {
    /// [`CHUNK_VERSION`].
    pub v: u16,
    /// The model every request of the task names.
    pub model: String,
    /// Its API surface.
    pub api_type: ApiType,
}

impl TaskParams {
    /// The parameters of a stored task, if of this version.
    pub fn of(t: &TaskRecord) -> Option<Self> {
        let p: Self = serde_json::from_str(&t.task()?.json_data).ok()?;
        (p.v == CHUNK_VERSION).then_some(p)
    }
}

/// One request of a task, as its gateway rendered it for the engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct InputChunk {
    /// Always `GCS_QUEUE_JOB` (domain-separated from the task record by
    /// its signing payload).
    pub message_type: MessageType,
    /// [`CHUNK_VERSION`].
    pub version: u16,
    /// Its task.
    pub task_id: String,
    /// `c<index>`.
    pub chunk_id: String,
    /// The request's place in the batch (0-based).
    pub index: u64,
    /// The client's `custom_id` of the request: a gateway of the tenant
    /// that takes the batch over writes its output lines from it
    /// (`super::manifest`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom_id: Option<String>,
    /// The tenant whose request it is.
    pub tenant_id: String,
    /// The task's gateway; signer.
    pub gateway_node_id: NodeId,
    /// API surface.
    pub api_type: ApiType,
    /// Model as requested.
    pub model: String,
    /// The job payload (`gcs_gateway::payload::JobRequest::encode`), the
    /// same bytes the request would carry sent alone.
    #[serde(with = "serde_bytes")]
    pub body: Vec<u8>,
    /// The tenant's prefix-cache salt (only the lock holder sees it).
    pub cache_salt: String,
    /// Creation time.
    pub created_at_ms: u64,
    /// The gateway's signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

/// A worker's answer to one input chunk.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OutputChunk {
    /// Always `GCS_PROCESSING_TASK_RESULT` (domain-separated from the
    /// result record by its signing payload).
    pub message_type: MessageType,
    /// [`CHUNK_VERSION`].
    pub version: u16,
    /// Its task.
    pub task_id: String,
    /// The input chunk it answers.
    pub chunk_id: String,
    /// The request's place in the batch.
    pub index: u64,
    /// Hash of the input chunk record it answers.
    pub input_hash: Hash32,
    /// The lock it ran under.
    pub lock_id: String,
    /// The worker; signer.
    pub node_id: NodeId,
    /// HTTP status the same request sent alone would have had.
    pub status: u16,
    /// The response body (or error envelope) as JSON text.
    pub body: String,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Creation time.
    pub created_at_ms: u64,
    /// The worker's signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

pub(super) fn field(field: &'static str, reason: &str) -> ProtocolError {
    ProtocolError::Field { field, reason: reason.into() }
}

fn header(ty: MessageType, want: MessageType, v: u16) -> Result<(), ProtocolError> {
    if ty != want || v != CHUNK_VERSION {
        return Err(field("message_type", "not a chunk record of this version"));
    }
    Ok(())
}

/// The signing payload: a label first, so a chunk's signature is never
/// valid for a record sharing its message type.
pub(super) fn labelled(label: &[u8], v: &ciborium::value::Value) -> Result<Vec<u8>, ProtocolError> {
    let mut out = label.to_vec();
    out.extend(gcs_protocol::codec::encode_value(v));
    Ok(out)
}

impl SignedMessage for InputChunk {
    const TYPE: MessageType = MessageType::QueueJob;
    signed_common!(gateway_node_id);
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("task_id", &self.task_id, ids::TASK)?;
        if self.chunk_id != format!("c{}", self.index) {
            return Err(field("chunk_id", "c<index>"));
        }
        if self.model.is_empty() || self.model.len() > 256 || self.tenant_id.len() > 128 {
            return Err(field("model", "1-256 bytes, tenant at most 128"));
        }
        if self.body.len() > MAX_INPUT_BYTES || self.cache_salt.len() > 128 {
            return Err(field("body", "over the chunk bound"));
        }
        if self.custom_id.as_ref().is_some_and(|c| c.is_empty() || c.len() > MAX_CUSTOM_ID) {
            return Err(field("custom_id", "1 to 512 bytes"));
        }
        Ok(())
    }
    fn signing_payload(&self, v: &ciborium::value::Value) -> Result<Vec<u8>, ProtocolError> {
        labelled(b"GCS/processing/input-chunk\0", v)
    }
}

impl SignedMessage for OutputChunk {
    const TYPE: MessageType = MessageType::TaskResult;
    signed_common!(node_id);
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("task_id", &self.task_id, ids::TASK)?;
        ids::check_id("lock_id", &self.lock_id, ids::LOCK)?;
        if self.chunk_id != format!("c{}", self.index) {
            return Err(field("chunk_id", "c<index>"));
        }
        if !(100..600).contains(&self.status) || self.body.len() > MAX_OUTPUT_BYTES {
            return Err(field("body", "an HTTP status and a body within the bound"));
        }
        Ok(())
    }
    fn signing_payload(&self, v: &ciborium::value::Value) -> Result<Vec<u8>, ProtocolError> {
        labelled(b"GCS/processing/output-chunk\0", v)
    }
}

fn limits(max: usize) -> Limits {
    Limits { max_message_bytes: max, ..Default::default() }
}

/// Decodes and verifies a chunk record of either kind.
pub fn decode<T: SignedMessage>(bytes: &[u8], max: usize) -> Result<T, ProcessingError> {
    if bytes.len() > max {
        return Err(ProcessingError::TooLarge("chunk record"));
    }
    let m: T = gcs_protocol::codec::from_cbor_bytes(bytes)?;
    m.check_fields(&limits(max))?;
    gcs_protocol::verify(&m)?;
    Ok(m)
}

/// The hash a subtask's result names for a record (its canonical bytes).
pub fn record_hash<T: Serialize>(m: &T) -> Result<Hash32, ProtocolError> {
    Ok(Hash32::of(&gcs_protocol::encode(m)?))
}

/// BLAKE3 over the hashes, in order: a subtask's `datablock_hash` (its
/// inputs) and its result's `result_hash` (its outputs).
pub fn block_hash(hashes: &[Hash32]) -> Hash32 {
    let mut h = blake3::Hasher::new();
    hashes.iter().for_each(|x| {
        h.update(&x.0);
    });
    Hash32(*h.finalize().as_bytes())
}

/// One request to enqueue.
#[derive(Clone, Debug)]
pub struct Line {
    /// Its place in the batch.
    pub index: u64,
    /// The client's `custom_id`.
    pub custom_id: Option<String>,
    /// The job payload.
    pub body: Vec<u8>,
}

/// What a task is for.
#[derive(Clone, Debug)]
pub struct TaskSpec {
    /// The tenant.
    pub tenant_id: String,
    /// The batch it runs.
    pub batch_id: Option<String>,
    /// Model and API of every request.
    pub params: TaskParams,
    /// The tenant's prefix-cache salt.
    pub cache_salt: String,
    /// Requests per subtask (clamped to 1..=[`MAX_LINES_PER_SUBTASK`]).
    pub per_subtask: usize,
}

/// The gateway's side: stores every request as an input chunk (kept here)
/// and the signed task record naming them; returns the task id and the
/// task's delta, the one record to publish.
pub fn enqueue(
    ks: &Keyspace,
    key: &NodeKey,
    trust: &TenantTrust,
    spec: &TaskSpec,
    lines: &[Line],
    now_ms: u64,
) -> Result<(String, Delta), ProcessingError> {
    if lines.is_empty() || lines.len() > MAX_LINES_PER_TASK {
        return Err(ProcessingError::TooLarge("requests in one task"));
    }
    let per = spec.per_subtask.clamp(1, MAX_LINES_PER_SUBTASK);
    if lines.len().div_ceil(per) > super::queue::MAX_SUBTASKS {
        return Err(ProcessingError::TooLarge("subtasks in one task"));
    }
    let task_id = ids::new_id(ids::TASK, now_ms)?;
    let mut subtasks = vec![];
    for (n, group) in lines.chunks(per).enumerate() {
        let mut hashes = vec![];
        let mut chunk_ids = vec![];
        for l in group {
            let mut c = InputChunk {
                message_type: MessageType::QueueJob,
                version: CHUNK_VERSION,
                task_id: task_id.clone(),
                chunk_id: format!("c{}", l.index),
                index: l.index,
                custom_id: l.custom_id.clone(),
                tenant_id: spec.tenant_id.clone(),
                gateway_node_id: key.node_id(),
                api_type: spec.params.api_type,
                model: spec.params.model.clone(),
                body: l.body.clone(),
                cache_salt: spec.cache_salt.clone(),
                created_at_ms: now_ms,
                signature: None,
            };
            c.check_fields(&limits(MAX_INPUT_BYTES))?;
            gcs_protocol::sign(&mut c, key)?;
            let bytes = gcs_protocol::encode(&c)?;
            if bytes.len() > MAX_INPUT_BYTES {
                return Err(ProcessingError::TooLarge("an input chunk"));
            }
            hashes.push(Hash32::of(&bytes));
            ks.put(&keys::processing_chunk(&task_id, &c.chunk_id), bytes, now_ms)?;
            chunk_ids.push(c.chunk_id);
        }
        subtasks.push(ProcessingSubTask {
            version: CHUNK_VERSION,
            task_id: task_id.clone(),
            subtask_id: format!("s{n}"),
            chunk_ids,
            datablock_hash: block_hash(&hashes),
        });
    }
    let task = ProcessingTask {
        version: CHUNK_VERSION,
        task_id: task_id.clone(),
        parent: None,
        input_ref: keys::processing_chunks(&task_id),
        results_channel: spec.batch_id.clone().unwrap_or_default(),
        json_data: serde_json::to_string(&spec.params).map_err(|_| ProcessingError::Unknown)?,
        random_seed: 0,
        subtask_count: subtasks.len() as u32,
        created_at_ms: now_ms,
    };
    let mut rec = TaskRecord::new(&spec.tenant_id, &key.node_id(), task, subtasks, now_ms);
    rec.batch_id = spec.batch_id.clone();
    let d = records::write(ks, &keys::processing_task(&task_id), rec, key, trust, now_ms)?;
    Ok((task_id, d))
}

/// The gateway's side of a lock a worker presents with a fetch or a
/// delivery: merged through the same authority rows as gossip (a lock
/// only from its signer, under the queue rules); the same lock again is a
/// no-op.
pub fn present_lock(
    ks: &Keyspace,
    d: Delta,
    trust: &TenantTrust,
    now_ms: u64,
) -> Result<(), ProcessingError> {
    if gcs_keyspace::Namespace::of_key(&d.key).map_err(RefusedDelta::from)?
        != gcs_keyspace::Namespace::ProcessingLocks
    {
        return Err(ProcessingError::Mismatch("not a lock record"));
    }
    // Only news for this store: a lock it refuses (an older renewal than
    // gossip brought, a contest it already decided) is judged by the
    // holder check that follows, not here.
    if let Err(e) = records::merge(ks, d, trust, now_ms) {
        tracing::debug!(error = %e, "presented lock not merged");
    }
    Ok(())
}

/// The subtask of `s` that names `chunk_id`.
fn subtask_of<'a>(s: &'a Stored, chunk_id: &str) -> Option<&'a ProcessingSubTask> {
    s.task.subtasks.iter().find(|st| st.chunk_ids.iter().any(|c| c == chunk_id))
}

/// The gateway's side of a fetch: the input chunk, only for the live lock
/// holder of the subtask that names it.
pub fn serve_chunk(
    ks: &Keyspace,
    asker: &NodeId,
    task_id: &str,
    chunk_id: &str,
    now_ms: u64,
) -> Result<Vec<u8>, ProcessingError> {
    let s = records::stored(ks, task_id)?.ok_or(ProcessingError::Unknown)?;
    let sub = subtask_of(&s, chunk_id).ok_or(ProcessingError::Unknown)?;
    let q = records::replay(&s, now_ms);
    if q.cancelled(task_id) {
        return Err(ProcessingError::Cancelled);
    }
    let held = q
        .holder(task_id, &sub.subtask_id)
        .is_some_and(|l| &l.node_id == asker && l.expires_at_ms > now_ms);
    if !held {
        return Err(ProcessingError::NotHolder);
    }
    ks.get_bytes(&keys::processing_chunk(task_id, chunk_id))?.ok_or(ProcessingError::Unknown)
}

/// The worker's check of a served chunk: signed by the task's gateway,
/// of this task and chunk.
pub fn check_input(
    t: &TaskRecord,
    chunk_id: &str,
    bytes: &[u8],
) -> Result<InputChunk, ProcessingError> {
    let c: InputChunk = decode(bytes, MAX_INPUT_BYTES)?;
    let task_id = t.task().map(|t| t.task_id.as_str()).unwrap_or_default();
    if c.gateway_node_id != t.gateway_node_id || c.task_id != task_id || c.chunk_id != chunk_id {
        return Err(ProcessingError::Mismatch("an input chunk of another task or gateway"));
    }
    if c.tenant_id != t.tenant_id {
        return Err(ProcessingError::Mismatch("an input chunk of another tenant"));
    }
    Ok(c)
}

/// The gateway's side of a delivery: an output from the holder of the lock
/// it names (the subtask's holder when the output was made, replayed from
/// the stored records), made before that lock expired, answering the
/// stored input; kept once per chunk and lock.
pub fn accept_output(
    ks: &Keyspace,
    bytes: &[u8],
    now_ms: u64,
) -> Result<OutputChunk, ProcessingError> {
    let o: OutputChunk = decode(bytes, MAX_OUTPUT_BYTES + 4096)?;
    let s = records::stored(ks, &o.task_id)?.ok_or(ProcessingError::Unknown)?;
    let sub_id = subtask_of(&s, &o.chunk_id).ok_or(ProcessingError::Unknown)?.subtask_id.clone();
    // Judged by the locks alone: the holder's own result, made in the
    // same millisecond as its last output, ends its hold (a mirror pulls
    // that output after the result has replicated).
    let q = records::replay_at(&Stored { results: vec![], ..s }, o.created_at_ms);
    let lock = q.holder(&o.task_id, &sub_id).ok_or(ProcessingError::NotHolder)?;
    if lock.lock_id != o.lock_id
        || lock.node_id != o.node_id
        || o.created_at_ms >= lock.expires_at_ms
    {
        return Err(ProcessingError::NotHolder);
    }
    let input = ks
        .get_bytes(&keys::processing_chunk(&o.task_id, &o.chunk_id))?
        .ok_or(ProcessingError::Unknown)?;
    if Hash32::of(&input) != o.input_hash {
        return Err(ProcessingError::Mismatch("an output of another input"));
    }
    check_metering(&decode::<InputChunk>(&input, MAX_INPUT_BYTES)?, &o)?;
    let key = keys::processing_output(&o.task_id, &o.chunk_id, &o.lock_id);
    match ks.get_bytes(&key)? {
        Some(b) if b == bytes => {}
        Some(_) => return Err(ProcessingError::Mismatch("a second output under one lock")),
        None => {
            ks.put(&key, bytes.to_vec(), now_ms)?;
        }
    }
    Ok(o)
}

/// The bounds the gateway puts on what a worker says an answer cost (a
/// worker may lie; the usage record the gateway signs copies these counts):
/// prompt tokens at most one per payload byte plus the chat template's
/// slack, as for a job sent alone (`lifecycle::tracker::bounded_metering`);
/// generated tokens at most the request's `max_tokens` (none for an
/// embedding, or a payload that does not decode, which the worker answers
/// with 400); and the answer's own `usage` must say the same. An output
/// outside them is refused, not clamped: the subtask is then run again.
fn check_metering(input: &InputChunk, o: &OutputChunk) -> Result<(), ProcessingError> {
    use gcs_gateway::payload::JobRequest;
    let max_out = match JobRequest::decode(&input.body) {
        Ok(JobRequest::Generation(g)) => u64::from(g.max_tokens),
        Ok(JobRequest::Embedding(_)) | Err(_) => 0,
    };
    let max_in =
        (input.body.len() as u64).saturating_add(crate::lifecycle::tracker::TEMPLATE_TOKENS);
    if o.input_tokens > max_in || o.output_tokens > max_out {
        return Err(ProcessingError::TooLarge("metered tokens past the request's bounds"));
    }
    if o.status == 200 {
        let body: serde_json::Value = serde_json::from_str(&o.body).unwrap_or_default();
        let said = |k: &str| body.get("usage").and_then(|u| u.get(k)).and_then(|v| v.as_u64());
        let differs = |k: &str, n: u64| said(k).is_some_and(|v| v != n);
        if differs("prompt_tokens", o.input_tokens) || differs("completion_tokens", o.output_tokens)
        {
            return Err(ProcessingError::Mismatch("the answer's usage differs from its metering"));
        }
    }
    Ok(())
}

/// What the gateway holds of a task's answers.
#[derive(Clone, Debug, Default)]
pub struct Collected {
    /// Outputs of accepted results, one per request.
    pub outputs: Vec<OutputChunk>,
    /// Requests of subtasks marked bad, with the reason.
    pub bad: Vec<(u64, String)>,
    /// Requests whose subtask has a result whose output is not here yet.
    pub missing: usize,
    /// Requests with neither a result nor a bad subtask yet.
    pub open: usize,
    /// Whether a gateway of the tenant cancelled the task.
    pub cancelled: bool,
}

/// The stored output of `chunk_id` whose record hashes to `want` (a
/// result names one per request, in its place), among the outputs held
/// for it (one per lock it ran under).
pub fn held_output(
    ks: &Keyspace,
    task_id: &str,
    chunk_id: &str,
    want: Option<&Hash32>,
) -> Result<Option<Vec<u8>>, KeyspaceError> {
    let Some(want) = want else { return Ok(None) };
    for (_, v) in ks.scan_prefix(&keys::processing_outputs_of_chunk(task_id, chunk_id))? {
        let Some(b) = v.as_register().and_then(|r| r.value()) else { continue };
        if Hash32::of(b) == *want {
            return Ok(Some(b.to_vec()));
        }
    }
    Ok(None)
}

/// Every chunk id a task's subtasks name.
pub fn chunk_ids(s: &Stored) -> std::collections::HashSet<&str> {
    s.task.subtasks.iter().flat_map(|st| st.chunk_ids.iter().map(String::as_str)).collect()
}

/// The outputs standing for each accepted result (by the hashes it names),
/// and the requests of bad subtasks; requests in `skip` (collected before)
/// are left out, and their outputs are not read, so a poll costs the
/// answers that are new, not the whole task.
pub fn collect(
    ks: &Keyspace,
    task_id: &str,
    now_ms: u64,
    skip: &std::collections::HashSet<u64>,
) -> Result<Collected, ProcessingError> {
    let s = records::stored(ks, task_id)?.ok_or(ProcessingError::Unknown)?;
    let q = records::replay(&s, now_ms);
    let index = |c: &str| c.strip_prefix('c').and_then(|n| n.parse::<u64>().ok());
    let mut out = Collected::default();
    for sub in &s.task.subtasks {
        let wanted = || {
            let new = |c: &&String| index(c).is_none_or(|i| !skip.contains(&i));
            sub.chunk_ids.iter().enumerate().filter(move |(_, c)| new(c))
        };
        if let Some(r) = q.result(task_id, &sub.subtask_id) {
            for (at, c) in wanted() {
                let found = held_output(ks, task_id, c, r.chunk_hashes.get(at))?
                    .and_then(|b| decode::<OutputChunk>(&b, MAX_OUTPUT_BYTES + 4096).ok());
                match found {
                    Some(o) => out.outputs.push(o),
                    None => out.missing += 1,
                }
            }
        } else if let Some(reason) = q.bad(task_id, &sub.subtask_id) {
            out.bad.extend(wanted().filter_map(|(_, c)| index(c)).map(|i| (i, reason.to_string())));
        } else {
            out.open += sub.chunk_ids.len();
        }
    }
    out.outputs.sort_by_key(|o| o.index);
    out.cancelled = q.cancelled(task_id);
    Ok(out)
}
