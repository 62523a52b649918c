//! The one small trait the HTTP edge needs from the network: submit a job,
//! receive its fenced events, cancel it, and read what the network can serve
//! and what it has metered. `gcs-node` implements it over libp2p; this crate
//! knows nothing of libp2p or the engine.

use std::future::Future;
use std::pin::Pin;

use gcs_protocol::{
    ApiType, CancellationReason, ErrorInfo, FinalResult, JobLimits, NodeId, NodeRegistration,
    Routing, StreamChunk, UsageRecord,
};
use thiserror::Error;
use tokio::sync::mpsc;

/// A boxed future (the trait is used as `dyn Backend`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a client of the gateway asks for.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// API surface.
    pub api_type: ApiType,
    /// Model or alias.
    pub model: String,
    /// Whether the client streams.
    pub stream: bool,
    /// The payload the worker runs: a [`crate::payload::JobRequest`] as
    /// [`crate::payload::JobRequest::encode`] writes it (opaque to the
    /// network, which signs its hash).
    pub body: Vec<u8>,
    /// Tenant.
    pub tenant_id: String,
    /// Project.
    pub project_id: String,
    /// API key id.
    pub api_key_id: String,
    /// Client idempotency key (or a request hash).
    pub idempotency_key: String,
    /// Timeouts.
    pub limits: JobLimits,
    /// Requested output budget.
    pub max_output_tokens: u32,
    /// Routing mode, privacy and claim policy (26.11.3, 26.15.4).
    pub routing: Routing,
    /// The OpenAI batch this job runs for, if any: its usage record names
    /// it (specs/batch.md, "Metering").
    pub batch_id: Option<String>,
    /// The API job this one is a child of (26.14.2): announced with the job
    /// (signed) and named by its usage record. The caller gives a child the
    /// parent's routing and privacy, and limits whose wall timeout ends at
    /// the parent's deadline.
    pub parent: Option<gcs_protocol::ChildJobReference>,
    /// The price of this job's tokens in percent of the API price (batch
    /// work, specs/batch.md "Pricing"); its usage record says so and a
    /// budget charges that share. `None` is the full price.
    pub price_percent: Option<u8>,
}

/// The roll-up of a parent job whose children ran in the network: the
/// parent's own usage record (26.21.1 `child_jobs`), signed by the gateway.
/// Its token counts are the children's sums, which the children's records
/// already charge ([`UsageRecord::charged_tokens`] is 0 for it).
#[derive(Clone, Debug)]
pub struct ParentUsage {
    /// The parent's `gcsapi_` id.
    pub job_id: String,
    /// API surface.
    pub api_type: ApiType,
    /// Model as the client named it.
    pub model: String,
    /// Tenant.
    pub tenant_id: String,
    /// Project.
    pub project_id: String,
    /// API key id.
    pub api_key_id: String,
    /// Routing mode of the request (its children's).
    pub network: gcs_protocol::RoutingMode,
    /// Children the parent spawned (≥ 1).
    pub child_jobs: u32,
    /// Sum of the children's input tokens.
    pub input_tokens: u64,
    /// Sum of the children's generated tokens.
    pub output_tokens: u64,
    /// Sum of the children's compute time.
    pub compute_ms: u64,
    /// From the parent's admission to its end.
    pub wall_ms: u64,
    /// Why the parent ended early (a failed child cancels the others).
    pub cancellation_reason: Option<CancellationReason>,
    /// The batch, if any.
    pub batch_id: Option<String>,
    /// As [`JobSpec::price_percent`].
    pub price_percent: Option<u8>,
}

/// What the network tells the client, in order.
#[derive(Clone, Debug)]
pub enum JobEvent {
    /// A worker won the job (first grant or after a requeue).
    Leased {
        /// The lease holder.
        node_id: NodeId,
    },
    /// The next fenced chunk.
    Chunk(Box<StreamChunk>),
    /// Finished.
    Completed(Box<FinalResult>),
    /// Failed; `after_partial_output` says whether chunks were already sent.
    Failed {
        /// OpenAI-shaped error.
        error: ErrorInfo,
        /// Whether chunks were already sent.
        after_partial_output: bool,
    },
    /// Cancelled at the client's request.
    Cancelled,
}

/// The code of a 503 for a request whose job or usage record could not be
/// stored (a full or failing disk): the client may retry elsewhere or later.
pub const STORAGE_UNAVAILABLE: &str = "gnus_storage_unavailable";

