//! `gcs-node tenants create|admit|revoke|list`: the tenant store of a
//! gateway's data directory, from the command line.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use gcs_protocol::{Message, NodeId};

use super::{Group, TenantError, TenantStore};

/// Which tenant or swarm a command is about.
#[derive(Args, Debug, Clone)]
#[group(required = true, multiple = false)]
pub struct GroupArg {
    /// A tenant id (its private pool and its gateways).
    #[arg(long)]
    pub tenant: Option<String>,
    /// A swarm id (its local-only jobs).
    #[arg(long)]
    pub swarm: Option<String>,
    /// This gateway itself: attach a worker for its `gateway_local` jobs
    /// (signed with this node's own identity key).
    #[arg(long)]
    pub gateway_local: bool,
}

impl GroupArg {
    fn group(&self, store: &TenantStore) -> Result<Group, TenantError> {
        Ok(match (&self.tenant, &self.swarm) {
            (Some(t), _) => Group::Tenant(t.clone()),
            (None, Some(s)) => Group::Swarm(s.clone()),
            // clap's group makes one of the three required.
            (None, None) => store.gateway()?,
        })
    }
}

/// Tenant and swarm membership keys.
#[derive(Subcommand, Debug)]
pub enum TenantsCommand {
    /// Make the tenant's (or swarm's) own ed25519 key in this data directory
    /// (0600, never gossiped) and print its public id.
    Create {
        #[command(flatten)]
        group: GroupArg,
    },
    /// Admit a node: sign an expiring membership certificate naming it and
    /// write it to a file the node is started with (`--membership FILE`).
    Admit {
        #[command(flatten)]
        group: GroupArg,
        /// The node's id (`gnusnode_...`, printed when it starts).
        #[arg(long)]
        node: String,
        /// Admit a gateway of the tenant (it may write the tenant's usage
        /// records), not a private worker.
        #[arg(long)]
        gateway: bool,
        /// Lifetime: `90s`, `30m`, `24h`, `7d` (at most 30 d). A running
        /// gateway holding the key renews it while the node stays admitted.
        #[arg(long, default_value = "24h")]
        ttl: String,
        /// Where to write the certificate (default: `<node>.<scope>.cert`).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Pin the node: the tenant's private and hybrid jobs from this
        /// gateway then name exactly its pinned, admitted nodes in
        /// `allowed_nodes`; other members of the tenant cannot win them.
        #[arg(long, conflicts_with = "gateway")]
        pin: bool,
    },
    /// Unpin a node (`admit --pin`); its admission stays.
    Unpin {
        #[command(flatten)]
        group: GroupArg,
        /// The node's id.
        #[arg(long)]
        node: String,
    },
    /// Revoke a node's certificates at once (a signed revocation, stored
    /// and gossiped by the running gateway of this data directory).
    Revoke {
        #[command(flatten)]
        group: GroupArg,
        /// The node's id.
        #[arg(long)]
        node: String,
        /// Revoke its tenant-gateway certificate instead.
        #[arg(long)]
        gateway: bool,
    },
    /// The keys here and what they issued.
    List,
}

