//! Tenant and swarm keys, the membership certificates they sign, and what a
//! node trusts (specs/network.md, "Tenant-signed membership").
//!
//! A tenant (or a swarm) has its own ed25519 key, made by
//! `gcs-node tenants create` in the gateway's data directory
//! (`tenants/tenant.<id>.key`, mode 0600, never gossiped). Its public key,
//! written as a node id, is the only issuer the gateway trusts for that
//! tenant: it checks claims of the tenant's private and hybrid jobs (and a
//! swarm's local-only jobs) and usage records from the tenant's other
//! gateways against it. Every certificate and revocation issued is kept in
//! `tenants/issued/`, and a running gateway stores and gossips them
//! (`keys::membership`, writable only by the issuer's key).

pub mod cli;
pub mod pins;
pub mod records;
pub mod refusals;
mod live;

pub use live::{follow, own_memberships, publish_statement, sync};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use gcs_protocol::{
    ids, sign, MembershipCertificate, MembershipRevocation, MembershipScope, Message, MessageType,
    NodeId, NodeKey, PROTOCOL_VERSION,
};

/// Why a tenant operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    /// A file of the tenant store could not be read or written.
    #[error("{path}: {reason}")]
    Io {
        /// File.
        path: String,
        /// Why.
        reason: String,
    },
    /// `create` for a group that already has a key.
    #[error("{0} already has a key (delete it by hand to replace it)")]
    Exists(String),
    /// A group with no key in this data directory.
    #[error("{0} has no key here: run `gcs-node tenants create` first")]
    NoKey(String),
    /// A name that cannot be a tenant or swarm id.
    #[error("{0:?}: use 1-128 printable ASCII characters without '/' or spaces")]
    BadName(String),
    /// A signed record could not be built or read.
    #[error(transparent)]
    Protocol(#[from] gcs_protocol::ProtocolError),
}

/// A tenant or a swarm: what a key speaks for.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Group {
    /// A tenant id.
    Tenant(String),
    /// A swarm id.
    Swarm(String),
    /// This gateway (its node id): the workers it attaches for its
    /// `gateway_local` jobs. Its key is the node's own identity key.
    Gateway(String),
}

impl Group {
    /// Its id.
    pub fn name(&self) -> &str {
        match self {
            Group::Tenant(n) | Group::Swarm(n) | Group::Gateway(n) => n,
        }
    }
    fn file(&self) -> String {
        match self {
            Group::Tenant(n) => format!("tenant.{n}.key"),
            Group::Swarm(n) => format!("swarm.{n}.key"),
            // Not in tenants/: the node identity (see `TenantStore::key`).
            Group::Gateway(_) => "../identity.key".into(),
        }
    }
    /// The group a certificate of `scope` for `group_id` belongs to.
    pub fn of(scope: MembershipScope, group_id: &str) -> Self {
        match scope {
            MembershipScope::SwarmMember => Group::Swarm(group_id.into()),
            MembershipScope::GatewayWorker => Group::Gateway(group_id.into()),
            MembershipScope::TenantMember | MembershipScope::TenantGateway => {
                Group::Tenant(group_id.into())
            }
        }
    }
    /// The scope of a member's certificate (`gateway`: a tenant gateway's).
    pub fn scope(&self, gateway: bool) -> MembershipScope {
        match (self, gateway) {
            (Group::Swarm(_), _) => MembershipScope::SwarmMember,
            (Group::Gateway(_), _) => MembershipScope::GatewayWorker,
            (Group::Tenant(_), true) => MembershipScope::TenantGateway,
            (Group::Tenant(_), false) => MembershipScope::TenantMember,
        }
    }
}

impl std::fmt::Display for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Group::Tenant(n) => write!(f, "tenant {n}"),
            Group::Swarm(n) => write!(f, "swarm {n}"),
            Group::Gateway(n) => write!(f, "gateway {n}"),
        }
    }
}

