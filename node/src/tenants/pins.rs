//! Pinned nodes (issue 14 §2): a tenant that pins nodes names, in every
//! private and hybrid job a gateway publishes for it, exactly the pinned
//! nodes that hold a live admission issued from this data directory
//! (`routing.allowed_nodes`, at most 256). A node with a valid certificate
//! of the tenant that is not pinned then cannot win (claims.rs count 8),
//! and a worker sees in the signed job whether it may claim.
//!
//! Kept in `tenants/pinned.<tenant>`: a version line, then one node id a
//! line (written whole: temp file + rename).

use std::collections::{BTreeMap, BTreeSet};

use gcs_protocol::{MembershipScope, Message, NodeId, NodeRegistration, NodeStatus, Routing};

use super::{Group, TenantError, TenantStore, Trust};

/// The first line of a pins file.
const VERSION_LINE: &str = "gcs-pins 1";
/// The field's bound (protocol `routing.allowed_nodes`).
pub const MAX_PINNED: usize = 256;

fn path(store: &TenantStore, tenant: &str) -> std::path::PathBuf {
    store.dir.join(format!("pinned.{tenant}"))
}

fn io(path: &std::path::Path, e: std::io::Error) -> TenantError {
    TenantError::Io { path: path.display().to_string(), reason: e.to_string() }
}

/// The nodes `tenant` pins (empty: it pins none; lines that are not node
/// ids are skipped).
pub fn read(store: &TenantStore, tenant: &str) -> Result<BTreeSet<NodeId>, TenantError> {
    let p = path(store, tenant);
    let text = match std::fs::read_to_string(&p) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeSet::new()),
        r => r.map_err(|e| io(&p, e))?,
    };
    let mut lines = text.lines();
    if lines.next() != Some(VERSION_LINE) {
        return Err(TenantError::Io {
            path: p.display().to_string(),
            reason: "not a pins file".into(),
        });
    }
    Ok(lines.filter_map(|l| l.trim().parse().ok()).collect())
}

fn write(store: &TenantStore, tenant: &str, nodes: &BTreeSet<NodeId>) -> Result<(), TenantError> {
    let p = path(store, tenant);
    std::fs::create_dir_all(&store.dir).map_err(|e| io(&store.dir, e))?;
    let mut text = format!("{VERSION_LINE}\n");
    for n in nodes {
        text.push_str(n.as_str());
        text.push('\n');
    }
    gcs_gateway::durable::write_atomic(&p, text.as_bytes()).map_err(|e| io(&p, e))
}

/// Pins (or with `on == false` unpins) `node` for `tenant`. At most
/// [`MAX_PINNED`] nodes a tenant.
pub fn set(store: &TenantStore, tenant: &str, node: &NodeId, on: bool) -> Result<(), TenantError> {
    let mut nodes = read(store, tenant)?;
    let changed = if on { nodes.insert(node.clone()) } else { nodes.remove(node) };
    if nodes.len() > MAX_PINNED {
        return Err(TenantError::BadName(format!("{tenant}: at most {MAX_PINNED} pinned nodes")));
    }
    if changed {
        write(store, tenant, &nodes)?;
    }
    Ok(())
}

/// Every tenant with a key here that pins nodes → its pinned nodes whose
/// latest `tenant_member` statement issued here is a certificate live at
/// `now_ms` (sorted, at most [`MAX_PINNED`]).
pub fn pinned(
    store: &TenantStore,
    trust: &Trust,
    now_ms: u64,
) -> Result<BTreeMap<String, Vec<NodeId>>, TenantError> {
    let mut pins = BTreeMap::new();
    let issued = store.issued()?;
    for (tenant, issuer) in &trust.tenants {
        let nodes = read(store, tenant)?;
        if nodes.is_empty() {
            continue;
        }
        pins.insert(tenant.clone(), live(&issued, issuer, tenant, &nodes, now_ms));
    }
    Ok(pins)
}

