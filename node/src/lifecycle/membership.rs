//! Which membership certificates of a node still stand (sans-IO): the
//! certificates it presents in its registration, against the latest
//! statement each issuer's key wrote into the keyspace about it
//! (`keys::membership`: a renewed certificate, or a revocation). The
//! gateway's shell applies [`current`] to a claimant's registration before
//! the claim is validated (`claims::admitted`), so a revocation stops
//! claims as soon as it is stored here.

use gcs_protocol::{verify, MembershipCertificate, Message, NodeId};

fn same_grant(
    a: &MembershipCertificate,
    issuer: &NodeId,
    scope: gcs_protocol::MembershipScope,
    group: &str,
) -> bool {
    &a.issuer == issuer && a.scope == scope && a.group_id == group
}

/// The certificates of `node` that stand given `stored` (statements whose
/// signature does not verify are ignored): a revocation voids every
/// certificate of its issuer, scope and group issued at or before it; a
/// stored certificate replaces the presented ones it is newer than, and is
/// added when the node presents nothing as new (renewal by the tenant's
/// gateway, picked up before the node's next heartbeat).
pub fn current(
    node: &NodeId,
    presented: &[MembershipCertificate],
    stored: &[Message],
) -> Vec<MembershipCertificate> {
    let mut out: Vec<MembershipCertificate> =
        presented.iter().filter(|c| &c.node_id == node).cloned().collect();
    for s in stored {
        match s {
            Message::MembershipCertificate(c) if &c.node_id == node && verify(c).is_ok() => {
                out.retain(|p| {
                    !same_grant(p, &c.issuer, c.scope, &c.group_id)
                        || p.issued_at_ms >= c.issued_at_ms
                });
                if !out.iter().any(|p| same_grant(p, &c.issuer, c.scope, &c.group_id)) {
                    out.push(c.clone());
                }
            }
            Message::MembershipRevocation(r) if &r.node_id == node && verify(r).is_ok() => {
                out.retain(|p| {
                    !same_grant(p, &r.issuer, r.scope, &r.group_id)
                        || p.issued_at_ms > r.created_at_ms
                });
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gcs_protocol::samples::{self, Params};
    use gcs_protocol::{sign, NodeKey};

    fn setup() -> (NodeKey, NodeKey, MembershipCertificate, Params) {
        let (w, _) = samples::keys();
        let t = samples::tenant_key();
        let p = Params::default();
        let mut c = samples::membership(&t, &w, &p);
        sign(&mut c, &t).unwrap();
        (w, t, c, p)
    }

    #[test]
    fn a_presented_certificate_stands_alone() {
        let (w, _, c, _) = setup();
        assert_eq!(current(&w.node_id(), &[c.clone()], &[]), vec![c]);
    }

    #[test]
    fn a_revocation_voids_it_at_once() {
        let (w, t, c, p) = setup();
        let mut r = samples::revocation(&t, &w, &p);
        sign(&mut r, &t).unwrap();
        assert!(current(&w.node_id(), &[c], &[r.into()]).is_empty());
    }

    #[test]
    fn a_forged_revocation_changes_nothing() {
        let (w, t, c, p) = setup();
        let mut r = samples::revocation(&t, &w, &p);
        let liar = NodeKey::from_seed([66; 32]);
        r.issuer = liar.node_id();
        sign(&mut r, &liar).unwrap();
        let mut tampered = samples::revocation(&t, &w, &p);
        sign(&mut tampered, &t).unwrap();
        tampered.created_at_ms += 1;
        let out = current(&w.node_id(), &[c.clone()], &[r.into(), tampered.into()]);
        assert_eq!(out, vec![c], "another key's revocation, or a tampered one, voids nothing");
    }

    #[test]
    fn a_readmission_after_the_revocation_stands() {
        let (w, t, _, p) = setup();
        let mut r = samples::revocation(&t, &w, &p);
        sign(&mut r, &t).unwrap();
        let mut again = samples::membership(&t, &w, &p);
        again.issued_at_ms = r.created_at_ms + 1;
        again.expires_at_ms = again.issued_at_ms + 60_000;
        sign(&mut again, &t).unwrap();
        assert_eq!(current(&w.node_id(), &[again.clone()], &[r.into()]), vec![again]);
    }

    #[test]
    fn a_newer_stored_certificate_supersedes_the_presented_one() {
        let (w, t, old, p) = setup();
        let mut renewed = samples::membership(&t, &w, &p);
        renewed.issued_at_ms = old.issued_at_ms + 10;
        renewed.expires_at_ms = old.expires_at_ms + 10;
        sign(&mut renewed, &t).unwrap();
        let out = current(&w.node_id(), &[old.clone()], &[renewed.clone().into()]);
        assert_eq!(out, vec![renewed.clone()]);
        // An older stored one does not replace a newer presented one.
        assert_eq!(current(&w.node_id(), &[renewed.clone()], &[old.into()]), vec![renewed]);
    }

    #[test]
    fn statements_about_another_node_are_ignored() {
        let (w, t, c, p) = setup();
        let other = NodeKey::from_seed([5; 32]);
        let mut r = samples::revocation(&t, &other, &p);
        sign(&mut r, &t).unwrap();
        assert_eq!(current(&w.node_id(), &[c.clone()], &[r.into()]), vec![c]);
    }
}
