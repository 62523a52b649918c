//! The node as the HTTP gateway's [`Backend`]: jobs go to the runtime task,
//! models come from fresh registrations, usage from the keyspace.

use std::sync::{Arc, Mutex};

use gcs_gateway::backend::{ProcessingBatch, ProcessingMeter, TaskProgress};
use gcs_gateway::{Backend, BackendError, BoxFuture, JobEvent, JobSpec, ParentUsage};
use gcs_keyspace::Keyspace;
use gcs_protocol::{now_ms, CancellationReason, NodeRegistration, UsageRecord};
use tokio::sync::{mpsc, oneshot};

use crate::error::NodeError;
use crate::jobs::worker::WorkerState;
use crate::registry::Registry;

/// What the client handle asks of the runtime task, with one-shot replies.
pub(crate) enum RuntimeCommand {
    Submit(Box<JobSpec>, oneshot::Sender<Result<(String, mpsc::Receiver<JobEvent>), NodeError>>),
    Cancel(String, CancellationReason),
    /// A parent job's roll-up usage record (jobs::parent).
    RecordParent(Box<ParentUsage>, oneshot::Sender<Result<(), NodeError>>),
}

/// A cloneable handle to a running node's gateway side.
#[derive(Clone)]
pub struct NodeClient {
    commands: mpsc::Sender<RuntimeCommand>,
    registry: Arc<Mutex<Registry>>,
    keyspace: Arc<Keyspace>,
    /// This node's own worker (`--role all`), for its metrics.
    worker: Option<WorkerState>,
    network: crate::network::Network,
    /// Usage refusals (`gcs_usage_refused_total`); which gateways tenants admitted.
    trust: crate::tenants::TrustHandle,
    /// This node's key (signs processing tasks and their usage records).
    key: Arc<gcs_protocol::NodeKey>,
}

impl std::fmt::Debug for NodeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeClient").finish_non_exhaustive()
    }
}

impl NodeClient {
    pub(crate) fn new(
        commands: mpsc::Sender<RuntimeCommand>,
        registry: Arc<Mutex<Registry>>,
        keyspace: Arc<Keyspace>,
        worker: Option<WorkerState>,
        network: crate::network::Network,
        trust: crate::tenants::TrustHandle,
        key: Arc<gcs_protocol::NodeKey>,
    ) -> Self {
        Self { commands, registry, keyspace, worker, network, trust, key }
    }

    /// Submits a job; see [`crate::NodeHandle::submit`].
    pub async fn submit(
        &self,
        spec: JobSpec,
    ) -> Result<(String, mpsc::Receiver<JobEvent>), NodeError> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(RuntimeCommand::Submit(Box::new(spec), tx))
            .await
            .map_err(|_| NodeError::NetworkStopped)?;
        rx.await.map_err(|_| NodeError::NetworkStopped)?
    }

    /// Cancels a job on the client's behalf.
    pub async fn cancel(&self, job_id: &str, reason: CancellationReason) -> Result<(), NodeError> {
        self.commands
            .send(RuntimeCommand::Cancel(job_id.into(), reason))
            .await
            .map_err(|_| NodeError::NetworkStopped)
    }
}

