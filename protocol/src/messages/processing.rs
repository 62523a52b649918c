//! The processing queue of 26.2 (task, subtask, lock, result), child job
//! references (26.14.2) and the unified queue wrapper (26.22.3).

use serde::{Deserialize, Serialize};

use super::enums::JobKind;
use super::job::ApiRequestJob;
use crate::crypto::{Hash32, NodeId, Signature};
use crate::signed::{impl_signed_common, Limits, MessageType, SignedMessage, PROTOCOL_VERSION};
use crate::error::ProtocolError;
use crate::ids;
use crate::validate::{self as v, MAX_LIST, MAX_SHORT};

/// Longest task lock.
pub const MAX_TASK_LOCK_MS: u64 = 10 * 60_000;

/// Reference from a child processing job to its parent API job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParentJob {
    /// Always `GCS_API_REQUEST_JOB`.
    pub job_type: MessageType,
    /// Parent job id.
    pub job_id: String,
    /// Phase, e.g. `retrieval`.
    pub phase: String,
}

/// Which processing task a child is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct ProcessingTaskRef {
    pub task_id: String,
    pub subtask_id: String,
}

/// 26.14.2 child job reference.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChildJobReference {
    /// The API job this one is a child of.
    pub parent_job: ParentJob,
    /// The processing task it runs; absent for an API child job (an
    /// embeddings request split over workers), so older encodings, which
    /// always carried it, still decode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processing_task: Option<ProcessingTaskRef>,
}

/// Longest `parent_job.phase`.
pub const MAX_PHASE: usize = 64;

impl ChildJobReference {
    /// An API child of `parent_job_id` in `phase`.
    pub fn api(parent_job_id: &str, phase: &str) -> Self {
        Self {
            parent_job: ParentJob {
                job_type: MessageType::ApiRequestJob,
                job_id: parent_job_id.to_string(),
                phase: phase.to_string(),
            },
            processing_task: None,
        }
    }

    /// Field rules: the parent is an API request job with a valid id, the
    /// phase a short name, the task ref (if any) bounded.
    pub fn check(&self, field: &'static str) -> Result<(), ProtocolError> {
        if self.parent_job.job_type != MessageType::ApiRequestJob {
            return Err(ProtocolError::field(field, "the parent must be a GCS_API_REQUEST_JOB"));
        }
        ids::check_id(field, &self.parent_job.job_id, ids::JOB)?;
        v::short(field, &self.parent_job.phase, MAX_PHASE)?;
        if let Some(t) = &self.processing_task {
            v::short(field, &t.task_id, MAX_SHORT)?;
            v::short(field, &t.subtask_id, MAX_SHORT)?;
        }
        Ok(())
    }
}

/// `SGProcessing::Task`: a unit of enqueued work (stored under
/// `/gcs/processing/tasks/<task_id>`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessingTask {
    /// Format version.
    pub version: u16,
    /// `task_` + ULID.
    pub task_id: String,
    /// The API job that created it, if a child.
    pub parent: Option<ChildJobReference>,
    /// Input block (IPFS CID or keyspace key).
    pub input_ref: String,
    /// Where results go.
    pub results_channel: String,
    /// Task parameters as JSON text.
    pub json_data: String,
    /// Seed for reproducible work.
    pub random_seed: u64,
    /// Number of subtasks.
    pub subtask_count: u32,
    /// Creation time.
    pub created_at_ms: u64,
}

/// `SGProcessing::SubTask` (stored under
/// `/gcs/processing/subtasks/<task_id>/<subtask_id>`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct ProcessingSubTask {
    pub version: u16,
    pub task_id: String,
    pub subtask_id: String,
    /// Chunk ids of the input this subtask covers.
    pub chunk_ids: Vec<String>,
    pub datablock_hash: Hash32,
}

/// `SGProcessing::TaskLock` as a signed message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskLock {
    /// Always `GCS_PROCESSING_TASK_LOCK`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// The locked task key.
    pub task_key: String,
    /// `lock_` + ULID.
    pub lock_id: String,
    /// Locking node; signer.
    pub node_id: NodeId,
    /// Lock time.
    pub created_at_ms: u64,
    /// Lock expiry (after which MoveExpiredTaskLock may take it).
    pub expires_at_ms: u64,
    /// Signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl SignedMessage for TaskLock {
    const TYPE: MessageType = MessageType::TaskLock;
    impl_signed_common!();
    fn signer(&self) -> &NodeId {
        &self.node_id
    }
    fn created_at_ms(&self) -> u64 {
        self.created_at_ms
    }
    fn expires_at_ms(&self) -> Option<u64> {
        Some(self.expires_at_ms)
    }
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        v::header(self.message_type, Self::TYPE, self.version)?;
        v::short("task_key", &self.task_key, 256)?;
        ids::check_id("lock_id", &self.lock_id, ids::LOCK)?;
        v::lifetime("expires_at_ms", self.created_at_ms, self.expires_at_ms, MAX_TASK_LOCK_MS)
    }
}