/// The issuers a node trusts, and the API key ids it knows per tenant.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trust {
    /// Tenant id → the public key (as a node id) of its membership key.
    pub tenants: BTreeMap<String, NodeId>,
    /// Swarm id → its membership key.
    pub swarms: BTreeMap<String, NodeId>,
    /// API key id → its tenant, for the keys this gateway holds: a usage
    /// record filed under another tenant than its key's is refused.
    pub key_tenants: BTreeMap<String, String>,
    /// Tenant → the nodes it pins (`tenants admit --pin`) that hold a live
    /// admission issued here: that tenant's private and hybrid jobs name
    /// exactly these in `routing.allowed_nodes` (an empty list: the tenant
    /// pins, but no pinned node is admitted now, so no node can win).
    pub pinned: BTreeMap<String, Vec<NodeId>>,
}

impl Trust {
    /// The trusted issuer of a group's certificates.
    pub fn issuer(&self, scope: MembershipScope, group: &str) -> Option<&NodeId> {
        if scope.is_swarm() {
            self.swarms.get(group)
        } else {
            self.tenants.get(group)
        }
    }
}

/// The node's trust, shared by the network loop (usage acceptance) and the
/// gateway (claims); the binary refreshes it from the data directory.
#[derive(Debug, Default)]
pub struct TenantTrust {
    trust: RwLock<Trust>,
    refused_usage: refusals::UsageRefusals,
}

/// A shared [`TenantTrust`].
pub type TrustHandle = Arc<TenantTrust>;

impl TenantTrust {
    /// A handle holding `trust`.
    pub fn new(trust: Trust) -> TrustHandle {
        Arc::new(Self { trust: RwLock::new(trust), refused_usage: Default::default() })
    }
    /// A copy of the current trust.
    pub fn get(&self) -> Trust {
        self.trust.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
    /// Replaces it.
    pub fn set(&self, trust: Trust) {
        *self.trust.write().unwrap_or_else(|p| p.into_inner()) = trust;
    }
    /// Reads it under the lock.
    pub fn with<R>(&self, f: impl FnOnce(&Trust) -> R) -> R {
        f(&self.trust.read().unwrap_or_else(|p| p.into_inner()))
    }
    /// Counts a refused usage record; returns the refusals so far.
    pub fn count_refused_usage(&self, why: refusals::UsageRefusal) -> u64 {
        self.refused_usage.count(why)
    }
    /// Usage records refused from peers so far.
    pub fn refused_usage(&self) -> u64 {
        self.refused_usage.total()
    }
    /// Them by reason (`gcs_usage_refused_total`).
    pub fn usage_refusals(&self) -> &refusals::UsageRefusals {
        &self.refused_usage
    }
}

/// The tenant keys and issued records of one data directory.
#[derive(Clone, Debug)]
pub struct TenantStore {
    dir: PathBuf,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TenantError + '_ {
    move |e| TenantError::Io { path: path.display().to_string(), reason: e.to_string() }
}

impl TenantStore {
    /// The store under `data_dir/tenants`.
    pub fn new(data_dir: &Path) -> Self {
        Self { dir: data_dir.join("tenants") }
    }

    fn issued_dir(&self) -> PathBuf {
        self.dir.join("issued")
    }

    /// The data directory this store is in.
    pub fn data_dir(&self) -> &Path {
        self.dir.parent().unwrap_or(&self.dir)
    }

    /// This node as a group: the gateway whose workers its own key attaches.
    pub fn gateway(&self) -> Result<Group, TenantError> {
        let id = crate::Identity::load_or_create(self.data_dir())
            .map_err(|e| TenantError::Io { path: "identity.key".into(), reason: e.to_string() })?
            .node_id();
        Ok(Group::Gateway(id.to_string()))
    }

