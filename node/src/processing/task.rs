//! The task record (26.22.3): the unified queue wrapper around a
//! `ProcessingTask` and its subtasks, signed by the enqueuing gateway
//! (specs/batch.md, "Processing queue records"). Apart from
//! [`super::records`] so the replay reads it without depending on the
//! records' authority rows.

use gcs_protocol::{
    ids, Limits, MessageType, NodeId, ProcessingSubTask, ProcessingTask, ProtocolError, QueueJob,
    QueueJobBody, Signature, SignedMessage, PROTOCOL_VERSION,
};
use serde::{Deserialize, Serialize};

use super::queue::MAX_SUBTASKS;

/// Chunk ids one subtask may name.
pub const MAX_CHUNKS_PER_SUBTASK: usize = 256;

/// A processing task as its gateway enqueued it: the unified queue wrapper
/// (26.22.3) around the `ProcessingTask`, its subtasks, the tenant it runs
/// for, signed by the gateway. Signed as `GCS_QUEUE_JOB` (the wrapper is
/// unsigned on its own, so no other signed message shares the tag).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskRecord {
    /// Always `GCS_QUEUE_JOB`.
    pub message_type: MessageType,
    /// The protocol version.
    pub version: u16,
    /// The tenant whose work it is.
    pub tenant_id: String,
    /// The enqueueing gateway; signer.
    pub gateway_node_id: NodeId,
    /// The OpenAI batch it runs, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_id: Option<String>,
    /// `kind: processing_chunk`, body a `ProcessingTask`.
    pub job: QueueJob,
    /// Exactly `subtask_count` subtasks of the task.
    pub subtasks: Vec<ProcessingSubTask>,
    /// Creation time.
    pub created_at_ms: u64,
    /// The gateway's signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

fn field(field: &'static str, reason: &str) -> ProtocolError {
    ProtocolError::Field { field, reason: reason.into() }
}

impl TaskRecord {
    /// A record of `task` for `tenant`, unsigned.
    pub fn new(
        tenant_id: &str,
        gateway: &NodeId,
        task: ProcessingTask,
        subtasks: Vec<ProcessingSubTask>,
        now_ms: u64,
    ) -> Self {
        Self {
            message_type: MessageType::QueueJob,
            version: PROTOCOL_VERSION,
            tenant_id: tenant_id.into(),
            gateway_node_id: gateway.clone(),
            batch_id: None,
            job: QueueJob::wrap(QueueJobBody::ProcessingTask(task)),
            subtasks,
            created_at_ms: now_ms,
            signature: None,
        }
    }

    /// The task inside.
    pub fn task(&self) -> Option<&ProcessingTask> {
        match &self.job.body {
            QueueJobBody::ProcessingTask(t) => Some(t),
            _ => None,
        }
    }
}

impl SignedMessage for TaskRecord {
    const TYPE: MessageType = MessageType::QueueJob;
    signed_common!(gateway_node_id);
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        if self.message_type != MessageType::QueueJob || self.version != PROTOCOL_VERSION {
            return Err(field("message_type", "not a GCS_QUEUE_JOB of this version"));
        }
        if self.tenant_id.is_empty() || self.tenant_id.len() > 128 {
            return Err(field("tenant_id", "1-128 bytes"));
        }
        if self.batch_id.as_ref().is_some_and(|b| b.len() > 128) {
            return Err(field("batch_id", "at most 128 bytes"));
        }
        self.job.check()?;
        let Some(t) = self.task() else { return Err(field("job", "not a processing task")) };
        ids::check_id("task_id", &t.task_id, ids::TASK)?;
        if t.subtask_count as usize != self.subtasks.len() || self.subtasks.len() > MAX_SUBTASKS {
            return Err(field("subtasks", "subtask_count subtasks, at most 4096"));
        }
        for s in &self.subtasks {
            if s.task_id != t.task_id || s.subtask_id.is_empty() || s.subtask_id.len() > 128 {
                return Err(field("subtasks", "of another task, or a bad id"));
            }
            if s.chunk_ids.len() > MAX_CHUNKS_PER_SUBTASK
                || s.chunk_ids.iter().any(|c| c.len() > 128)
            {
                return Err(field("subtasks.chunk_ids", "at most 256 ids of 128 bytes"));
            }
        }
        Ok(())
    }
}

