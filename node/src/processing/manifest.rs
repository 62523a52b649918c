//! A batch's manifest (specs/batch.md, "Adoption"): what another gateway
//! of the tenant needs to take a batch over when the gateway that created
//! it is gone. The creating gateway signs one per task of the batch, next
//! to the task (`/gcs/local/batch_manifests/<batch>/<task>`, never
//! gossiped: only the tenant's gateways pull it, `super::mirror`). Its
//! `batch` bytes are the gateway layer's own (the batch object as created);
//! this layer checks who signed them and for which task, tenant and batch.
//! The lines' `custom_id`s travel in the input chunks, so a manifest stays
//! small whatever the batch's size.

use gcs_keyspace::{keys, Keyspace};
use gcs_protocol::{
    ids, Limits, MessageType, NodeId, NodeKey, ProtocolError, Signature, SignedMessage,
};
use serde::{Deserialize, Serialize};

use super::chunks::{self, field, labelled, ProcessingError, TaskParams};
use super::records::TaskRecord;
use crate::tenants::TenantTrust;

/// Version of [`BatchManifest`].
pub const MANIFEST_VERSION: u16 = 1;
/// Largest `batch` a manifest carries (the batch object: its metadata is
/// bounded at 16 values of 512 bytes).
pub const MAX_BATCH_BYTES: usize = 64 << 10;

/// One task's copy of its batch's manifest, signed by the task's gateway.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BatchManifest {
    /// Always `GCS_QUEUE_JOB` (domain-separated by its signing payload).
    pub message_type: MessageType,
    /// [`MANIFEST_VERSION`].
    pub version: u16,
    /// The task it travels with.
    pub task_id: String,
    /// The batch, as the task record names it.
    pub batch_id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The task's gateway; signer.
    pub gateway_node_id: NodeId,
    /// The gateway layer's batch object (opaque here).
    #[serde(with = "serde_bytes")]
    pub batch: Vec<u8>,
    /// Creation time.
    pub created_at_ms: u64,
    /// The gateway's signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<Signature>,
}

impl SignedMessage for BatchManifest {
    const TYPE: MessageType = MessageType::QueueJob;
    signed_common!(gateway_node_id);
    fn check_fields(&self, _: &Limits) -> Result<(), ProtocolError> {
        if self.message_type != Self::TYPE || self.version != MANIFEST_VERSION {
            return Err(field("message_type", "not a batch manifest of this version"));
        }
        ids::check_id("task_id", &self.task_id, ids::TASK)?;
        if self.batch_id.is_empty() || self.batch_id.len() > 128 || self.tenant_id.len() > 128 {
            return Err(field("batch_id", "1-128 bytes, tenant at most 128"));
        }
        if self.batch.len() > MAX_BATCH_BYTES {
            return Err(field("batch", "over the manifest bound"));
        }
        Ok(())
    }
    fn signing_payload(&self, v: &ciborium::value::Value) -> Result<Vec<u8>, ProtocolError> {
        labelled(b"GCS/processing/batch-manifest\0", v)
    }
}

/// Largest encoded manifest.
pub const MAX_MANIFEST_BYTES: usize = MAX_BATCH_BYTES + 4096;

/// Signs and stores the manifest of `task` (this node's, just enqueued).
pub fn write(
    ks: &Keyspace,
    key: &NodeKey,
    task: &TaskRecord,
    batch: Vec<u8>,
    now_ms: u64,
) -> Result<(), ProcessingError> {
    let (Some(t), Some(batch_id)) = (task.task(), task.batch_id.clone()) else {
        return Err(ProcessingError::Mismatch("a manifest of a task of no batch"));
    };
    let mut m = BatchManifest {
        message_type: MessageType::QueueJob,
        version: MANIFEST_VERSION,
        task_id: t.task_id.clone(),
        batch_id,
        tenant_id: task.tenant_id.clone(),
        gateway_node_id: key.node_id(),
        batch,
        created_at_ms: now_ms,
        signature: None,
    };
    m.check_fields(&Limits::default())?;
    gcs_protocol::sign(&mut m, key)?;
    let bytes = gcs_protocol::encode(&m)?;
    ks.put(&keys::batch_manifest(&m.batch_id, &m.task_id), bytes, now_ms)?;
    Ok(())
}