    /// Makes a new key for `group`; refuses to replace one. Returns its id.
    pub fn create(&self, group: &Group) -> Result<NodeId, TenantError> {
        if matches!(group, Group::Gateway(_)) {
            // Its key is the node identity, made at first start.
            return Err(TenantError::Exists(group.to_string()));
        }
        if !crate::topics::valid_tenant(group.name()) {
            return Err(TenantError::BadName(group.name().into()));
        }
        std::fs::create_dir_all(&self.dir).map_err(io(&self.dir))?;
        let seed = NodeKey::generate()?.seed();
        let path = self.dir.join(group.file());
        // 0600, whole or absent, never over an existing key.
        match gcs_gateway::durable::create_atomic(&path, hex::encode(seed).as_bytes()) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Err(TenantError::Exists(group.to_string()))
            }
            r => r.map_err(io(&path)),
        }?;
        Ok(NodeKey::from_seed(seed).node_id())
    }

    /// The key of `group`.
    pub fn key(&self, group: &Group) -> Result<NodeKey, TenantError> {
        if let Group::Gateway(id) = group {
            let me = crate::Identity::load_or_create(self.data_dir()).map_err(|e| {
                TenantError::Io { path: "identity.key".into(), reason: e.to_string() }
            })?;
            // Only this node's own key attaches workers to it.
            return match me.node_id().as_str() == id.as_str() {
                true => Ok(NodeKey::from_seed(me.key.seed())),
                false => Err(TenantError::NoKey(group.to_string())),
            };
        }
        let path = self.dir.join(group.file());
        let text = match std::fs::read_to_string(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(TenantError::NoKey(group.to_string()))
            }
            r => r.map_err(io(&path))?,
        };
        let bad = || TenantError::Io {
            path: path.display().to_string(),
            reason: "not a hex ed25519 seed".into(),
        };
        let seed: [u8; 32] =
            hex::decode(text.trim()).map_err(|_| bad())?.try_into().map_err(|_| bad())?;
        Ok(NodeKey::from_seed(seed))
    }

    /// Every group with a key here, with its public id.
    pub fn groups(&self) -> Result<Vec<(Group, NodeId)>, TenantError> {
        let mut out = vec![];
        let entries = match std::fs::read_dir(&self.dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            r => r.map_err(io(&self.dir))?,
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(stem) = name.strip_suffix(".key") else { continue };
            let group = match stem.split_once('.') {
                Some(("tenant", n)) => Group::Tenant(n.into()),
                Some(("swarm", n)) => Group::Swarm(n.into()),
                _ => continue,
            };
            let id = self.key(&group)?.node_id();
            out.push((group, id));
        }
        out.sort();
        Ok(out)
    }

    /// What a gateway with this store trusts now (no API keys yet).
    pub fn trust(&self) -> Result<Trust, TenantError> {
        self.trust_at(gcs_protocol::now_ms())
    }

    /// What a gateway with this store trusts at `now_ms`: its keys and its
    /// tenants' pinned nodes (`pins`).
    pub fn trust_at(&self, now_ms: u64) -> Result<Trust, TenantError> {
        let mut t = Trust::default();
        for (g, id) in self.groups()? {
            match g {
                Group::Tenant(n) => t.tenants.insert(n, id),
                Group::Swarm(n) => t.swarms.insert(n, id),
                Group::Gateway(_) => None,
            };
        }
        t.pinned = pins::pinned(self, &t, now_ms)?;
        Ok(t)
    }

    fn keep(&self, name: &str, bytes: &[u8]) -> Result<PathBuf, TenantError> {
        let dir = self.issued_dir();
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let path = dir.join(name);
        gcs_gateway::durable::write_atomic(&path, bytes).map_err(io(&path))?;
        Ok(path)
    }

    /// Issues a certificate admitting `node` to `group` for `ttl_ms`, keeps
    /// it in `issued/`, and returns it with its canonical bytes (what the
    /// node is given: `--membership FILE`).
    pub fn admit(
        &self,
        group: &Group,
        node: &NodeId,
        gateway: bool,
        ttl_ms: u64,
        now_ms: u64,
    ) -> Result<(MembershipCertificate, Vec<u8>), TenantError> {
        let key = self.key(group)?;
        let mut c = MembershipCertificate {
            message_type: MessageType::MembershipCertificate,
            version: PROTOCOL_VERSION,
            certificate_id: ids::new_id(ids::MEMBERSHIP, now_ms)?,
            scope: group.scope(gateway),
            group_id: group.name().into(),
            node_id: node.clone(),
            issuer: key.node_id(),
            issued_at_ms: now_ms,
            expires_at_ms: now_ms.saturating_add(ttl_ms),
            signature: None,
        };
        sign(&mut c, &key)?;
        let bytes = gcs_protocol::encode(&c)?;
        self.keep(&format!("{}.cbor", c.certificate_id), &bytes)?;
        Ok((c, bytes))
    }

    /// Revokes every certificate of `group` for `node` in that scope issued
    /// until now; keeps the signed revocation in `issued/`.
    pub fn revoke(
        &self,
        group: &Group,
        node: &NodeId,
        gateway: bool,
        now_ms: u64,
    ) -> Result<MembershipRevocation, TenantError> {
        let key = self.key(group)?;
        let scope = group.scope(gateway);
        let latest = self
            .issued()?
            .into_iter()
            .filter_map(|m| match m {
                Message::MembershipCertificate(c)
                    if &c.node_id == node && c.scope == scope && c.issuer == key.node_id() =>
                {
                    Some(c)
                }
                _ => None,
            })
            .max_by_key(|c| c.issued_at_ms);
        let certificate_id = match latest {
            Some(c) => c.certificate_id,
            // Not issued from this directory (a copy of the key elsewhere):
            // the revocation still voids every earlier certificate.
            None => ids::new_id(ids::MEMBERSHIP, now_ms)?,
        };
        let mut r = MembershipRevocation {
            message_type: MessageType::MembershipRevocation,
            version: PROTOCOL_VERSION,
            certificate_id,
            scope,
            group_id: group.name().into(),
            node_id: node.clone(),
            issuer: key.node_id(),
            created_at_ms: now_ms,
            signature: None,
        };
        sign(&mut r, &key)?;
        let name = format!("revoked.{}.{}.cbor", r.certificate_id, now_ms);
        self.keep(&name, &gcs_protocol::encode(&r)?)?;
        Ok(r)
    }

    /// Every certificate and revocation issued from this directory (files
    /// that do not decode are skipped with a warning).
    pub fn issued(&self) -> Result<Vec<Message>, TenantError> {
        let dir = self.issued_dir();
        let entries = match std::fs::read_dir(&dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            r => r.map_err(io(&dir))?,
        };
        let mut out = vec![];
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "cbor") {
                continue;
            }
            let bytes = std::fs::read(&path).map_err(io(&path))?;
            match gcs_protocol::decode(&bytes, &gcs_protocol::Limits::default()) {
                Ok(m @ (Message::MembershipCertificate(_) | Message::MembershipRevocation(_))) => {
                    out.push(m)
                }
                _ => tracing::warn!(path = %path.display(), "not a membership record; skipped"),
            }
        }
        out.sort_by_key(statement_order);
        Ok(out)
    }
}

