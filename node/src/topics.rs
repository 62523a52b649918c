//! Gossip topics (26.9): one table of every topic family — its name, what
//! it may carry and who joins it. Validation (`allows`, `carries_deltas`)
//! and peer scoring (`scoring::topic_params`, applied to every topic a node
//! joins, dynamic ones included) read this table. Per-job channels (26.9.4)
//! are not gossip topics: they travel over direct streams (specs/network.md).

use gcs_protocol::MessageType;

/// What a topic carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Carries {
    /// Signed protocol envelopes of these types only.
    Envelopes(&'static [MessageType]),
    /// Keyspace deltas, validated by the replication rules.
    KeyspaceDeltas,
}

/// A family of gossip topics.
#[derive(Clone, Copy, Debug)]
pub struct TopicSpec {
    /// The topic's name or, when `per` is set, the prefix of its names.
    pub name: &'static str,
    /// What the suffix of a per-tenant or per-swarm topic names.
    pub per: Option<&'static str>,
    /// What it may carry.
    pub carries: Carries,
    /// Who joins it (the rule `node::subscriptions` implements).
    pub joined_by: &'static str,
}

const REGISTRATIONS: &[MessageType] = &[MessageType::NodeRegistration];
const JOBS: &[MessageType] =
    &[MessageType::ApiRequestJob, MessageType::Requeue, MessageType::Cancellation];
const PROCESSING: &[MessageType] = &[MessageType::TaskLock, MessageType::TaskResult];

/// Every topic family.
pub const TABLE: &[TopicSpec] = &[
    TopicSpec {
        name: CAPABILITIES_ALL,
        per: None,
        carries: Carries::Envelopes(REGISTRATIONS),
        joined_by: "every node",
    },
    TopicSpec {
        name: CAPABILITIES_CHAT,
        per: None,
        carries: Carries::Envelopes(REGISTRATIONS),
        joined_by: "nobody yet (26.9.1)",
    },
    TopicSpec {
        name: CAPABILITIES_EMBEDDING,
        per: None,
        carries: Carries::Envelopes(REGISTRATIONS),
        joined_by: "nobody yet (26.9.1)",
    },
    TopicSpec {
        name: CAPABILITIES_PRIVATE_PREFIX,
        per: Some("tenant"),
        carries: Carries::Envelopes(REGISTRATIONS),
        joined_by: "nobody yet (26.9.1)",
    },
    TopicSpec {
        name: API_JOBS_ALL,
        per: None,
        carries: Carries::Envelopes(JOBS),
        joined_by: "every node but a private-only worker",
    },
    TopicSpec {
        name: API_JOBS_CHAT,
        per: None,
        carries: Carries::Envelopes(JOBS),
        joined_by: "nobody yet (26.9.2)",
    },
    TopicSpec {
        name: API_JOBS_EMBEDDING,
        per: None,
        carries: Carries::Envelopes(JOBS),
        joined_by: "nobody yet (26.9.2)",
    },
    TopicSpec {
        name: API_JOBS_PRIVATE_PREFIX,
        per: Some("tenant"),
        carries: Carries::Envelopes(JOBS),
        joined_by: "workers with --private-tenant of that tenant",
    },
    TopicSpec {
        name: API_JOBS_LOCAL_PREFIX,
        per: Some("swarm"),
        carries: Carries::Envelopes(JOBS),
        joined_by: "workers with --swarm of that swarm (not public)",
    },
    TopicSpec {
        name: API_JOBS_GATEWAY_PREFIX,
        per: Some("gateway"),
        carries: Carries::Envelopes(JOBS),
        joined_by:
            "workers attached to that gateway (a gateway_worker certificate of its node key)",
    },
    TopicSpec {
        name: PROCESSING_JOBS_ALL,
        per: None,
        carries: Carries::Envelopes(PROCESSING),
        joined_by: "nobody yet (26.22)",
    },
    TopicSpec {
        name: KEYSPACE_DELTAS,
        per: None,
        carries: Carries::KeyspaceDeltas,
        joined_by: "every node",
    },
    TopicSpec {
        name: TENANT_USAGE_PREFIX,
        per: Some("tenant"),
        carries: Carries::KeyspaceDeltas,
        joined_by: "gateways holding a key of that tenant",
    },
];

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
/// Prefix of [`tenant_usage`] topics.
pub const TENANT_USAGE_PREFIX: &str = "gcs.usage.";
const CAPABILITIES_PRIVATE_PREFIX: &str = "gcs.capabilities.private.";
const API_JOBS_PRIVATE_PREFIX: &str = "gcs.api.jobs.private.";
const API_JOBS_LOCAL_PREFIX: &str = "gcs.api.jobs.local.";
const API_JOBS_GATEWAY_PREFIX: &str = "gcs.api.jobs.gateway.";

