//! The keyspace's namespaces (26.12.3, 26.23): one RocksDB column family
//! each, each holding one kind of CRDT and replicated with one scope.

use crate::error::KeyspaceError;

/// Which CRDT a namespace holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueKind {
    /// Last-writer-wins register: one writer at a time.
    Register,
    /// Add-wins set: many writers add.
    Set,
}

impl ValueKind {
    /// Name for errors.
    pub fn name(self) -> &'static str {
        match self {
            ValueKind::Register => "register",
            ValueKind::Set => "set",
        }
    }
}

/// Who receives a namespace's deltas (used by the network layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Every node.
    Global,
    /// Only the gateway and the worker of that job.
    JobParticipants,
    /// Only the gateways serving the tenant.
    TenantGateways,
    /// Never leaves the node.
    Local,
}

/// An hour, in milliseconds.
const HOUR: u64 = 3_600_000;
/// A day, in milliseconds.
const DAY: u64 = 24 * HOUR;
/// How long usage records (and their indexes) are kept: a key's budget and
/// `/v1/usage` count what is within it.
pub const USAGE_RETENTION_MS: u64 = 400 * DAY;

macro_rules! namespaces {
    ($($variant:ident => ($prefix:literal, $cf:literal, $kind:ident, $scope:ident, $retention:expr)),* $(,)?) => {
        /// A namespace of the keyspace.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Namespace {
            $(
                #[doc = $prefix]
                $variant,
            )*
        }
        impl Namespace {
            /// Every namespace.
            pub const ALL: &'static [Namespace] = &[$(Namespace::$variant),*];
            /// Key prefix, with trailing slash.
            pub fn prefix(self) -> &'static str {
                match self { $(Namespace::$variant => $prefix),* }
            }
            /// Column family name.
            pub fn cf(self) -> &'static str {
                match self { $(Namespace::$variant => $cf),* }
            }
            /// CRDT kind.
            pub fn kind(self) -> ValueKind {
                match self { $(Namespace::$variant => ValueKind::$kind),* }
            }
            /// Replication scope.
            pub fn scope(self) -> Scope {
                match self { $(Namespace::$variant => Scope::$scope),* }
            }
            /// Default retention: entries not written for this long are
            /// compacted away. `None` only for the node's fixed set of
            /// local markers (bounded by construction).
            pub fn retention_ms(self) -> Option<u64> {
                match self { $(Namespace::$variant => $retention),* }
            }
        }
    };
}