impl TenantStore {
    /// Renews every certificate issued here whose node is still admitted
    /// (no later revocation) once three quarters of its lifetime have
    /// passed, with the same lifetime. Returns the new certificates (kept in
    /// `issued/`; a running gateway stores and gossips them and the node
    /// picks its renewal up from the keyspace).
    pub fn renew_due(&self, now_ms: u64) -> Result<Vec<MembershipCertificate>, TenantError> {
        let mut latest: BTreeMap<String, Message> = BTreeMap::new();
        for m in self.issued()? {
            if let Some(k) = statement_key(&m) {
                latest.insert(k, m); // issue order: the last one stands
            }
        }
        let mut out = vec![];
        for m in latest.into_values() {
            let Message::MembershipCertificate(c) = m else { continue };
            let life = c.expires_at_ms.saturating_sub(c.issued_at_ms);
            if now_ms >= c.expires_at_ms || now_ms < c.issued_at_ms + life / 4 * 3 {
                continue; // expired (re-admit by hand) or not due
            }
            let group = Group::of(c.scope, &c.group_id);
            match self.key(&group) {
                Ok(k) if k.node_id() == c.issuer => {}
                _ => continue, // another key's certificate
            }
            let gateway = c.scope == MembershipScope::TenantGateway;
            out.push(self.admit(&group, &c.node_id, gateway, life, now_ms)?.0);
        }
        Ok(out)
    }
}

/// Issue order of a statement: a revocation after a certificate of the same
/// millisecond.
pub fn statement_order(m: &Message) -> (u64, u8) {
    match m {
        Message::MembershipCertificate(c) => (c.issued_at_ms, 0),
        Message::MembershipRevocation(r) => (r.created_at_ms, 1),
        _ => (0, 0),
    }
}