/// Why the network did not take a job.
#[derive(Debug, Error)]
pub enum BackendError {
    /// An idempotency key was reused with a different request body (HTTP 422).
    #[error("idempotency key already used for job {job_id} with a different request body")]
    IdempotencyConflict {
        /// The job the key belongs to.
        job_id: String,
    },
    /// The node is shutting down.
    #[error("the node is stopping")]
    Stopping,
    /// No node may win the job now (HTTP 503 `gnus_no_capable_nodes`,
    /// with why).
    #[error("{0}")]
    NoCapableNodes(String),
    /// The node's storage failed (logged; never shown to a client).
    #[error("storage: {0}")]
    Storage(String),
    /// Anything else (signing, the runtime): logged, never shown to a client.
    #[error("{0}")]
    Internal(String),
}

impl BackendError {
    /// The answer a client gets: storage and internal details stay in the
    /// gateway's log.
    pub fn to_api(&self) -> crate::ApiError {
        match self {
            BackendError::IdempotencyConflict { job_id } => {
                crate::ApiError::idempotency_conflict(job_id)
            }
            BackendError::Stopping => crate::ApiError::unavailable(self.to_string()),
            BackendError::NoCapableNodes(why) => {
                let mut e = crate::ApiError::no_capable_nodes("");
                e.message = why.clone();
                e
            }
            BackendError::Storage(_) => {
                tracing::error!(error = %self, "backend storage failure");
                crate::ApiError::from_info(&gcs_protocol::ErrorInfo {
                    kind: "service_unavailable".into(),
                    code: STORAGE_UNAVAILABLE.into(),
                    message: "the gateway's storage is unavailable; retry later".into(),
                })
            }
            BackendError::Internal(_) => {
                tracing::error!(error = %self, "backend failure");
                crate::ApiError::internal("internal error; the gateway's log has the details")
            }
        }
    }
}

/// The network as the gateway sees it.
pub trait Backend: Send + Sync + std::fmt::Debug + 'static {
    /// Signs and publishes a job; returns its id and the fenced event stream.
    fn submit(
        &self,
        spec: JobSpec,
    ) -> BoxFuture<'_, Result<(String, mpsc::Receiver<JobEvent>), BackendError>>;

    /// Cancels a job on the client's behalf (disconnect, timeout, backpressure).
    fn cancel(&self, job_id: String, reason: CancellationReason) -> BoxFuture<'_, ()>;

    /// Fresh worker registrations: what the network can serve right now.
    fn registrations(&self) -> Vec<NodeRegistration>;

    /// The node's own metrics in the Prometheus text format (worker load,
    /// peers), appended to `GET /metrics`.
    fn node_metrics(&self) -> String {
        String::new()
    }

    /// Signs and stores a parent job's roll-up usage record (after its
    /// children ended); an error means it is not known to be stored.
    fn record_parent(&self, parent: ParentUsage) -> BoxFuture<'_, Result<(), BackendError>>;

    /// The usage records of one API key created in `[since_ms, until_ms)`.
    fn usage(
        &self,
        api_key_id: &str,
        since_ms: u64,
        until_ms: u64,
    ) -> Result<Vec<UsageRecord>, BackendError>;

    /// Whether some fresh worker advertises processing slots for `model`
    /// (specs/batch.md, "Processing on the network"); a backend without a
    /// processing queue has none, and batches run through the handlers.
    fn processing_capacity(&self, model: &str) -> bool {
        let _ = model;
        false
    }

    /// Enqueues one processing task of a batch's requests (one model);
    /// returns its task id.
    fn enqueue(&self, task: ProcessingBatch) -> BoxFuture<'_, Result<String, BackendError>> {
        drop(task);
        Box::pin(async { Err(BackendError::NoCapableNodes("no processing queue".into())) })
    }

    /// Cancels a task of a cancelled batch in the network: no worker
    /// takes its subtasks any more, and those running stop between
    /// requests. Cancelling it again changes nothing.
    fn cancel_task(&self, task_id: String) -> BoxFuture<'_, Result<(), BackendError>> {
        let _ = task_id;
        Box::pin(async { Err(BackendError::NoCapableNodes("no processing queue".into())) })
    }

    /// The batch `batch_id` of `tenant_id` that another gateway of the
    /// tenant enqueued, if this node holds its manifest and every input
    /// of its tasks (specs/batch.md, "Adoption").
    fn find_batch(
        &self,
        tenant_id: String,
        batch_id: String,
    ) -> BoxFuture<'_, Result<Option<FoundBatch>, BackendError>> {
        let _ = (tenant_id, batch_id);
        Box::pin(async { Ok(None) })
    }

    /// What a task's workers answered so far, but the requests in `skip`
    /// (answers the caller holds already: their outputs are not read
    /// again). Each answer's usage record (`batch_id`, the batch price) is
    /// stored, once, before it is returned.
    fn collect(
        &self,
        task_id: String,
        meter: ProcessingMeter,
        skip: std::sync::Arc<std::collections::HashSet<u64>>,
    ) -> BoxFuture<'_, Result<TaskProgress, BackendError>> {
        let _ = (task_id, meter, skip);
        Box::pin(async { Err(BackendError::NoCapableNodes("no processing queue".into())) })
    }
}