namespaces! {
    ApiJobs => ("/gcs/api/jobs/", "api.jobs", Register, Global, Some(DAY)),
    ApiJobsByTenant => ("/gcs/api/jobs_by_tenant/", "api.jobs_by_tenant", Register, TenantGateways, Some(USAGE_RETENTION_MS)),
    ApiJobStates => ("/gcs/api/states/", "api.states", Register, Global, Some(DAY)),
    ApiPayloads => ("/gcs/api/payloads/", "api.payloads", Register, JobParticipants, Some(HOUR)),
    ApiClaims => ("/gcs/api/claims/", "api.claims", Set, Global, Some(DAY)),
    ApiLeases => ("/gcs/api/leases/", "api.leases", Register, Global, Some(DAY)),
    ApiResults => ("/gcs/api/results/", "api.results", Register, JobParticipants, Some(DAY)),
    ApiStreams => ("/gcs/api/streams/", "api.streams", Register, JobParticipants, Some(HOUR)),
    ApiUsage => ("/gcs/api/usage/", "api.usage", Register, TenantGateways, Some(USAGE_RETENTION_MS)),
    ApiCancel => ("/gcs/api/cancel/", "api.cancel", Register, Global, Some(DAY)),
    ApiRequeue => ("/gcs/api/requeue/", "api.requeue", Register, Global, Some(DAY)),
    NodeRegistrations => ("/gcs/nodes/registrations/", "nodes.registrations", Register, Global, Some(10 * 60_000)),
    NodeCapabilities => ("/gcs/nodes/capabilities/", "nodes.capabilities", Set, Global, Some(10 * 60_000)),
    NodeHeartbeat => ("/gcs/nodes/heartbeat/", "nodes.heartbeat", Register, Global, Some(10 * 60_000)),
    TenantMemberships => ("/gcs/tenants/memberships/", "tenants.memberships", Register, Global, Some(31 * DAY)),
    ProcessingTasks => ("/gcs/processing/tasks/", "processing.tasks", Register, Global, Some(DAY)),
    ProcessingSubtasks => ("/gcs/processing/subtasks/", "processing.subtasks", Register, Global, Some(DAY)),
    ProcessingLocks => ("/gcs/processing/locks/", "processing.locks", Register, Global, Some(DAY)),
    ProcessingResults => ("/gcs/processing/results/", "processing.results", Register, Global, Some(DAY)),
    ProcessingReleases => ("/gcs/processing/releases/", "processing.releases", Register, Global, Some(DAY)),
    ProcessingCancels => ("/gcs/processing/cancels/", "processing.cancels", Register, Global, Some(DAY)),
    ProcessingChunks => ("/gcs/processing/chunks/", "processing.chunks", Register, JobParticipants, Some(DAY)),
    ProcessingOutputs => ("/gcs/processing/outputs/", "processing.outputs", Register, JobParticipants, Some(DAY)),
    LocalIdempotency => ("/gcs/local/idempotency/", "local.idempotency", Register, Local, Some(DAY)),
    LocalJobs => ("/gcs/local/jobs/", "local.jobs", Register, Local, Some(DAY)),
    LocalOpenJobs => ("/gcs/local/open_jobs/", "local.open_jobs", Register, Local, Some(DAY)),
    LocalUsageByKey => ("/gcs/local/usage_by_key/", "local.usage_by_key", Register, Local, Some(USAGE_RETENTION_MS)),
    LocalBatchManifests => ("/gcs/local/batch_manifests/", "local.batch_manifests", Register, Local, Some(DAY)),
    Local => ("/gcs/local/", "local", Register, Local, None),
}

/// Longest key accepted.
pub const MAX_KEY_LEN: usize = 512;

/// The keys of the namespaces above, named once: every key a node writes
/// or scans is built here (no `/gcs/` literal elsewhere).
pub mod keys {
    use super::Namespace as N;

    fn key(ns: N, rest: std::fmt::Arguments<'_>) -> String {
        format!("{}{rest}", ns.prefix())
    }