impl Backend for NodeClient {
    fn submit(
        &self,
        spec: JobSpec,
    ) -> BoxFuture<'_, Result<(String, mpsc::Receiver<JobEvent>), BackendError>> {
        Box::pin(async move {
            NodeClient::submit(self, spec).await.map_err(|e| match e {
                NodeError::IdempotencyConflict { job_id } => {
                    BackendError::IdempotencyConflict { job_id }
                }
                NodeError::NetworkStopped => BackendError::Stopping,
                NodeError::NoCapableNodes(why) => BackendError::NoCapableNodes(why),
                e @ NodeError::Keyspace(_) => BackendError::Storage(e.to_string()),
                other => BackendError::Internal(other.to_string()),
            })
        })
    }

    fn cancel(&self, job_id: String, reason: CancellationReason) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Err(e) = NodeClient::cancel(self, &job_id, reason).await {
                tracing::debug!(job_id, error = %e, "cancel not delivered");
            }
        })
    }

    fn record_parent(&self, parent: ParentUsage) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move {
            let (tx, rx) = oneshot::channel();
            let stopped = |_| BackendError::Stopping;
            self.commands
                .send(RuntimeCommand::RecordParent(Box::new(parent), tx))
                .await
                .map_err(stopped)?;
            rx.await.map_err(|_| BackendError::Stopping)?.map_err(|e| match e {
                e @ NodeError::Keyspace(_) => BackendError::Storage(e.to_string()),
                other => BackendError::Internal(other.to_string()),
            })
        })
    }

    fn registrations(&self) -> Vec<NodeRegistration> {
        let r = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        r.fresh(now_ms()).cloned().collect()
    }

    fn node_metrics(&self) -> String {
        let mut out = String::new();
        if let Some(w) = &self.worker {
            out.push_str(&format!(
                "# HELP gcs_worker_active_jobs Jobs this node's worker runs now.\n\
                 # TYPE gcs_worker_active_jobs gauge\ngcs_worker_active_jobs {}\n\
                 # HELP gcs_worker_backlog_jobs Announced jobs waiting for a free slot here.\n\
                 # TYPE gcs_worker_backlog_jobs gauge\ngcs_worker_backlog_jobs {}\n\
                 # HELP gcs_worker_gateway_slots_peak Most slots one gateway held at once while another gateway was active.\n\
                 # TYPE gcs_worker_gateway_slots_peak gauge\ngcs_worker_gateway_slots_peak {}\n",
                w.load(),
                w.backlog_len(),
                w.peak_shared()
            ));
            out.push_str(
                "# HELP gcs_worker_jobs_ended_total Jobs this node's worker ended, by how.\n\
                 # TYPE gcs_worker_jobs_ended_total counter\n",
            );
            for (kind, n) in w.ended() {
                out.push_str(&format!("gcs_worker_jobs_ended_total{{termination=\"{kind}\"}} {n}\n"));
            }
        }
        out.push_str(&format!(
            "# HELP gcs_network_events_dropped_total Network events dropped while the runtime was behind.\n\
             # TYPE gcs_network_events_dropped_total counter\ngcs_network_events_dropped_total {}\n",
            self.network.events_dropped()
        ));
        out.push_str(&network_counters(self.network.stats()));
        out.push_str(&crate::jobs::continuations::metrics());
        out.push_str(&self.trust.usage_refusals().metrics());
        let fresh = self.registrations().len();
        out.push_str(&format!(
            "# HELP gcs_fresh_registrations Fresh worker registrations known.\n\
             # TYPE gcs_fresh_registrations gauge\ngcs_fresh_registrations {fresh}\n"
        ));
        out.push_str(&keyspace_memory(&self.keyspace));
        // The anti-entropy digests of the globally replicated namespaces:
        // two nodes whose digests are equal hold the same entries (netsim's
        // partition-and-heal scenario compares them across nodes). Each
        // metric family is one group, as the text format requires.
        let digests: Vec<(&str, gcs_keyspace::Digest)> = gcs_keyspace::Namespace::ALL
            .iter()
            .filter(|n| n.scope() == gcs_keyspace::Scope::Global)
            .filter_map(|n| Some((n.cf(), self.keyspace.digest(*n).ok()?)))
            .collect();
        out.push_str(
            "# HELP gcs_keyspace_entries Entries in a globally replicated keyspace namespace.\n\
             # TYPE gcs_keyspace_entries gauge\n",
        );
        for (cf, d) in &digests {
            out.push_str(&format!("gcs_keyspace_entries{{namespace=\"{cf}\"}} {}\n", d.count));
        }
        out.push_str(
            "# HELP gcs_keyspace_digest_info The namespace's anti-entropy digest (XOR of entry hashes).\n\
             # TYPE gcs_keyspace_digest_info gauge\n",
        );
        for (cf, d) in &digests {
            out.push_str(&format!(
                "gcs_keyspace_digest_info{{namespace=\"{cf}\",digest=\"{}\"}} 1\n",
                hex::encode(d.hash)
            ));
        }
        out
    }

    fn usage(
        &self,
        api_key_id: &str,
        since_ms: u64,
        until_ms: u64,
    ) -> Result<Vec<UsageRecord>, BackendError> {
        // One key's time range of its index, not every usage record.
        crate::indexes::usage_of_key(&self.keyspace, api_key_id, since_ms, until_ms)
            .map_err(|e| BackendError::Storage(e.to_string()))
    }

    fn processing_capacity(&self, model: &str) -> bool {
        crate::processing::batch::capacity(&self.registrations(), model)
    }

    fn enqueue(&self, task: ProcessingBatch) -> BoxFuture<'_, Result<String, BackendError>> {
        Box::pin(async move {
            let (ks, key, trust) = (self.keyspace.clone(), self.key.clone(), self.trust.clone());
            crate::processing::batch::enqueue(ks, key, trust, &self.network, task)
                .await
                .map_err(processing_error)
        })
    }

    fn cancel_task(&self, task_id: String) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move {
            let (ks, key, trust) = (self.keyspace.clone(), self.key.clone(), self.trust.clone());
            crate::processing::batch::cancel(ks, key, trust, &self.network, task_id)
                .await
                .map_err(processing_error)
        })
    }

    fn find_batch(
        &self,
        tenant_id: String,
        batch_id: String,
    ) -> BoxFuture<'_, Result<Option<gcs_gateway::backend::FoundBatch>, BackendError>> {
        Box::pin(async move {
            let (ks, trust) = (self.keyspace.clone(), self.trust.clone());
            crate::processing::batch::find(ks, trust, tenant_id, batch_id)
                .await
                .map_err(processing_error)
        })
    }

    fn collect(
        &self,
        task_id: String,
        meter: ProcessingMeter,
        skip: Arc<std::collections::HashSet<u64>>,
    ) -> BoxFuture<'_, Result<TaskProgress, BackendError>> {
        Box::pin(async move {
            let (ks, key) = (self.keyspace.clone(), self.key.clone());
            crate::processing::batch::collect(ks, key, &self.network, task_id, meter, skip)
                .await
                .map_err(processing_error)
        })
    }
}

