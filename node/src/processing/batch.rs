//! The gateway's side of a batch on the processing queue (specs/batch.md,
//! "Processing on the network"): [`capacity`] (does a fresh worker
//! advertise processing slots for the model), [`enqueue`] (the batch's
//! rendered requests become one task; its record is gossiped) and
//! [`collect`] (the answers of accepted results, each metered once by a
//! usage record naming the batch, its price and the worker that ran it).

use std::collections::HashSet;
use std::sync::Arc;

use gcs_gateway::backend::{ProcessedLine, ProcessingBatch, ProcessingMeter, TaskProgress};
use gcs_keyspace::{keys, Keyspace};
use gcs_protocol::{
    now_ms, ApiType, MessageType, NodeKey, NodeRegistration, RoutingMode, UsageRecord,
    PROTOCOL_VERSION,
};

use super::chunks::{self, Line, OutputChunk, TaskParams, TaskSpec, CHUNK_VERSION};
use super::chunks::ProcessingError;
use crate::network::Network;
use crate::tenants::TrustHandle;
use crate::topics;

/// Requests per subtask: small, so two workers share even a short batch
/// and a lost lock costs little.
pub const PER_SUBTASK: usize = 4;

/// Whether one of `regs` (fresh registrations) takes processing subtasks
/// of `model` (its id or an alias).
pub fn capacity(regs: &[NodeRegistration], model: &str) -> bool {
    regs.iter().any(|r| {
        r.capabilities.processing_chunk_job
            && r.queue.max_concurrent_processing_jobs > 0
            && r.models.iter().any(|m| m.model_id == model || m.aliases.iter().any(|a| a == model))
    })
}

fn runtime(e: impl std::fmt::Display) -> ProcessingError {
    ProcessingError::Runtime(e.to_string())
}

/// Stores the batch's requests as one task (input chunks kept here, the
/// signed task record gossiped, the batch's manifest beside it for the
/// tenant's other gateways to pull); returns the task id.
pub async fn enqueue(
    ks: Arc<Keyspace>,
    key: Arc<NodeKey>,
    trust: TrustHandle,
    net: &Network,
    b: ProcessingBatch,
) -> Result<String, ProcessingError> {
    let m = b.meter.clone();
    let spec = TaskSpec {
        tenant_id: m.tenant_id.clone(),
        batch_id: Some(m.batch_id.clone()),
        params: TaskParams { v: CHUNK_VERSION, model: m.model.clone(), api_type: m.api_type },
        cache_salt: hex::encode(crate::jobs::announce::cache_salt(&key, &m.tenant_id)),
        per_subtask: PER_SUBTASK,
    };
    let lines: Vec<Line> = b
        .lines
        .into_iter()
        .map(|l| Line { index: l.index, custom_id: Some(l.custom_id), body: l.body })
        .collect();
    let manifest = b.manifest;
    let (task_id, delta) = tokio::task::spawn_blocking(move || {
        let now = now_ms();
        let (task_id, d) = chunks::enqueue(&ks, &key, &trust, &spec, &lines, now)?;
        // Before the task's delta leaves: a mirror that hears of the task
        // finds its manifest here.
        let task = super::records::task(&ks, &task_id)?.ok_or(ProcessingError::Unknown)?;
        super::manifest::write(&ks, &key, &task, manifest, now)?;
        Ok::<_, ProcessingError>((task_id, d))
    })
    .await
    .map_err(runtime)??;
    if let Err(e) = net.publish(topics::KEYSPACE_DELTAS, delta.encode()).await {
        // No peer yet: anti-entropy carries the task when one connects.
        tracing::debug!(task_id, error = %e, "task record not gossiped");
    }
    tracing::info!(task_id, batch_id = %m.batch_id, model = %m.model, "batch enqueued as a processing task");
    Ok(task_id)
}

/// Cancels a task this gateway enqueued (a cancelled batch): the signed
/// cancel is stored and gossiped; workers take none of its subtasks any
/// more and stop the running ones between requests.
pub async fn cancel(
    ks: Arc<Keyspace>,
    key: Arc<NodeKey>,
    trust: TrustHandle,
    net: &Network,
    task_id: String,
) -> Result<(), ProcessingError> {
    let id = task_id.clone();
    let delta = tokio::task::spawn_blocking(move || {
        super::records::cancel(&ks, &id, "batch_cancelled", &key, &trust, now_ms())
    })
    .await
    .map_err(runtime)??;
    if let Some(d) = delta {
        if let Err(e) = net.publish(topics::KEYSPACE_DELTAS, d.encode()).await {
            tracing::debug!(task_id, error = %e, "task cancel not gossiped");
        }
        tracing::info!(task_id, "processing task cancelled");
    }
    Ok(())
}

