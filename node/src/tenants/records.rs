//! Record authority for what tenants sign (the rows of specs/network.md's
//! record-authority table for `tenants.memberships` and `api.usage`).
//!
//! - A membership record is a certificate or a revocation, signed by the
//!   issuer its key names, about the scope and node its key names: any
//!   node can check that without knowing which tenant the key speaks for,
//!   so no peer can write (or roll back) another key's statements.
//! - A usage record from a peer counts only when its signer holds a live
//!   `tenant_gateway` certificate from the tenant key this node trusts for
//!   the record's tenant, and its API key id is not another tenant's here.

use gcs_keyspace::{keys, Delta, Keyspace};
use gcs_protocol::{verify, Limits, MembershipScope, Message, UsageRecord};

use super::refusals::UsageRefusal;
use super::TenantTrust;
use crate::error::RefusedDelta;

/// Checks a membership delta from a peer on its own; returns its envelope.
pub fn validate_statement(delta: &Delta, limits: &Limits) -> Result<Message, RefusedDelta> {
    let Some(bytes) = delta.value.as_register().and_then(|r| r.value()) else {
        return Err(RefusedDelta::Tombstone);
    };
    let m = gcs_protocol::decode(bytes, limits)?;
    m.verify()?;
    match super::statement_key(&m) {
        Some(k) if k == delta.key => Ok(m),
        Some(_) => Err(RefusedDelta::NotTheAuthor("tenants.memberships")),
        None => Err(RefusedDelta::WrongType {
            expected: gcs_protocol::MessageType::MembershipCertificate,
            found: m.message_type(),
        }),
    }
}

/// Counts and logs a usage delta refused from a peer (`u`: the record, when
/// it decoded); returns the refusal.
pub fn refused(trust: &TenantTrust, e: RefusedDelta, u: Option<&UsageRecord>) -> RefusedDelta {
    let why = UsageRefusal::of(&e);
    let n = trust.count_refused_usage(why);
    let (job, tenant, signer) = match u {
        Some(u) => (u.job_id.as_str(), u.tenant_id.as_str(), u.recorded_by.as_str()),
        None => ("", "", ""),
    };
    // Logged at 1, 2, 4, 8… refusals: visible, but a flood (which peer
    // scoring cuts off anyway) cannot fill the log.
    if n.is_power_of_two() {
        tracing::info!(job_id = job, tenant, signer, reason = why.as_str(), error = %e, refused = n, "usage record refused");
    } else {
        tracing::debug!(job_id = job, tenant, signer, reason = why.as_str(), error = %e, "usage record refused");
    }
    e
}

/// The usage authority rule; `Err` names why the record does not count
/// (the caller counts it: [`refused`]).
pub fn authorise_usage(
    ks: &Keyspace,
    u: &UsageRecord,
    trust: &TenantTrust,
    now_ms: u64,
) -> Result<(), RefusedDelta> {
    let (issuer, owner) = trust.with(|t| {
        (t.tenants.get(&u.tenant_id).cloned(), t.key_tenants.get(&u.api_key_id).cloned())
    });
    let Some(issuer) = issuer else {
        return Err(RefusedDelta::TenantUntrusted(u.tenant_id.clone()));
    };
    if owner.is_some_and(|o| o != u.tenant_id) {
        return Err(RefusedDelta::ForeignKey(u.api_key_id.clone()));
    }
    let scope = MembershipScope::TenantGateway;
    let key = keys::membership(issuer.as_str(), scope.as_str(), u.recorded_by.as_str());
    let stored = ks.get_bytes(&key)?;
    let admitted = stored
        .and_then(|b| gcs_protocol::decode(&b, &Limits::default()).ok())
        .is_some_and(|m| match m {
            Message::MembershipCertificate(c) => {
                c.issuer == issuer
                    && c.admits(scope, &u.tenant_id, &u.recorded_by, now_ms)
                    && verify(&c).is_ok()
            }
            _ => false,
        });
    if !admitted {
        return Err(RefusedDelta::GatewayNotAdmitted(u.recorded_by.to_string()));
    }
    Ok(())
}

/// Test support: `gateway` admitted as a tenant gateway of the sample
/// tenant (`tenant_123`) in each store, and a trust that holds its key.
#[cfg(test)]
pub(crate) fn admit_sample_gateway(
    stores: &[&Keyspace],
    gateway: &gcs_protocol::NodeKey,
) -> super::TrustHandle {
    admit_sample_gateways(stores, &[gateway])
}