/// The keyspace key of a statement, and its (issuer, node).
pub fn statement_key(m: &Message) -> Option<String> {
    let (issuer, scope, node) = match m {
        Message::MembershipCertificate(c) => (&c.issuer, c.scope, &c.node_id),
        Message::MembershipRevocation(r) => (&r.issuer, r.scope, &r.node_id),
        _ => return None,
    };
    Some(gcs_keyspace::keys::membership(issuer.as_str(), scope.as_str(), node.as_str()))
}

/// Reads a certificate file given to a node (`--membership`).
pub fn read_certificate(path: &Path) -> Result<MembershipCertificate, TenantError> {
    let bytes = std::fs::read(path).map_err(io(path))?;
    let limits = gcs_protocol::Limits::default();
    match gcs_protocol::open_as::<MembershipCertificate>(&bytes, gcs_protocol::now_ms(), &limits) {
        // This node's clock is behind the issuer's: the certificate is still
        // presented (every verifier judges it by its own clock), so a skewed
        // clock must not keep the node from starting.
        Err(gcs_protocol::ProtocolError::FromFuture { created_at_ms, now_ms, .. }) => {
            tracing::warn!(
                path = %path.display(),
                ahead_ms = created_at_ms.saturating_sub(now_ms),
                "membership certificate is dated ahead of this node's clock"
            );
            Ok(gcs_protocol::open_as(&bytes, created_at_ms, &limits)?)
        }
        r => Ok(r?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_admit_revoke_and_trust() {
        let dir = tempfile::tempdir().unwrap();
        let store = TenantStore::new(dir.path());
        let acme = Group::Tenant("acme".into());
        let id = store.create(&acme).unwrap();
        assert!(matches!(store.create(&acme), Err(TenantError::Exists(_))), "never replaced");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("tenants/tenant.acme.key"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert_eq!(store.trust().unwrap().tenants.get("acme"), Some(&id));
        let node = NodeKey::from_seed([3; 32]).node_id();
        let (c, bytes) = store.admit(&acme, &node, false, 60_000, 1_000).unwrap();
        assert_eq!((c.issuer.clone(), c.scope), (id.clone(), MembershipScope::TenantMember));
        gcs_protocol::verify(&c).unwrap();
        let back: MembershipCertificate =
            gcs_protocol::open_as(&bytes, 2_000, &gcs_protocol::Limits::default()).unwrap();
        assert_eq!(back, c);
        let r = store.revoke(&acme, &node, false, 5_000).unwrap();
        assert_eq!(r.certificate_id, c.certificate_id);
        let issued = store.issued().unwrap();
        assert_eq!(issued.len(), 2);
        assert!(matches!(issued[1], Message::MembershipRevocation(_)), "in issue order");
        assert!(matches!(
            store.admit(&Group::Swarm("lab".into()), &node, false, 1, 1),
            Err(TenantError::NoKey(_))
        ));
        assert!(matches!(store.create(&Group::Tenant("a/b".into())), Err(TenantError::BadName(_))));
    }

    #[test]
    fn certificates_renew_at_three_quarters_of_their_life_until_revoked() {
        let dir = tempfile::tempdir().unwrap();
        let store = TenantStore::new(dir.path());
        let acme = Group::Tenant("acme".into());
        store.create(&acme).unwrap();
        let (a, b) = (NodeKey::from_seed([3; 32]).node_id(), NodeKey::from_seed([4; 32]).node_id());
        store.admit(&acme, &a, false, 40_000, 1_000).unwrap();
        store.admit(&acme, &b, true, 40_000, 1_000).unwrap();
        assert!(store.renew_due(20_000).unwrap().is_empty(), "not due before 3/4");
        store.revoke(&acme, &b, true, 25_000).unwrap();
        let renewed = store.renew_due(31_000).unwrap();
        assert_eq!(renewed.len(), 1, "the revoked gateway is not renewed");
        assert_eq!((&renewed[0].node_id, renewed[0].expires_at_ms), (&a, 71_000));
        assert!(store.renew_due(32_000).unwrap().is_empty(), "the renewal is the latest now");
        assert!(
            store.renew_due(80_000).unwrap().is_empty(),
            "an expired one is re-admitted by hand"
        );
    }
}
