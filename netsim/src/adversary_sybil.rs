//! The one way the adversaries re-sign an honest worker's registration as
//! another identity (a sybil, the adversary itself, a forger): shared by
//! `adversary`, `adversary_trust` and `adversary_flood`.

use gcs_protocol::{ids, sign, Heartbeat, NodeKey, NodeRegistration, NodeStatus};

/// Registration lifetime the adversaries claim (the honest default).
pub const TTL_MS: u64 = 30_000;

/// `template` as `key`'s own registration: a new registration id, online
/// and idle, heartbeat created at `created_ms`, no addresses and no
/// certificates (the template's name the honest node: a registration
/// carrying them is refused outright, so the copy would never register),
/// changed by `edit`, then signed by `key`. `None` only if signing fails.
pub fn resign(
    template: &NodeRegistration,
    key: &NodeKey,
    created_ms: u64,
    edit: impl FnOnce(&mut NodeRegistration),
) -> Option<NodeRegistration> {
    let mut r = template.clone();
    r.registration_id = ids::new_id(ids::REGISTRATION, created_ms).ok()?;
    r.node_id = key.node_id();
    r.public_key = key.public_key();
    r.status = NodeStatus::Online;
    r.queue.current_api_jobs = 0;
    r.heartbeat = Heartbeat {
        created_at_ms: created_ms,
        expires_at_ms: created_ms.saturating_add(TTL_MS),
        ttl_ms: TTL_MS,
    };
    r.addresses.clear();
    r.memberships.clear();
    edit(&mut r);
    r.signature = None;
    sign(&mut r, key).ok()?;
    Some(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gcs_protocol::samples::{self, Params};

    #[test]
    fn the_copy_is_the_sybils_own_validly_signed_registration() {
        let (honest, _) = samples::keys();
        let sybil = NodeKey::from_seed([42; 32]);
        let mut t = samples::registration(&honest, &Params::default());
        t.queue.current_api_jobs = 3;
        t.memberships = vec![samples::membership(&samples::tenant_key(), &honest, &Params::default())];
        let at = Params::default().now_ms + 5_000;
        let r = resign(&t, &sybil, at, |r| r.models.clear()).unwrap();
        gcs_protocol::verify(&r).unwrap();
        assert_eq!((r.node_id.clone(), r.heartbeat.created_at_ms), (sybil.node_id(), at));
        assert_ne!(r.registration_id, t.registration_id);
        assert!(r.memberships.is_empty() && r.addresses.is_empty() && r.models.is_empty());
        assert_eq!(r.queue.current_api_jobs, 0);
    }
}