/// The members of `nodes` admitted to `tenant` by `issuer` at `now_ms`,
/// given every statement issued (in issue order: the last one stands).
fn live(
    issued: &[Message],
    issuer: &NodeId,
    tenant: &str,
    nodes: &BTreeSet<NodeId>,
    now_ms: u64,
) -> Vec<NodeId> {
    let scope = MembershipScope::TenantMember;
    let mut latest: BTreeMap<&NodeId, bool> = BTreeMap::new();
    for m in issued {
        match m {
            Message::MembershipCertificate(c)
                if &c.issuer == issuer && c.group_id == tenant && c.scope == scope =>
            {
                latest.insert(&c.node_id, c.admits(scope, tenant, &c.node_id, now_ms));
            }
            Message::MembershipRevocation(r)
                if &r.issuer == issuer && r.group_id == tenant && r.scope == scope =>
            {
                latest.insert(&r.node_id, false);
            }
            _ => {}
        }
    }
    let mut out: Vec<NodeId> =
        nodes.iter().filter(|n| latest.get(n).copied().unwrap_or(false)).cloned().collect();
    out.truncate(MAX_PINNED);
    out
}

/// Narrows a private or hybrid job of `tenant` to its pinned nodes: its
/// `allowed_nodes` become the pinned ones (those of the request among
/// them, if it named any). Returns false when the tenant pins but no
/// pinned node may take the job now: then no private node can win it.
pub fn restrict(routing: &mut Routing, tenant: &str, trust: &Trust) -> bool {
    use gcs_protocol::RoutingMode as R;
    if !matches!(routing.network, R::Private | R::Hybrid) {
        return true;
    }
    let Some(pins) = trust.pinned.get(tenant) else { return true };
    let mut allowed: Vec<NodeId> = if routing.allowed_nodes.is_empty() {
        pins.clone()
    } else {
        pins.iter().filter(|n| routing.allowed_nodes.contains(n)).cloned().collect()
    };
    allowed.truncate(MAX_PINNED);
    let any = !allowed.is_empty();
    routing.allowed_nodes = allowed;
    any
}

/// Whether `tenant` pins nodes (its private jobs are then checked by
/// [`unservable`]).
pub fn pins(trust: &Trust, tenant: &str) -> bool {
    trust.pinned.contains_key(tenant)
}

/// Why a private job of a tenant that pins nodes ([`pins`]) cannot be won
/// now, after [`restrict`]: no pinned node is admitted, or none of the
/// admitted pinned nodes has a fresh registration serving `model` and
/// taking private jobs. The gateway then answers 503
/// `gnus_no_capable_nodes` at once instead of letting the job wait out its
/// queue timeout. `None`: not private, or a pinned node may win it (hybrid
/// jobs fall back to public nodes, so they are never refused here).
pub fn unservable<'a>(
    routing: &Routing,
    tenant: &str,
    model: &str,
    fresh: impl IntoIterator<Item = &'a NodeRegistration>,
) -> Option<String> {
    if routing.network != gcs_protocol::RoutingMode::Private {
        return None;
    }
    if routing.allowed_nodes.is_empty() {
        return Some(format!(
            "Tenant {tenant} pins its private nodes, and none of them is admitted now ('private' routing)."
        ));
    }
    let online = fresh.into_iter().any(|r| {
        routing.allowed_nodes.contains(&r.node_id)
            && r.status != NodeStatus::Offline
            && r.queue.accepts_private_jobs
            && r.model(model).is_some()
    });
    (!online).then(|| {
        format!(
            "None of tenant {tenant}'s pinned nodes can serve '{model}' right now ('private' routing)."
        )
    })
}