/// Who a processing task's answers are metered to.
#[derive(Clone, Debug)]
pub struct ProcessingMeter {
    /// The batch.
    pub batch_id: String,
    /// Tenant.
    pub tenant_id: String,
    /// Project.
    pub project_id: String,
    /// The key that created the batch.
    pub api_key_id: String,
    /// API surface of every request.
    pub api_type: ApiType,
    /// The model every request names.
    pub model: String,
    /// As [`JobSpec::price_percent`].
    pub price_percent: Option<u8>,
}

/// A batch's requests of one model, rendered for the processing queue.
#[derive(Clone, Debug)]
pub struct ProcessingBatch {
    /// Metering and the model.
    pub meter: ProcessingMeter,
    /// Its requests.
    pub lines: Vec<ProcessingLine>,
    /// The batch as another gateway of the tenant would take it over
    /// (`batch::adopt`): kept with the task and mirrored to the tenant's
    /// gateways, opaque to the network.
    pub manifest: Vec<u8>,
}

/// One request of a batch on the processing queue.
#[derive(Clone, Debug)]
pub struct ProcessingLine {
    /// Its place in the batch.
    pub index: u64,
    /// The client's `custom_id`.
    pub custom_id: String,
    /// The job payload the request sent alone carries.
    pub body: Vec<u8>,
}

/// A batch another gateway of the tenant created, as this node holds it
/// (`Backend::find_batch`).
#[derive(Clone, Debug)]
pub struct FoundBatch {
    /// The creating gateway's node id.
    pub creator: String,
    /// [`ProcessingBatch::manifest`].
    pub manifest: Vec<u8>,
    /// `(model, task id)` of each of its tasks held here.
    pub tasks: Vec<(String, String)>,
    /// `(place in the batch, custom_id)` of every request of those tasks.
    pub custom_ids: Vec<(u64, String)>,
}

/// One request a worker answered.
#[derive(Clone, Debug)]
pub struct ProcessedLine {
    /// Its place in the batch.
    pub index: u64,
    /// The HTTP status the request sent alone would have had.
    pub status: u16,
    /// The response body (or error envelope).
    pub body: serde_json::Value,
    /// The id its usage record is filed under.
    pub request_id: String,
}

/// A task's answers so far.
#[derive(Clone, Debug, Default)]
pub struct TaskProgress {
    /// Answered requests, in batch order.
    pub answered: Vec<ProcessedLine>,
    /// Requests of subtasks marked bad, with the reason.
    pub bad: Vec<(u64, String)>,
    /// Requests not answered yet.
    pub open: usize,
    /// Whether a gateway of the tenant cancelled the task.
    pub cancelled: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_failures_are_a_503_without_their_text() {
        let e = BackendError::Storage("IO error: No space left on device: /data/000123.log".into());
        let api = e.to_api();
        assert_eq!(api.status.as_u16(), 503);
        assert_eq!(api.code, STORAGE_UNAVAILABLE);
        assert!(api.retry_after.is_some());
        let body = api.body().to_string();
        assert!(!body.contains("No space") && !body.contains("/data"), "{body}");
        let api = BackendError::NoCapableNodes("none of tenant t's pinned nodes".into()).to_api();
        assert_eq!((api.status.as_u16(), api.code.as_str()), (503, "gnus_no_capable_nodes"));
        assert!(api.body().to_string().contains("pinned nodes"));
        let api = BackendError::Internal("signing: bad key at /root/x".into()).to_api();
        assert_eq!(api.status.as_u16(), 500);
        assert!(!api.body().to_string().contains("/root"));
    }
}