/// The result of one subtask.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct SubTaskResult {
    pub subtask_id: String,
    pub result_hash: Hash32,
    pub chunk_hashes: Vec<Hash32>,
}

/// `SGProcessing::TaskResult` as a signed message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskResult {
    /// Always `GCS_PROCESSING_TASK_RESULT`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// Task.
    pub task_id: String,
    /// Producing node; signer.
    pub node_id: NodeId,
    /// Per-subtask results.
    pub subtask_results: Vec<SubTaskResult>,
    /// Creation time.
    pub created_at_ms: u64,
    /// Signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl SignedMessage for TaskResult {
    const TYPE: MessageType = MessageType::TaskResult;
    impl_signed_common!();
    fn signer(&self) -> &NodeId {
        &self.node_id
    }
    fn created_at_ms(&self) -> u64 {
        self.created_at_ms
    }
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        v::header(self.message_type, Self::TYPE, self.version)?;
        ids::check_id("task_id", &self.task_id, ids::TASK)?;
        v::list("subtask_results", &self.subtask_results, 1024)?;
        for r in &self.subtask_results {
            v::short("subtask_results.subtask_id", &r.subtask_id, MAX_SHORT)?;
            v::list("subtask_results.chunk_hashes", &r.chunk_hashes, 4096)?;
        }
        let _ = MAX_LIST;
        Ok(())
    }
}

/// Maintenance work (opaque to this layer).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct MaintenanceJob {
    pub action: String,
    pub json_data: String,
}

/// Retraining work (opaque to this layer).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct RetrainingJob {
    pub model_id: String,
    pub json_data: String,
}

/// The `oneof body` of the unified queue wrapper.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[allow(missing_docs)]
pub enum QueueJobBody {
    ProcessingTask(ProcessingTask),
    ApiRequestJob(Box<ApiRequestJob>),
    MaintenanceJob(MaintenanceJob),
    RetrainingJob(RetrainingJob),
}

/// `GCS_QUEUE_JOB`: the unified queue wrapper of 26.22.3. Unsigned itself;
/// an API job inside carries its own signature.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueJob {
    /// Always `GCS_QUEUE_JOB`.
    pub message_type: MessageType,
    /// Protocol version.
    pub version: u16,
    /// Id of the wrapped job.
    pub job_id: String,
    /// Kind.
    pub kind: JobKind,
    /// Body.
    pub body: QueueJobBody,
}

impl QueueJob {
    /// Wraps a body, deriving id and kind from it.
    pub fn wrap(body: QueueJobBody) -> Self {
        let (job_id, kind) = match &body {
            QueueJobBody::ProcessingTask(t) => (t.task_id.clone(), JobKind::ProcessingChunk),
            QueueJobBody::ApiRequestJob(j) => (j.job_id.clone(), JobKind::ApiRequest),
            QueueJobBody::MaintenanceJob(_) => (String::new(), JobKind::Maintenance),
            QueueJobBody::RetrainingJob(_) => (String::new(), JobKind::Retraining),
        };
        Self { message_type: MessageType::QueueJob, version: PROTOCOL_VERSION, job_id, kind, body }
    }

    /// Kind and body agree, and the header is right.
    pub fn check(&self) -> Result<(), ProtocolError> {
        v::header(self.message_type, MessageType::QueueJob, self.version)?;
        let ok = matches!(
            (&self.body, self.kind),
            (QueueJobBody::ProcessingTask(_), JobKind::ProcessingChunk)
                | (QueueJobBody::ApiRequestJob(_), JobKind::ApiRequest)
                | (QueueJobBody::MaintenanceJob(_), JobKind::Maintenance)
                | (QueueJobBody::RetrainingJob(_), JobKind::Retraining)
        );
        if !ok {
            return Err(ProtocolError::field("kind", "does not match the body"));
        }
        Ok(())
    }
}