impl TenantStore {
    /// `admit --pin`: the tenant's jobs go to its pinned nodes only.
    pub fn pin(&self, group: &Group, node: &NodeId, on: bool) -> Result<(), TenantError> {
        match group {
            Group::Tenant(t) => set(self, t, node, on),
            other => Err(TenantError::BadName(format!("--pin is for a tenant, not {other}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gcs_protocol::{NodeKey, RoutingMode};

    fn node(seed: u8) -> NodeId {
        NodeKey::from_seed([seed; 32]).node_id()
    }

    #[test]
    fn only_pinned_nodes_with_a_live_admission_are_allowed() {
        let dir = tempfile::tempdir().unwrap();
        let store = TenantStore::new(dir.path());
        let acme = Group::Tenant("acme".into());
        store.create(&acme).unwrap();
        let (a, b, c, d) = (node(1), node(2), node(3), node(4));
        store.admit(&acme, &a, false, 60_000, 1_000).unwrap();
        store.admit(&acme, &b, false, 60_000, 1_000).unwrap();
        store.admit(&acme, &c, false, 10_000, 1_000).unwrap();
        let trust = store.trust_at(2_000).unwrap();
        assert!(trust.pinned.is_empty(), "a tenant that pins nothing is not narrowed");
        for n in [&a, &c, &d] {
            store.pin(&acme, n, true).unwrap();
        }
        let t = store.trust_at(2_000).unwrap();
        assert_eq!(t.pinned["acme"], vec![a.clone(), c.clone()], "b is not pinned, d not admitted");
        let t = store.trust_at(20_000).unwrap();
        assert_eq!(t.pinned["acme"], vec![a.clone()], "c's admission expired");
        store.revoke(&acme, &a, false, 30_000).unwrap();
        let t = store.trust_at(31_000).unwrap();
        assert_eq!(t.pinned["acme"], Vec::<NodeId>::new(), "revoked: the tenant pins no one now");
        store.pin(&acme, &a, false).unwrap();
        assert!(!read(&store, "acme").unwrap().contains(&a));
        assert!(store.pin(&Group::Swarm("lab".into()), &a, true).is_err(), "tenants only");
    }

    #[test]
    fn restrict_fills_allowed_nodes_of_private_and_hybrid_jobs_only() {
        let (a, b) = (node(1), node(2));
        let mut trust = Trust::default();
        trust.pinned.insert("acme".into(), vec![a.clone(), b.clone()]);
        let private = || Routing { network: RoutingMode::Private, ..Routing::public() };
        let mut r = private();
        assert!(restrict(&mut r, "acme", &trust));
        assert_eq!(r.allowed_nodes, vec![a.clone(), b.clone()]);
        let mut r = Routing {
            network: RoutingMode::Hybrid,
            allowed_nodes: vec![b.clone(), node(9)],
            ..Routing::public()
        };
        assert!(restrict(&mut r, "acme", &trust));
        assert_eq!(r.allowed_nodes, vec![b.clone()], "the request's list, within the pins");
        let mut r = Routing { network: RoutingMode::Public, ..Routing::public() };
        assert!(restrict(&mut r, "acme", &trust));
        assert!(r.allowed_nodes.is_empty(), "public jobs are not pinned");
        let mut r = private();
        assert!(restrict(&mut r, "other", &trust), "a tenant without pins");
        assert!(r.allowed_nodes.is_empty());
        trust.pinned.insert("acme".into(), vec![]);
        let mut r = private();
        assert!(!restrict(&mut r, "acme", &trust), "pins, but none admitted now");
        let many: Vec<NodeId> = (0..300u32)
            .map(|i| NodeKey::from_seed(blake3::hash(&i.to_le_bytes()).into()).node_id())
            .collect();
        trust.pinned.insert("acme".into(), many);
        let mut r = private();
        restrict(&mut r, "acme", &trust);
        assert_eq!(r.allowed_nodes.len(), MAX_PINNED, "bounded at the field's cap");
    }

    #[test]
    fn a_private_job_with_no_pinned_node_online_is_unservable() {
        use gcs_protocol::samples::{self, Params};
        let (w, _) = samples::keys();
        let mut reg = samples::registration(&w, &Params::default());
        reg.queue.accepts_private_jobs = true;
        let model = reg.models[0].model_id.clone();
        let mut trust = Trust::default();
        assert!(!pins(&trust, "acme"));
        trust.pinned.insert("acme".into(), vec![]);
        assert!(pins(&trust, "acme"), "pins, even with none admitted");
        let private = |allowed: Vec<NodeId>| Routing {
            network: RoutingMode::Private,
            allowed_nodes: allowed,
            ..Routing::public()
        };
        let regs = [reg.clone()];
        let none = unservable(&private(vec![]), "acme", &model, &regs);
        assert!(none.is_some_and(|m| m.contains("none of them is admitted")));
        let hybrid = Routing { network: RoutingMode::Hybrid, ..Routing::public() };
        assert_eq!(unservable(&hybrid, "acme", &model, &regs), None, "hybrid falls back");
        let pinned = private(vec![w.node_id()]);
        assert_eq!(unservable(&pinned, "acme", &model, &regs), None, "online");
        assert!(unservable(&pinned, "acme", &model, &[]).is_some(), "not registered");
        assert!(unservable(&pinned, "acme", "other-model", &regs).is_some(), "no such model");
        let mut public_only = reg.clone();
        public_only.queue.accepts_private_jobs = false;
        assert!(unservable(&pinned, "acme", &model, &[public_only]).is_some());
        let mut off = reg;
        off.status = NodeStatus::Offline;
        assert!(unservable(&pinned, "acme", &model, &[off]).is_some(), "offline");
        let other = private(vec![node(9)]);
        assert!(unservable(&other, "acme", &model, &regs).is_some(), "another node is pinned");
    }
}