/// The swarm every node is in unless configured otherwise; `local_only`
/// jobs need another one.
pub const PUBLIC_SWARM: &str = "public";

/// Private capability channel of a tenant.
pub fn capabilities_private(tenant: &str) -> String {
    format!("{CAPABILITIES_PRIVATE_PREFIX}{tenant}")
}

/// Private job channel of a tenant.
pub fn api_jobs_private(tenant: &str) -> String {
    format!("{API_JOBS_PRIVATE_PREFIX}{tenant}")
}

/// Local-swarm job channel.
pub fn api_jobs_local(swarm: &str) -> String {
    format!("{API_JOBS_LOCAL_PREFIX}{swarm}")
}

/// Gateway-local job channel of one gateway (its node id, `gnusnode_…`):
/// only the workers it attached join it (26.11.3 `gateway_local`).
pub fn api_jobs_gateway(gateway: &str) -> String {
    format!("{API_JOBS_GATEWAY_PREFIX}{gateway}")
}

/// Usage records of one tenant, among the gateways serving it (the
/// tenant-gateway replication scope; carries keyspace deltas).
pub fn tenant_usage(tenant: &str) -> String {
    format!("{TENANT_USAGE_PREFIX}{tenant}")
}

/// Whether `id` can name a tenant in a topic and a key (one key segment).
pub fn valid_tenant(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic() && b != b'/')
}

/// The family of `topic`, and the tenant or swarm it names, if any.
pub fn spec(topic: &str) -> Option<(&'static TopicSpec, Option<&str>)> {
    TABLE.iter().find_map(|s| match s.per {
        None => (topic == s.name).then_some((s, None)),
        Some(_) => {
            topic.strip_prefix(s.name).filter(|rest| valid_tenant(rest)).map(|rest| (s, Some(rest)))
        }
    })
}

/// Whether a message type may travel on a topic: registrations only on
/// capability topics, jobs only on job topics. A valid envelope on the wrong
/// topic is rejected like an invalid one.
pub fn allows(topic: &str, ty: MessageType) -> bool {
    matches!(spec(topic), Some((TopicSpec { carries: Carries::Envelopes(tys), .. }, _)) if tys.contains(&ty))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_topic_a_node_builds_is_in_the_table() {
        for t in [
            CAPABILITIES_ALL.to_string(),
            API_JOBS_ALL.to_string(),
            KEYSPACE_DELTAS.to_string(),
            api_jobs_private("acme"),
            api_jobs_local("lab"),
            api_jobs_gateway(&gcs_protocol::NodeKey::from_seed([1; 32]).node_id().to_string()),
            tenant_usage("acme"),
            capabilities_private("acme"),
        ] {
            assert!(spec(&t).is_some(), "{t}");
        }
        assert_eq!(spec(&tenant_usage("acme")).map(|(_, t)| t), Some(Some("acme")));
        assert!(spec("gcs.usage.").is_none(), "a per-tenant topic names a tenant");
        assert!(spec("gcs.api.jobs.unknown").is_none());
    }

    #[test]
    fn message_types_travel_only_on_their_topics() {
        assert!(allows(CAPABILITIES_ALL, MessageType::NodeRegistration));
        assert!(!allows(CAPABILITIES_ALL, MessageType::ApiRequestJob));
        assert!(allows(&api_jobs_private("acme"), MessageType::ApiRequestJob));
        assert!(allows(&api_jobs_local("lab"), MessageType::Cancellation));
        let gw = gcs_protocol::NodeKey::from_seed([1; 32]).node_id().to_string();
        assert!(allows(&api_jobs_gateway(&gw), MessageType::ApiRequestJob));
        assert!(!allows(&api_jobs_gateway(&gw), MessageType::NodeRegistration));
        assert!(!allows(API_JOBS_ALL, MessageType::StreamChunk));
        assert!(!allows(KEYSPACE_DELTAS, MessageType::UsageRecord), "deltas, not envelopes");
        assert!(!allows(&tenant_usage("acme"), MessageType::UsageRecord));
        assert!(allows(PROCESSING_JOBS_ALL, MessageType::TaskLock));
    }
}
