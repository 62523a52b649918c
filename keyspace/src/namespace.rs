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

macro_rules! namespaces {
    ($($variant:ident => ($prefix:literal, $cf:literal, $kind:ident, $scope:ident)),* $(,)?) => {
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
        }
    };
}

namespaces! {
    ApiJobs => ("/gcs/api/jobs/", "api.jobs", Register, Global),
    ApiJobsByTenant => ("/gcs/api/jobs_by_tenant/", "api.jobs_by_tenant", Register, TenantGateways),
    ApiJobStates => ("/gcs/api/states/", "api.states", Register, Global),
    ApiPayloads => ("/gcs/api/payloads/", "api.payloads", Register, JobParticipants),
    ApiClaims => ("/gcs/api/claims/", "api.claims", Set, Global),
    ApiLeases => ("/gcs/api/leases/", "api.leases", Register, Global),
    ApiResults => ("/gcs/api/results/", "api.results", Register, JobParticipants),
    ApiStreams => ("/gcs/api/streams/", "api.streams", Register, JobParticipants),
    ApiUsage => ("/gcs/api/usage/", "api.usage", Register, TenantGateways),
    ApiCancel => ("/gcs/api/cancel/", "api.cancel", Register, Global),
    ApiRequeue => ("/gcs/api/requeue/", "api.requeue", Register, Global),
    NodeRegistrations => ("/gcs/nodes/registrations/", "nodes.registrations", Register, Global),
    NodeCapabilities => ("/gcs/nodes/capabilities/", "nodes.capabilities", Set, Global),
    NodeHeartbeat => ("/gcs/nodes/heartbeat/", "nodes.heartbeat", Register, Global),
    ProcessingTasks => ("/gcs/processing/tasks/", "processing.tasks", Register, Global),
    ProcessingSubtasks => ("/gcs/processing/subtasks/", "processing.subtasks", Register, Global),
    ProcessingLocks => ("/gcs/processing/locks/", "processing.locks", Register, Global),
    ProcessingResults => ("/gcs/processing/results/", "processing.results", Register, Global),
    Local => ("/gcs/local/", "local", Register, Local),
}

/// Longest key accepted.
pub const MAX_KEY_LEN: usize = 512;

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
        let ns = Namespace::ALL
            .iter()
            .copied()
            .find(|ns| key.starts_with(ns.prefix()))
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
