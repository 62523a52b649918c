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
}

impl GroupArg {
    fn group(&self) -> Group {
        match (&self.tenant, &self.swarm) {
            (Some(t), _) => Group::Tenant(t.clone()),
            (None, Some(s)) => Group::Swarm(s.clone()),
            // clap's group makes one of them required.
            (None, None) => Group::Tenant(String::new()),
        }
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

/// Runs one command against the store of `data_dir`; prints to stdout.
pub fn run(data_dir: &Path, cmd: TenantsCommand, now_ms: u64) -> Result<(), TenantError> {
    let store = TenantStore::new(data_dir);
    match cmd {
        TenantsCommand::Create { group } => {
            let g = group.group();
            let id = store.create(&g)?;
            println!("{id}");
            eprintln!("created the key of {g}: verifiers trust {id}");
        }
        TenantsCommand::Admit { group, node, gateway, ttl, out } => {
            let g = group.group();
            let ttl_ms =
                parse_ttl(&ttl).ok_or_else(|| TenantError::BadName(format!("--ttl {ttl}")))?;
            let (c, bytes) = store.admit(&g, &node_id(&node)?, gateway, ttl_ms, now_ms)?;
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
        TenantsCommand::Revoke { group, node, gateway } => {
            let g = group.group();
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
