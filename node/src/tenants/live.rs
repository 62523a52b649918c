//! A gateway's tenant store kept live: trust, renewals, and the
//! certificates and revocations it issued, stored and gossiped; a node's own
//! certificates as they stand in the keyspace.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use gcs_protocol::{MembershipCertificate, Message, NodeId};

use super::{statement_key, statement_order, TenantError, TenantStore, TenantTrust, TrustHandle};

/// Keeps a running gateway in step with its tenant store: the trust (keys
/// here, API key ids per tenant from `key_tenants`), every certificate and
/// revocation issued (stored and gossiped), and renewals. Every 2 s.
pub fn follow(
    data_dir: &Path,
    keyspace: Arc<gcs_keyspace::Keyspace>,
    net: crate::Network,
    trust: TrustHandle,
    key_tenants: impl Fn() -> BTreeMap<String, String> + Send + 'static,
) {
    let store = TenantStore::new(data_dir);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(std::time::Duration::from_secs(2));
        loop {
            every.tick().await;
            if let Err(e) = sync(&store, &keyspace, &net, &trust, key_tenants()).await {
                tracing::warn!(error = %e, "tenant store not synced");
            }
        }
    });
}

/// One pass of [`follow`].
pub async fn sync(
    store: &TenantStore,
    keyspace: &gcs_keyspace::Keyspace,
    net: &crate::Network,
    trust: &TenantTrust,
    key_tenants: BTreeMap<String, String>,
) -> Result<(), crate::NodeError> {
    let io = |e: TenantError| crate::NodeError::DataDir {
        path: "tenants".into(),
        reason: e.to_string(),
    };
    let mut t = store.trust_at(gcs_protocol::now_ms()).map_err(io)?;
    t.key_tenants = key_tenants;
    if t != trust.get() {
        tracing::info!(tenants = ?t.tenants.keys().collect::<Vec<_>>(), swarms = ?t.swarms.keys().collect::<Vec<_>>(), "membership keys trusted");
        trust.set(t);
    }
    for c in store.renew_due(gcs_protocol::now_ms()).map_err(io)? {
        tracing::info!(node = %c.node_id, scope = c.scope.as_str(), group = %c.group_id, "membership renewed");
    }
    for m in store.issued().map_err(io)? {
        if publish_statement(keyspace, net, &m).await? {
            tracing::info!(key = ?statement_key(&m), "membership statement published");
        }
    }
    Ok(())
}

/// A node's own certificates that still stand: a renewal the tenant's
/// gateway stored for it replaces the configured one, a revocation drops
/// it (`lifecycle::membership::current`); at most `MAX_MEMBERSHIPS`.
pub fn own_memberships(
    ks: &gcs_keyspace::Keyspace,
    me: &NodeId,
    configured: &[MembershipCertificate],
) -> Vec<MembershipCertificate> {
    let limits = gcs_protocol::Limits::default();
    let stored: Vec<Message> = configured
        .iter()
        .filter_map(|c| {
            let key =
                gcs_keyspace::keys::membership(c.issuer.as_str(), c.scope.as_str(), me.as_str());
            ks.get_bytes(&key).ok().flatten()
        })
        .filter_map(|b| gcs_protocol::decode(&b, &limits).ok())
        .collect();
    let mut out = crate::lifecycle::membership::current(me, configured, &stored);
    out.truncate(gcs_protocol::MAX_MEMBERSHIPS);
    out
}

/// Stores a certificate or revocation under its key (unless this node holds
/// a newer statement there) and gossips the delta to every node.
pub async fn publish_statement(
    ks: &gcs_keyspace::Keyspace,
    net: &crate::Network,
    m: &Message,
) -> Result<bool, crate::NodeError> {
    let Some(key) = statement_key(m) else { return Ok(false) };
    let limits = gcs_protocol::Limits::default();
    if let Some(stored) = ks.get_bytes(&key)? {
        let newer = gcs_protocol::decode(&stored, &limits)
            .is_ok_and(|s| statement_order(&s) >= statement_order(m));
        if newer {
            return Ok(false);
        }
    }
    let delta = ks.put(&key, m.encode()?, gcs_protocol::now_ms())?;
    // No peer yet: anti-entropy carries it later.
    if let Err(e) = net.publish(crate::topics::KEYSPACE_DELTAS, delta.encode()).await {
        tracing::debug!(error = %e, "membership statement not gossiped");
    }
    Ok(true)
}