/// `bytes` as the manifest of `task`: signed by the task's gateway, for
/// this task, its tenant and its batch.
pub fn check(task: &TaskRecord, bytes: &[u8]) -> Result<BatchManifest, ProcessingError> {
    let m: BatchManifest = chunks::decode(bytes, MAX_MANIFEST_BYTES)?;
    let task_id = task.task().map(|t| t.task_id.as_str()).unwrap_or_default();
    if m.gateway_node_id != task.gateway_node_id || m.task_id != task_id {
        return Err(ProcessingError::Mismatch("a manifest of another task or gateway"));
    }
    if m.tenant_id != task.tenant_id || task.batch_id.as_deref() != Some(m.batch_id.as_str()) {
        return Err(ProcessingError::Mismatch("a manifest of another tenant or batch"));
    }
    Ok(m)
}

/// Stores a pulled manifest of `task` if it checks and none is here;
/// whether it was new.
pub fn store(
    ks: &Keyspace,
    task: &TaskRecord,
    bytes: &[u8],
    now_ms: u64,
) -> Result<bool, ProcessingError> {
    let m = check(task, bytes)?;
    let key = keys::batch_manifest(&m.batch_id, &m.task_id);
    if ks.get_bytes(&key)?.is_some() {
        return Ok(false);
    }
    ks.put(&key, bytes.to_vec(), now_ms)?;
    Ok(true)
}

/// The stored manifest of `task`, if any.
pub fn held(ks: &Keyspace, task: &TaskRecord) -> Result<Option<Vec<u8>>, ProcessingError> {
    let (Some(t), Some(b)) = (task.task(), task.batch_id.as_deref()) else { return Ok(None) };
    Ok(ks.get_bytes(&keys::batch_manifest(b, &t.task_id))?)
}

/// A batch another gateway created, as this node holds it.
#[derive(Clone, Debug)]
pub struct Found {
    /// The creating gateway.
    pub creator: NodeId,
    /// Its batch object (the gateway layer's bytes).
    pub batch: Vec<u8>,
    /// `(model, task id)` of each task whose manifest is here.
    pub tasks: Vec<(String, String)>,
    /// `(index, custom_id)` of every request of those tasks.
    pub custom_ids: Vec<(u64, String)>,
}

/// The batch `batch_id` of `tenant` from the manifests and input chunks
/// here: `None` when no manifest of it is here, or while an input of one
/// of its tasks is not (a mirror brings it within a few rounds). Every
/// manifest must be the same gateway's, of the same batch bytes, and that
/// gateway still one the tenant admitted.
pub fn find(
    ks: &Keyspace,
    trust: &TenantTrust,
    tenant_id: &str,
    batch_id: &str,
    now_ms: u64,
) -> Result<Option<Found>, ProcessingError> {
    let mut found: Option<Found> = None;
    for (key, v) in ks.scan_prefix(&keys::batch_manifests(batch_id))? {
        let task_id = &key[keys::batch_manifests(batch_id).len()..];
        let Some(bytes) = v.as_register().and_then(|r| r.value()) else { continue };
        let Some(task) = super::records::task(ks, task_id)? else { continue };
        let m = check(&task, bytes)?;
        // Another tenant's task under the same batch id is not this batch.
        if m.tenant_id != tenant_id {
            continue;
        }
        if super::records::admitted_gateway(ks, trust, tenant_id, &m.gateway_node_id, now_ms)
            .is_err()
        {
            return Err(ProcessingError::Mismatch("the batch's gateway is not the tenant's"));
        }
        let f = found.get_or_insert_with(|| Found {
            creator: m.gateway_node_id.clone(),
            batch: m.batch.clone(),
            tasks: vec![],
            custom_ids: vec![],
        });
        if f.creator != m.gateway_node_id || f.batch != m.batch {
            return Err(ProcessingError::Mismatch("the batch's manifests differ"));
        }
        let model = TaskParams::of(&task).ok_or(ProcessingError::Unknown)?.model;
        f.tasks.push((model, task_id.to_string()));
        for c in task.subtasks.iter().flat_map(|s| &s.chunk_ids) {
            let Some(b) = ks.get_bytes(&keys::processing_chunk(task_id, c))? else {
                tracing::debug!(batch_id, task_id, chunk = %c, "an input of the batch is not here yet");
                return Ok(None);
            };
            let input = chunks::check_input(&task, c, &b)?;
            let id = input
                .custom_id
                .ok_or(ProcessingError::Mismatch("an input without its custom_id"))?;
            f.custom_ids.push((input.index, id));
        }
    }
    Ok(found)
}