    /// A public job's envelope.
    pub fn job(job_id: &str) -> String {
        key(N::ApiJobs, format_args!("{job_id}"))
    }
    /// The public jobs.
    pub fn jobs() -> &'static str {
        N::ApiJobs.prefix()
    }
    /// A job's entry in its tenant's index.
    pub fn job_of_tenant(tenant: &str, job_id: &str) -> String {
        key(N::ApiJobsByTenant, format_args!("{tenant}/{job_id}"))
    }
    /// A tenant's index of jobs.
    pub fn jobs_of_tenant(tenant: &str) -> String {
        key(N::ApiJobsByTenant, format_args!("{tenant}/"))
    }
    /// A job's request body (job participants).
    pub fn payload(job_id: &str) -> String {
        key(N::ApiPayloads, format_args!("{job_id}"))
    }
    /// The signed claims of a job.
    pub fn claims(job_id: &str) -> String {
        key(N::ApiClaims, format_args!("{job_id}"))
    }
    /// A job's current lease.
    pub fn lease(job_id: &str) -> String {
        key(N::ApiLeases, format_args!("{job_id}"))
    }
    /// A job's signed final result (job participants).
    pub fn result(job_id: &str) -> String {
        key(N::ApiResults, format_args!("{job_id}"))
    }
    /// One chunk of a job's stream, ordered by sequence in scans.
    pub fn stream_chunk(job_id: &str, sequence: u64) -> String {
        key(N::ApiStreams, format_args!("{job_id}/{sequence:08}"))
    }
    /// Every chunk of a job's stream.
    pub fn stream(job_id: &str) -> String {
        key(N::ApiStreams, format_args!("{job_id}/"))
    }
    /// A job's usage record (tenant gateways).
    pub fn usage(job_id: &str) -> String {
        key(N::ApiUsage, format_args!("{job_id}"))
    }
    /// Every usage record.
    pub fn all_usage() -> &'static str {
        N::ApiUsage.prefix()
    }
    /// The `n`th requeue of a job.
    pub fn requeue(job_id: &str, n: u32) -> String {
        key(N::ApiRequeue, format_args!("{job_id}/{n}"))
    }
    /// A processing task's signed queue record (its subtasks inside).
    pub fn processing_task(task_id: &str) -> String {
        key(N::ProcessingTasks, format_args!("{task_id}"))
    }
    /// One lock (its latest renewal) on one subtask (`<task_id>/<subtask_id>`):
    /// each lock under its own key, so replicas keep every contender and the
    /// queue's rules, not the register's last writer, pick the holder.
    pub fn processing_lock(task_key: &str, lock_id: &str) -> String {
        key(N::ProcessingLocks, format_args!("{task_key}/{lock_id}"))
    }
    /// Every lock of a task.
    pub fn processing_locks(task_id: &str) -> String {
        key(N::ProcessingLocks, format_args!("{task_id}/"))
    }
    /// A signed result of one subtask (`<task_id>/<subtask_id>`) by one
    /// node: a contest's loser and winner may both answer, and only the
    /// holder's counts.
    pub fn processing_result(task_key: &str, node_id: &str) -> String {
        key(N::ProcessingResults, format_args!("{task_key}/{node_id}"))
    }
    /// Every result of a task.
    pub fn processing_results(task_id: &str) -> String {
        key(N::ProcessingResults, format_args!("{task_id}/"))
    }
    /// A holder's release (or reported failure) of one lock of a subtask.
    pub fn processing_release(task_key: &str, lock_id: &str) -> String {
        key(N::ProcessingReleases, format_args!("{task_key}/{lock_id}"))
    }
    /// The releases of a task's subtasks.
    pub fn processing_releases(task_id: &str) -> String {
        key(N::ProcessingReleases, format_args!("{task_id}/"))
    }
    /// A task's cancellation by its gateway.
    pub fn processing_cancel(task_id: &str) -> String {
        key(N::ProcessingCancels, format_args!("{task_id}"))
    }
    /// One input chunk of a task (a tenant's private request: the task's
    /// gateway serves it only to a subtask's lock holder).
    pub fn processing_chunk(task_id: &str, chunk_id: &str) -> String {
        key(N::ProcessingChunks, format_args!("{task_id}/{chunk_id}"))
    }
    /// Every input chunk of a task.
    pub fn processing_chunks(task_id: &str) -> String {
        key(N::ProcessingChunks, format_args!("{task_id}/"))
    }
    /// A worker's output for one chunk, under the lock it ran under.
    pub fn processing_output(task_id: &str, chunk_id: &str, lock_id: &str) -> String {
        key(N::ProcessingOutputs, format_args!("{task_id}/{chunk_id}/{lock_id}"))
    }
    /// Every output of one request of a task (one per lock it ran under).
    pub fn processing_outputs_of_chunk(task_id: &str, chunk_id: &str) -> String {
        key(N::ProcessingOutputs, format_args!("{task_id}/{chunk_id}/"))
    }
    /// Every output of a task.
    pub fn processing_outputs(task_id: &str) -> String {
        key(N::ProcessingOutputs, format_args!("{task_id}/"))
    }
    /// A node's latest registration.
    pub fn registration(node_id: &str) -> String {
        key(N::NodeRegistrations, format_args!("{node_id}"))
    }
    /// The latest statement of a tenant's or swarm's key (`issuer`) about
    /// one node in one scope (`tenant_member`, `tenant_gateway`,
    /// `swarm_member`): its membership certificate, or the revocation that
    /// replaced it. Only the issuer may write it.
    pub fn membership(issuer: &str, scope: &str, node_id: &str) -> String {
        key(N::TenantMemberships, format_args!("{issuer}/{scope}/{node_id}"))
    }
    /// A tenant's idempotency key, by its hash (local).
    pub fn idempotency(hash: &str) -> String {
        key(N::LocalIdempotency, format_args!("{hash}"))
    }
    /// A job confined to a tenant or swarm: its envelope stays on its
    /// gateway (local).
    pub fn confined_job(job_id: &str) -> String {
        key(N::LocalJobs, format_args!("{job_id}"))
    }
    /// Every confined job.
    pub fn confined_jobs() -> String {
        N::LocalJobs.prefix().to_string()
    }
    /// A batch's manifest for one of its tasks, signed by the task's
    /// gateway and mirrored to the tenant's other gateways (local: never
    /// gossiped), so one of them can take the batch over.
    pub fn batch_manifest(batch_id: &str, task_id: &str) -> String {
        key(N::LocalBatchManifests, format_args!("{batch_id}/{task_id}"))
    }
    /// Every manifest of a batch.
    pub fn batch_manifests(batch_id: &str) -> String {
        key(N::LocalBatchManifests, format_args!("{batch_id}/"))
    }
    /// A job this gateway submitted and has not yet metered (local): the
    /// index restart recovery reads instead of every job record. Its value
    /// is the job record's key.
    pub fn open_job(job_id: &str) -> String {
        key(N::LocalOpenJobs, format_args!("{job_id}"))
    }
    /// Every open job.
    pub fn open_jobs() -> &'static str {
        N::LocalOpenJobs.prefix()
    }
    /// A usage record's entry in its API key's index (local), ordered by
    /// the record's creation time: `/v1/usage` and budgets read one key's
    /// time range, not every record.
    pub fn usage_of_key(api_key_id: &str, created_at_ms: u64, job_id: &str) -> String {
        key(N::LocalUsageByKey, format_args!("{api_key_id}/{created_at_ms:020}/{job_id}"))
    }
    /// Every index entry of one API key.
    pub fn usage_of_key_prefix(api_key_id: &str) -> String {
        key(N::LocalUsageByKey, format_args!("{api_key_id}/"))
    }
    /// Where one key's entries created at or after `ms` start.
    pub fn usage_of_key_from(api_key_id: &str, ms: u64) -> String {
        key(N::LocalUsageByKey, format_args!("{api_key_id}/{ms:020}"))
    }
    /// The marker saying the per-key usage index covers every stored record
    /// (its value: the index's format version).
    pub fn usage_index_marker() -> String {
        key(N::Local, format_args!("index/usage_by_key"))
    }
}