fn processing_error(e: crate::processing::chunks::ProcessingError) -> BackendError {
    use crate::processing::chunks::ProcessingError as P;
    match e {
        e @ (P::Keyspace(_) | P::Runtime(_)) => BackendError::Storage(e.to_string()),
        other => BackendError::Internal(other.to_string()),
    }
}

/// The network layer's refusals and shedding, one counter family each.
fn network_counters(st: &crate::network::NetStats) -> String {
    use std::sync::atomic::Ordering::Relaxed;
    let rows = [
        ("gcs_keyspace_deltas_refused_quota_total", "Peer deltas refused: the sender's quota was spent.", &st.quota_refused),
        ("gcs_keyspace_deltas_refused_clock_total", "Peer deltas refused: an HLC or set clock out of bounds.", &st.clock_refused),
        ("gcs_anti_entropy_busy_total", "Anti-entropy requests answered busy (per-peer rate or concurrency).", &st.ae_busy),
        ("gcs_anti_entropy_answered_total", "Anti-entropy requests answered.", &st.ae_answered),
        ("gcs_anti_entropy_rounds_total", "Anti-entropy rounds started.", &st.ae_rounds),
        ("gcs_anti_entropy_rounds_capped_total", "Anti-entropy rounds stopped at the page cap.", &st.ae_rounds_capped),
        ("gcs_connections_denied_total", "Connections refused by the connection limits.", &st.connections_denied),
        ("gcs_gossip_merges_queued_total", "Gossiped keyspace deltas handed to the merge worker.", &st.gossip_merges_queued),
        ("gcs_gossip_merges_shed_total", "Gossiped keyspace deltas dropped: the merge worker's queue was full.", &st.gossip_merges_shed),
    ];
    rows.iter()
        .map(|(name, help, v)| {
            format!("# HELP {name} {help}\n# TYPE {name} counter\n{name} {}\n", v.load(Relaxed))
        })
        .collect()
}

/// RocksDB's own memory figures (soak RSS checks compare them with the
/// process's RSS; keyspace/src/store/memory.rs bounds them).
fn keyspace_memory(ks: &gcs_keyspace::Keyspace) -> String {
    let Ok(m) = ks.memory() else { return String::new() };
    let mut out = format!(
        "# HELP gcs_rocksdb_block_cache_bytes Bytes in the keyspace's shared block cache.\n\
         # TYPE gcs_rocksdb_block_cache_bytes gauge\ngcs_rocksdb_block_cache_bytes {}\n",
        m.block_cache
    );
    let families = [
        ("gcs_rocksdb_memtable_bytes", "Bytes in a column family's memtables."),
        ("gcs_rocksdb_table_readers_bytes", "Bytes of a column family's table readers outside the block cache."),
        ("gcs_rocksdb_sst_bytes", "Bytes of a column family's SST files on disk."),
    ];
    for (i, (name, help)) in families.iter().enumerate() {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for c in &m.column_families {
            let v = [c.memtables, c.table_readers, c.sst_bytes][i];
            out.push_str(&format!("{name}{{cf=\"{}\"}} {v}\n", c.cf));
        }
    }
    out
}