/// [`admit_sample_gateway`] for each of `gateways`.
#[cfg(test)]
pub(crate) fn admit_sample_gateways(
    stores: &[&Keyspace],
    gateways: &[&gcs_protocol::NodeKey],
) -> super::TrustHandle {
    use gcs_protocol::samples::{self, Params};
    let t = samples::tenant_key();
    for gateway in gateways {
        let mut c = samples::membership(&t, gateway, &Params::default());
        c.scope = MembershipScope::TenantGateway;
        c.issued_at_ms = 0;
        c.expires_at_ms = gcs_protocol::MAX_MEMBERSHIP_TTL_MS;
        gcs_protocol::sign(&mut c, &t).unwrap();
        let m: Message = c.into();
        // Written once and merged into the others: the same CRDT state
        // everywhere, as replication leaves it.
        let key = super::statement_key(&m).unwrap();
        let delta = stores[0].put(&key, m.encode().unwrap(), 1).unwrap();
        for ks in &stores[1..] {
            ks.merge(delta.clone(), 1).unwrap();
        }
    }
    let mut trust = super::Trust::default();
    trust.tenants.insert("tenant_123".into(), t.node_id());
    super::TenantTrust::new(trust)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replication::{merge_scoped, record_usage};
    use gcs_protocol::samples::{self, Params};
    use gcs_protocol::{sign, NodeKey};

    fn store() -> (tempfile::TempDir, Keyspace) {
        let d = tempfile::tempdir().unwrap();
        let ks = Keyspace::open(d.path(), "n", Default::default()).unwrap();
        (d, ks)
    }

    /// A usage delta signed by `gw`, for `key_id`, as its gateway stores it.
    fn usage_delta(gw: &NodeKey, key_id: &str) -> Delta {
        let (_d, ks) = store();
        let (w, _) = samples::keys();
        let mut u = samples::usage(&w, gw, &Params::default());
        u.api_key_id = key_id.into();
        sign(&mut u, gw).unwrap();
        record_usage(&ks, &u, 1_000).unwrap()
    }

    const NOW: u64 = 10_000;

    #[test]
    fn usage_counts_only_from_an_admitted_gateway_of_the_tenant() {
        let (_, g) = samples::keys();
        let (_d, ks) = store();
        let served = vec!["tenant_123".to_string()];
        let trust = admit_sample_gateway(&[&ks], &g);
        merge_scoped(&ks, usage_delta(&g, "key_789"), &served, &trust, NOW).unwrap();
        assert_eq!(trust.refused_usage(), 0);
        // A fake tenant gateway: a valid signature, but no certificate.
        let fake = NodeKey::from_seed([77; 32]);
        let r = merge_scoped(&ks, usage_delta(&fake, "key_victim"), &served, &trust, NOW);
        assert!(matches!(r, Err(RefusedDelta::GatewayNotAdmitted(_))), "{r:?}");
        assert_eq!(trust.refused_usage(), 1, "counted");
        // A tenant whose key this gateway does not hold: nobody is admitted.
        let untrusted = super::super::TenantTrust::new(Default::default());
        let r = merge_scoped(&ks, usage_delta(&g, "key_789"), &served, &untrusted, NOW);
        assert!(matches!(r, Err(RefusedDelta::TenantUntrusted(_))), "{r:?}");
        // Each refusal is counted under its reason (gcs_usage_refused_total).
        let r = merge_scoped(&ks, usage_delta(&g, "key_789"), &[], &trust, NOW);
        assert!(matches!(r, Err(RefusedDelta::TenantNotServed(_))), "{r:?}");
        let by = |t: &TenantTrust, why| t.usage_refusals().of(why);
        assert_eq!(by(&trust, UsageRefusal::GatewayNotAdmitted), 1);
        assert_eq!(by(&trust, UsageRefusal::TenantNotServed), 1);
        assert_eq!(by(&untrusted, UsageRefusal::TenantUntrusted), 1);
        assert_eq!((trust.refused_usage(), untrusted.refused_usage()), (2, 1));
        let text = trust.usage_refusals().metrics();
        assert!(text.contains("gcs_usage_refused_total{reason=\"gateway_not_admitted\"} 1\n"));
    }

    #[test]
    fn usage_for_another_tenants_key_is_refused() {
        let (_, g) = samples::keys();
        let (_d, ks) = store();
        let trust = admit_sample_gateway(&[&ks], &g);
        let mut t = trust.get();
        t.key_tenants.insert("key_beta".into(), "beta".into());
        trust.set(t);
        let served = vec!["tenant_123".to_string()];
        let r = merge_scoped(&ks, usage_delta(&g, "key_beta"), &served, &trust, NOW);
        assert!(matches!(r, Err(RefusedDelta::ForeignKey(_))), "{r:?}");
        assert_eq!(trust.usage_refusals().of(UsageRefusal::ForeignKey), 1);
    }

    #[test]
    fn a_revoked_or_expired_gateway_writes_no_usage() {
        let (_, g) = samples::keys();
        let (_d, ks) = store();
        let trust = admit_sample_gateway(&[&ks], &g);
        let served = vec!["tenant_123".to_string()];
        let t = samples::tenant_key();
        let mut r = samples::revocation(&t, &g, &Params::default());
        r.scope = MembershipScope::TenantGateway;
        sign(&mut r, &t).unwrap();
        let m: Message = r.into();
        ks.put(&super::super::statement_key(&m).unwrap(), m.encode().unwrap(), 2).unwrap();
        let out = merge_scoped(&ks, usage_delta(&g, "key_789"), &served, &trust, NOW);
        assert!(matches!(out, Err(RefusedDelta::GatewayNotAdmitted(_))), "revoked: {out:?}");
        let (_d2, ks2) = store();
        let trust = admit_sample_gateway(&[&ks2], &g);
        let late = gcs_protocol::MAX_MEMBERSHIP_TTL_MS + 1;
        let out = merge_scoped(&ks2, usage_delta(&g, "key_789"), &served, &trust, late);
        assert!(out.is_err(), "expired: {out:?}");
    }

    /// The statement `m` as a delta from a peer.
    fn statement_delta(m: &Message, key: &str) -> Delta {
        let (_d, ks) = store();
        ks.put(key, m.encode().unwrap(), 5).unwrap()
    }

    #[test]
    fn only_the_issuer_writes_its_statements() {
        let (w, _) = samples::keys();
        let t = samples::tenant_key();
        let p = Params::default();
        let mut c = samples::membership(&t, &w, &p);
        sign(&mut c, &t).unwrap();
        let good: Message = c.clone().into();
        let key = super::super::statement_key(&good).unwrap();
        assert!(validate_statement(&statement_delta(&good, &key), &Limits::default()).is_ok());
        // Filed under another issuer's (or node's) key.
        let liar = NodeKey::from_seed([66; 32]);
        let other_key =
            keys::membership(liar.node_id().as_str(), "tenant_member", w.node_id().as_str());
        assert!(
            validate_statement(&statement_delta(&good, &other_key), &Limits::default()).is_err()
        );
        // A self-signed certificate under the tenant's key.
        let mut forged = c.clone();
        forged.issuer = liar.node_id();
        sign(&mut forged, &liar).unwrap();
        let forged: Message = forged.into();
        assert!(validate_statement(&statement_delta(&forged, &key), &Limits::default()).is_err());
        // Tampered after signing.
        let mut tampered = c;
        tampered.expires_at_ms += 1;
        let tampered: Message = tampered.into();
        assert!(validate_statement(&statement_delta(&tampered, &key), &Limits::default()).is_err());
    }

    #[test]
    fn a_revocation_replaces_the_certificate_and_nothing_rolls_it_back() {
        let (w, _) = samples::keys();
        let t = samples::tenant_key();
        let p = Params::default();
        let mut c = samples::membership(&t, &w, &p);
        sign(&mut c, &t).unwrap();
        let mut r = samples::revocation(&t, &w, &p);
        sign(&mut r, &t).unwrap();
        let (c, r): (Message, Message) = (c.into(), r.into());
        let key = super::super::statement_key(&c).unwrap();
        let (_d, ks) = store();
        let merge = |m: &Message, at: u64| {
            let (_x, peer) = store();
            let d = peer.put(&key, m.encode().unwrap(), at).unwrap();
            crate::replication::merge_scoped(&ks, d, &[], &Default::default(), at)
        };
        merge(&c, 10).unwrap();
        merge(&r, 20).unwrap();
        // The certificate again, under a later HLC: the revocation stays.
        let _ = merge(&c, 30);
        assert_eq!(ks.get_bytes(&key).unwrap().unwrap(), r.encode().unwrap());
    }
}
