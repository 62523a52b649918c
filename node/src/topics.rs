//! Gossip topic names (26.9). Per-job channels (26.9.4) are not gossip
//! topics: they travel over direct streams (see specs/network.md).

/// All capability registrations.
pub const CAPABILITIES_ALL: &str = "gcs.capabilities.all";
/// Chat-capable registrations.
pub const CAPABILITIES_CHAT: &str = "gcs.capabilities.chat";
/// Embedding-capable registrations.
pub const CAPABILITIES_EMBEDDING: &str = "gcs.capabilities.embedding";
/// All API jobs.
pub const API_JOBS_ALL: &str = "gcs.api.jobs.all";
/// Chat jobs.
pub const API_JOBS_CHAT: &str = "gcs.api.jobs.chat";
/// Embedding jobs.
pub const API_JOBS_EMBEDDING: &str = "gcs.api.jobs.embedding";
/// Processing jobs (26.9.3).
pub const PROCESSING_JOBS_ALL: &str = "gcs.processing.jobs.all";
/// Keyspace deltas of globally replicated namespaces.
pub const KEYSPACE_DELTAS: &str = "gcs.keyspace.deltas";

/// Private capability channel of a tenant.
pub fn capabilities_private(tenant: &str) -> String {
    format!("gcs.capabilities.private.{tenant}")
}

/// Private job channel of a tenant.
pub fn api_jobs_private(tenant: &str) -> String {
    format!("gcs.api.jobs.private.{tenant}")
}

/// Usage records of one tenant, among the gateways serving it (the
/// tenant-gateway replication scope; carries keyspace deltas).
pub fn tenant_usage(tenant: &str) -> String {
    format!("{TENANT_USAGE_PREFIX}{tenant}")
}

/// Prefix of [`tenant_usage`] topics.
pub const TENANT_USAGE_PREFIX: &str = "gcs.usage.";

/// Whether `id` can name a tenant in a topic and a key (one key segment).
pub fn valid_tenant(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic() && b != b'/')
}

/// Local-swarm job channel.
pub fn api_jobs_local(swarm: &str) -> String {
    format!("gcs.api.jobs.local.{swarm}")
}

/// Whether a message type may travel on a topic: registrations only on
/// capability topics, jobs only on job topics. A valid envelope on the wrong
/// topic is rejected like an invalid one.
pub fn allows(topic: &str, ty: gcs_protocol::MessageType) -> bool {
    use gcs_protocol::MessageType as T;
    match ty {
        T::NodeRegistration => topic.starts_with("gcs.capabilities."),
        T::ApiRequestJob | T::Requeue | T::Cancellation => topic.starts_with("gcs.api.jobs."),
        T::TaskLock | T::TaskResult => topic.starts_with("gcs.processing."),
        _ => false,
    }
}
