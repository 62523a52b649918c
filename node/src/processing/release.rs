//! The two records that end processing work early (specs/batch.md,
//! "Processing queue records"): a holder's [`TaskRelease`] of its lock
//! (given back, or with the failure that made it give up, which counts
//! towards the subtask's bad mark on every replica), and a gateway's
//! [`TaskCancel`] of its task (no new locks; workers stop between
//! requests). Both are signed, bounded and checked against the stored
//! task by `records::check`.

use gcs_protocol::{
    ids, Limits, MessageType, NodeId, ProtocolError, Signature, SignedMessage, TaskLock,
    PROTOCOL_VERSION,
};
use serde::{Deserialize, Serialize};


/// Longest failure reason or cancel reason kept.
pub const MAX_REASON_BYTES: usize = 256;
/// Releases kept per subtask: a holder that locks and releases in a loop
/// fills them, and later holders let their locks expire instead.
pub const MAX_RELEASES_PER_SUBTASK: usize = 32;

fn field(field: &'static str, reason: &str) -> ProtocolError {
    ProtocolError::Field { field, reason: reason.into() }
}

fn reason_ok(field_name: &'static str, r: &str) -> Result<(), ProtocolError> {
    if r.is_empty() || r.len() > MAX_REASON_BYTES || r.chars().any(char::is_control) {
        return Err(field(field_name, "1-256 bytes without control characters"));
    }
    Ok(())
}

/// A holder gives its lock back: `failure` says why it could not do the
/// subtask (counted), `None` that it stopped (shutdown; not counted).
/// Carries the lock (its latest renewal) it releases, because the lock
/// key keeps only the newest lock of a subtask.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRelease {
    /// Always `GCS_PROCESSING_TASK_RELEASE`.
    pub message_type: MessageType,
    /// The protocol version.
    pub version: u16,
    /// The lock released, signed by its holder.
    pub lock: TaskLock,
    /// Why the holder could not finish, if it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// The holder; signer.
    pub node_id: NodeId,
    /// Release time (within the lock's lease).
    pub created_at_ms: u64,
    /// The holder's signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl SignedMessage for TaskRelease {
    const TYPE: MessageType = MessageType::TaskRelease;
    signed_common!(node_id);
    fn check_fields(&self, limits: &Limits) -> Result<(), ProtocolError> {
        if self.message_type != Self::TYPE || self.version != PROTOCOL_VERSION {
            return Err(field("message_type", "not a GCS_PROCESSING_TASK_RELEASE of this version"));
        }
        self.lock.check_fields(limits)?;
        gcs_protocol::verify(&self.lock)?;
        if self.lock.node_id != self.node_id {
            return Err(field("node_id", "not the holder of the lock it releases"));
        }
        if self.created_at_ms < self.lock.created_at_ms
            || self.created_at_ms >= self.lock.expires_at_ms
        {
            return Err(field("created_at_ms", "outside the lock's lease"));
        }
        if let Some(r) = &self.failure {
            reason_ok("failure", r)?;
        }
        Ok(())
    }
}

/// The task's gateway ends it: no new locks, and workers stop its
/// subtasks between requests. Once per task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskCancel {
    /// Always `GCS_PROCESSING_TASK_CANCEL`.
    pub message_type: MessageType,
    /// The protocol version.
    pub version: u16,
    /// The task.
    pub task_id: String,
    /// The task's gateway; signer.
    pub gateway_node_id: NodeId,
    /// Why (e.g. `batch_cancelled`).
    pub reason: String,
    /// Cancel time.
    pub created_at_ms: u64,
    /// The gateway's signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl SignedMessage for TaskCancel {
    const TYPE: MessageType = MessageType::TaskCancel;
    signed_common!(gateway_node_id);
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        if self.message_type != Self::TYPE || self.version != PROTOCOL_VERSION {
            return Err(field("message_type", "not a GCS_PROCESSING_TASK_CANCEL of this version"));
        }
        ids::check_id("task_id", &self.task_id, ids::TASK)?;
        reason_ok("reason", &self.reason)
    }
}