/// The batch `batch_id` of `tenant_id` another gateway of the tenant
/// enqueued, as this node holds it (`manifest::find`).
pub async fn find(
    ks: Arc<Keyspace>,
    trust: TrustHandle,
    tenant_id: String,
    batch_id: String,
) -> Result<Option<gcs_gateway::backend::FoundBatch>, ProcessingError> {
    let found = tokio::task::spawn_blocking(move || {
        super::manifest::find(&ks, &trust, &tenant_id, &batch_id, now_ms())
    })
    .await
    .map_err(runtime)??;
    Ok(found.map(|f| gcs_gateway::backend::FoundBatch {
        creator: f.creator.to_string(),
        manifest: f.batch,
        tasks: f.tasks,
        custom_ids: f.custom_ids,
    }))
}

/// The id an output's usage record is filed under: derived from the task,
/// chunk and lock, so collecting it again (a restart) finds it.
fn usage_job_id(o: &OutputChunk) -> String {
    let h = blake3::hash(format!("{}/{}/{}", o.task_id, o.chunk_id, o.lock_id).as_bytes());
    let mut r = [0u8; 16];
    r[..10].copy_from_slice(&h.as_bytes()[..10]);
    let random = u128::from_le_bytes(r);
    format!("{}{}", gcs_protocol::ids::JOB, ulid::Ulid::from_parts(o.created_at_ms, random))
}

/// The signed usage record of one output, under [`usage_job_id`].
fn usage_of(o: &OutputChunk, m: &ProcessingMeter, key: &NodeKey, now: u64) -> Result<UsageRecord, ProcessingError> {
    let job_id = usage_job_id(o);
    let embedding = m.api_type == ApiType::Embedding;
    let mut u = UsageRecord {
        message_type: MessageType::UsageRecord,
        version: PROTOCOL_VERSION,
        job_id,
        tenant_id: m.tenant_id.clone(),
        project_id: m.project_id.clone(),
        api_key_id: m.api_key_id.clone(),
        node_id: Some(o.node_id.clone()),
        recorded_by: key.node_id(),
        model: m.model.clone(),
        api_type: m.api_type,
        network: RoutingMode::Public,
        input_tokens: o.input_tokens,
        cached_tokens: 0,
        output_tokens_generated: o.output_tokens,
        output_tokens_sent_to_client: o.output_tokens,
        embedding_tokens: if embedding { o.input_tokens } else { 0 },
        retrieval_chunks: 0,
        child_jobs: 0,
        compute_ms: 0,
        first_token_ms: None,
        wall_ms: 0,
        requeue_count: 0,
        cost_gnus: "0".into(),
        cancellation_reason: None,
        failed_after_partial_output: false,
        batch_id: Some(m.batch_id.clone()),
        holders: vec![],
        parent_job_id: None,
        price_percent: m.price_percent,
        created_at_ms: now,
        signature: None,
    };
    gcs_protocol::SignedMessage::check_fields(&u, &gcs_protocol::Limits::default())?;
    gcs_protocol::sign(&mut u, key)?;
    Ok(u)
}

/// The task's answers so far but those of the requests in `skip`; the
/// usage record of each answer with status 200 is stored (synced) and
/// gossiped to the tenant's gateways before the answer is returned.
pub async fn collect(
    ks: Arc<Keyspace>,
    key: Arc<NodeKey>,
    net: &Network,
    task_id: String,
    m: ProcessingMeter,
    skip: Arc<HashSet<u64>>,
) -> Result<TaskProgress, ProcessingError> {
    let tenant = m.tenant_id.clone();
    let (progress, deltas) =
        tokio::task::spawn_blocking(move || collect_here(&ks, &key, &task_id, &m, &skip, now_ms()))
            .await
            .map_err(runtime)??;
    if topics::valid_tenant(&tenant) {
        for d in deltas {
            if let Err(e) = net.publish(&topics::tenant_usage(&tenant), d.encode()).await {
                tracing::debug!(error = %e, "batch usage record not gossiped");
            }
        }
    }
    Ok(progress)
}

/// [`collect`] on this node's store: the answers, and the deltas of the
/// usage records stored by this call (none for an answer metered before).
pub fn collect_here(
    ks: &Keyspace,
    key: &NodeKey,
    task_id: &str,
    m: &ProcessingMeter,
    skip: &HashSet<u64>,
    now: u64,
) -> Result<(TaskProgress, Vec<gcs_keyspace::Delta>), ProcessingError> {
    let c = chunks::collect(ks, task_id, now, skip)?;
    let mut deltas = vec![];
    let mut answered = vec![];
    for o in c.outputs {
        // An answer returned by an earlier poll is in `skip`; one returned
        // before a restart (and not in the runner's results) is metered
        // already: only an answer not metered yet costs a signature.
        let job_id = usage_job_id(&o);
        if o.status == 200 && ks.get_bytes(&keys::usage(&job_id))?.is_none() {
            let u = usage_of(&o, m, key, now)?;
            deltas.push(crate::replication::record_usage(ks, &u, now).map_err(runtime)?);
        }
        let body = serde_json::from_str(&o.body)
            .unwrap_or_else(|_| serde_json::Value::String(o.body.clone()));
        answered.push(ProcessedLine { index: o.index, status: o.status, body, request_id: job_id });
    }
    let progress = TaskProgress { answered, bad: c.bad, open: c.open + c.missing, cancelled: c.cancelled };
    Ok((progress, deltas))
}