impl Namespace {
    /// The namespace of a full key, checking the key's shape: printable
    /// ASCII, no empty or dot segments, at most [`MAX_KEY_LEN`] bytes.
    pub fn of_key(key: &str) -> Result<Namespace, KeyspaceError> {
        let bad = |reason| KeyspaceError::BadKey { key: key.chars().take(80).collect(), reason };
        if key.len() > MAX_KEY_LEN {
            return Err(bad("longer than 512 bytes"));
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad("must be printable ASCII without spaces"));
        }
        // The longest prefix wins: `/gcs/local/jobs/` before `/gcs/local/`.
        let ns = Namespace::ALL
            .iter()
            .copied()
            .filter(|ns| key.starts_with(ns.prefix()))
            .max_by_key(|ns| ns.prefix().len())
            .ok_or_else(|| KeyspaceError::UnknownNamespace(key.chars().take(80).collect()))?;
        let rest = &key[ns.prefix().len()..];
        if rest.is_empty() || rest.split('/').any(|s| s.is_empty() || s == "." || s == "..") {
            return Err(bad("empty or dot path segment"));
        }
        Ok(ns)
    }

    /// Parses a column family name.
    pub fn from_cf(cf: &str) -> Option<Namespace> {
        Namespace::ALL.iter().copied().find(|ns| ns.cf() == cf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_built_key_is_valid_in_its_namespace() {
        let cases = [
            (keys::job("j"), Namespace::ApiJobs),
            (keys::membership("i", "tenant_member", "n"), Namespace::TenantMemberships),
            (keys::job_of_tenant("t", "j"), Namespace::ApiJobsByTenant),
            (keys::payload("j"), Namespace::ApiPayloads),
            (keys::claims("j"), Namespace::ApiClaims),
            (keys::lease("j"), Namespace::ApiLeases),
            (keys::result("j"), Namespace::ApiResults),
            (keys::stream_chunk("j", 7), Namespace::ApiStreams),
            (keys::usage("j"), Namespace::ApiUsage),
            (keys::requeue("j", 2), Namespace::ApiRequeue),
            (keys::registration("n"), Namespace::NodeRegistrations),
            (keys::processing_chunk("t", "c"), Namespace::ProcessingChunks),
            (keys::processing_output("t", "c", "l"), Namespace::ProcessingOutputs),
            (keys::processing_release("t/s", "l"), Namespace::ProcessingReleases),
            (keys::processing_cancel("t"), Namespace::ProcessingCancels),
            (keys::idempotency("h"), Namespace::LocalIdempotency),
            (keys::confined_job("j"), Namespace::LocalJobs),
            (keys::open_job("j"), Namespace::LocalOpenJobs),
            (keys::usage_of_key("k", 5, "j"), Namespace::LocalUsageByKey),
            (keys::usage_index_marker(), Namespace::Local),
            (keys::batch_manifest("b", "t"), Namespace::LocalBatchManifests),
        ];
        for (k, ns) in cases {
            assert_eq!(Namespace::of_key(&k).unwrap(), ns, "{k}");
        }
        assert!(keys::stream_chunk("j", 7).starts_with(&keys::stream("j")));
        assert!(
            keys::stream_chunk("j", 10) > keys::stream_chunk("j", 9),
            "scans in sequence order"
        );
        assert!(keys::job_of_tenant("t", "j").starts_with(&keys::jobs_of_tenant("t")));
        assert!(keys::confined_job("j").starts_with(&keys::confined_jobs()));
        assert!(keys::open_job("j").starts_with(keys::open_jobs()));
        assert!(keys::usage_of_key("k", 5, "j").starts_with(&keys::usage_of_key_prefix("k")));
        assert!(keys::usage_of_key("k", 10, "a") > keys::usage_of_key("k", 9, "z"), "time order");
    }

    #[test]
    fn every_shared_namespace_has_a_retention() {
        for ns in Namespace::ALL {
            assert!(ns.retention_ms().is_some() || *ns == Namespace::Local, "{ns:?}");
        }
        assert_eq!(Namespace::Local.retention_ms(), None, "only the fixed local markers are kept");
    }

    #[test]
    fn keys_map_to_their_namespace_and_bad_keys_are_refused() {
        assert_eq!(Namespace::of_key("/gcs/api/jobs/gcsapi_1").unwrap(), Namespace::ApiJobs);
        assert_eq!(
            Namespace::of_key("/gcs/api/jobs_by_tenant/t/j").unwrap(),
            Namespace::ApiJobsByTenant
        );
        assert!(matches!(
            Namespace::of_key("/gcs/other/x"),
            Err(KeyspaceError::UnknownNamespace(_))
        ));
        assert!(Namespace::of_key("/gcs/api/jobs/").is_err());
        assert!(Namespace::of_key("/gcs/api/jobs/a//b").is_err());
        assert!(Namespace::of_key("/gcs/api/jobs/a/../b").is_err());
        assert!(Namespace::of_key("/gcs/api/jobs/a b").is_err());
        assert!(Namespace::of_key(&format!("/gcs/api/jobs/{}", "x".repeat(600))).is_err());
        let cfs: std::collections::HashSet<_> = Namespace::ALL.iter().map(|n| n.cf()).collect();
        assert_eq!(cfs.len(), Namespace::ALL.len());
    }
}