/// Parses `90s`, `30m`, `24h`, `7d` (or plain milliseconds).
pub fn parse_ttl(s: &str) -> Option<u64> {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = n.parse().ok()?;
    let ms = match unit {
        "" | "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    n.checked_mul(ms).filter(|t| *t > 0 && *t <= gcs_protocol::MAX_MEMBERSHIP_TTL_MS)
}

fn node_id(s: &str) -> Result<NodeId, TenantError> {
    s.parse::<NodeId>().map_err(|_| TenantError::BadName(format!("--node {s}")))
}

/// `keys create` for a tenant with no key here makes its membership key
/// too (issue 14 §2): returns the new key's id, or None if it had one.
pub fn ensure_tenant_key(data_dir: &Path, tenant: &str) -> Result<Option<NodeId>, TenantError> {
    match TenantStore::new(data_dir).create(&Group::Tenant(tenant.into())) {
        Ok(id) => Ok(Some(id)),
        Err(TenantError::Exists(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// API key id → tenant, for the keys a gateway holds.
pub fn key_tenants(
    store: &gcs_gateway::KeyStore,
) -> Result<std::collections::BTreeMap<String, String>, gcs_gateway::keys::KeyError> {
    Ok(store.list()?.into_iter().map(|k| (k.id, k.tenant_id)).collect())
}

/// The certificates given with `--membership` (at most
/// `MAX_MEMBERSHIPS`); each must name this node (the identity in
/// `data_dir`, made if missing, as the node would at start).
pub fn load_memberships(
    data_dir: &Path,
    files: &[PathBuf],
) -> Result<Vec<gcs_protocol::MembershipCertificate>, TenantError> {
    if files.is_empty() {
        return Ok(vec![]);
    }
    let bad = |f: &Path, reason: String| TenantError::Io { path: f.display().to_string(), reason };
    if files.len() > gcs_protocol::MAX_MEMBERSHIPS {
        return Err(bad(
            &files[0],
            format!("at most {} --membership files", gcs_protocol::MAX_MEMBERSHIPS),
        ));
    }
    let me = crate::Identity::load_or_create(data_dir)
        .map_err(|e| bad(data_dir, e.to_string()))?
        .node_id();
    files
        .iter()
        .map(|f| {
            let c = super::read_certificate(f)?;
            if c.node_id != me {
                return Err(bad(f, format!("names {}, not this node ({me})", c.node_id)));
            }
            Ok(c)
        })
        .collect()
}

/// What a worker takes part in, from its flags and the certificates it
/// presents: a certificate is enough (a worker admitted to acme need not
/// also say `--private-tenant acme`), a flag without a live certificate
/// wins nothing and is warned about at start.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct WorkerGroups {
    /// The tenant whose private jobs it takes.
    pub private_tenant: Option<String>,
    /// The gateways whose `gateway_local` jobs it takes.
    pub gateway_local: std::collections::BTreeSet<NodeId>,
    /// What to warn the operator of.
    pub warnings: Vec<String>,
}

/// [`WorkerGroups`] of a worker presenting `certs` at `now_ms`.
pub fn worker_groups(
    certs: &[gcs_protocol::MembershipCertificate],
    private_tenant: Option<&str>,
    swarm: &str,
    gateway_local: &[NodeId],
    now_ms: u64,
) -> WorkerGroups {
    use gcs_protocol::MembershipScope as S;
    let mut out = WorkerGroups::default();
    for c in certs.iter().filter(|c| now_ms >= c.expires_at_ms) {
        out.warnings.push(format!(
            "the {} certificate for {} expired at {} ms: ask its issuer to admit this node again",
            c.scope.as_str(),
            c.group_id,
            c.expires_at_ms
        ));
    }
    let live: Vec<_> = certs.iter().filter(|c| now_ms < c.expires_at_ms).collect();
    let groups = |scope: S| {
        let mut g: Vec<&str> =
            live.iter().filter(|c| c.scope == scope).map(|c| c.group_id.as_str()).collect();
        g.dedup();
        g
    };
    let tenants = groups(S::TenantMember);
    out.private_tenant = match private_tenant {
        Some(t) => {
            if !tenants.contains(&t) {
                out.warnings.push(format!(
                    "--private-tenant {t}: no live tenant_member certificate of {t} (--membership); {t}'s gateways will refuse every private and hybrid claim of this node"
                ));
            }
            Some(t.to_string())
        }
        None => tenants.first().map(|t| t.to_string()),
    };
    if let (None, [first, rest @ ..]) = (private_tenant, tenants.as_slice()) {
        if !rest.is_empty() {
            out.warnings.push(format!(
                "certificates of several tenants: this worker takes the private jobs of {first} only (--private-tenant picks another)"
            ));
        }
    }
    if swarm != crate::topics::PUBLIC_SWARM && !groups(S::SwarmMember).contains(&swarm) {
        out.warnings.push(format!(
            "--swarm {swarm}: no live swarm_member certificate of {swarm}; its gateways will refuse every local_only claim of this node"
        ));
    }
    let attached = groups(S::GatewayWorker);
    for g in gateway_local {
        if !attached.contains(&g.as_str()) {
            out.warnings.push(format!(
                "--gateway-local {g}: no live gateway_worker certificate of that gateway; it will refuse every gateway_local claim of this node"
            ));
        }
    }
    out.gateway_local = gateway_local.iter().cloned().collect();
    out.gateway_local.extend(attached.iter().filter_map(|g| g.parse::<NodeId>().ok()));
    out
}

/// Runs one command against the store of `data_dir`; prints to stdout.
pub fn run(data_dir: &Path, cmd: TenantsCommand, now_ms: u64) -> Result<(), TenantError> {
    let store = TenantStore::new(data_dir);
    match cmd {
        TenantsCommand::Create { group } => {
            let g = group.group(&store)?;
            let id = store.create(&g)?;
            println!("{id}");
            eprintln!("created the key of {g}: verifiers trust {id}");
        }
        TenantsCommand::Admit { group, node, gateway, ttl, out, pin } => {
            let g = group.group(&store)?;
            let ttl_ms =
                parse_ttl(&ttl).ok_or_else(|| TenantError::BadName(format!("--ttl {ttl}")))?;
            let (c, bytes) = store.admit(&g, &node_id(&node)?, gateway, ttl_ms, now_ms)?;
            if pin {
                store.pin(&g, &c.node_id, true)?;
                eprintln!("pinned {}: {g}'s private jobs name only its pinned nodes", c.node_id);
            }
            let path = out.unwrap_or_else(|| {
                PathBuf::from(format!("{}.{}.cert", c.node_id, c.scope.as_str()))
            });
            gcs_gateway::durable::write_atomic(&path, &bytes).map_err(|e| TenantError::Io {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
            println!("{}", path.display());
            eprintln!(
                "{} admitted to {g} as {} until {} ms; start it with --membership {}",
                c.node_id,
                c.scope.as_str(),
                c.expires_at_ms,
                path.display()
            );
        }
        TenantsCommand::Unpin { group, node } => {
            let g = group.group(&store)?;
            store.pin(&g, &node_id(&node)?, false)?;
            eprintln!("unpinned {node} ({g})");
        }
        TenantsCommand::Revoke { group, node, gateway } => {
            let g = group.group(&store)?;
            let r = store.revoke(&g, &node_id(&node)?, gateway, now_ms)?;
            eprintln!(
                "revoked {} ({} of {g}); the running gateway gossips it within seconds",
                r.node_id,
                r.scope.as_str()
            );
        }
        TenantsCommand::List => {
            for (g, id) in store.groups()? {
                println!("{g}  key={id}");
            }
            for m in store.issued()? {
                match m {
                    Message::MembershipCertificate(c) => println!(
                        "  {}  {} {}  node={}  expires_at_ms={}",
                        c.certificate_id,
                        c.group_id,
                        c.scope.as_str(),
                        c.node_id,
                        c.expires_at_ms
                    ),
                    Message::MembershipRevocation(r) => println!(
                        "  revoked  {} {}  node={}  at_ms={}",
                        r.group_id,
                        r.scope.as_str(),
                        r.node_id,
                        r.created_at_ms
                    ),
                    _ => {}
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::worker_groups;
    use gcs_protocol::samples::{self, Params};
    use gcs_protocol::{MembershipScope, NodeKey};

    #[test]
    fn keys_create_makes_the_tenant_key_once() {
        let dir = tempfile::tempdir().unwrap();
        let id = super::ensure_tenant_key(dir.path(), "acme").unwrap().expect("made");
        assert_eq!(super::ensure_tenant_key(dir.path(), "acme").unwrap(), None, "kept");
        let store = super::TenantStore::new(dir.path());
        assert_eq!(store.trust().unwrap().tenants.get("acme"), Some(&id));
        assert!(super::ensure_tenant_key(dir.path(), "a/b").is_err(), "not a tenant name");
    }

    #[test]
    fn a_certificate_is_enough_and_a_flag_without_one_is_warned_of() {
        let (w, g) = samples::keys();
        let p = Params::default();
        let now = p.now_ms;
        let acme = {
            let mut c = samples::membership(&samples::tenant_key(), &w, &p);
            c.group_id = "acme".into();
            c
        };
        let attach = {
            let mut c = samples::membership(&g, &w, &p);
            c.scope = MembershipScope::GatewayWorker;
            c.group_id = g.node_id().to_string();
            c
        };
        let got = worker_groups(&[acme.clone(), attach], None, "public", &[], now);
        assert_eq!(got.private_tenant.as_deref(), Some("acme"), "derived from the certificate");
        assert!(got.gateway_local.contains(&g.node_id()), "attached by the certificate");
        assert!(got.warnings.is_empty(), "{:?}", got.warnings);

        let other = NodeKey::from_seed([9; 32]).node_id();
        let got = worker_groups(
            std::slice::from_ref(&acme),
            Some("globex"),
            "lab",
            std::slice::from_ref(&other),
            now,
        );
        assert_eq!(got.private_tenant.as_deref(), Some("globex"), "the flag stands");
        assert_eq!(got.warnings.len(), 3, "{:?}", got.warnings);
        assert!(got.warnings[0].contains("--private-tenant globex"), "{:?}", got.warnings);
        assert!(got.warnings[1].contains("--swarm lab"));
        assert!(got.warnings[2].contains("--gateway-local"));
        assert!(got.gateway_local.contains(&other));

        let got = worker_groups(
            std::slice::from_ref(&acme),
            Some("acme"),
            "public",
            &[],
            acme.expires_at_ms,
        );
        assert!(got.warnings[0].contains("expired"), "{:?}", got.warnings);
        assert!(
            got.warnings[1].contains("--private-tenant acme"),
            "an expired one counts for nothing"
        );
    }
}

#[cfg(test)]
mod ttl_tests {
    use super::parse_ttl;

    #[test]
    fn ttls_parse_and_are_bounded() {
        assert_eq!(parse_ttl("24h"), Some(86_400_000));
        assert_eq!(parse_ttl("90s"), Some(90_000));
        assert_eq!(parse_ttl("7d"), Some(7 * 86_400_000));
        assert_eq!(parse_ttl("31d"), None, "over the 30 d cap");
        assert_eq!(parse_ttl("0s"), None);
        assert_eq!(parse_ttl("1w"), None);
    }
}
