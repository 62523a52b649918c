#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;

fn keys() -> (NodeKey, NodeKey, NodeKey) {
    (NodeKey::from_seed([1; 32]), NodeKey::from_seed([2; 32]), NodeKey::from_seed([3; 32]))
}

const BODY: &[u8] = br#"{"messages":[{"role":"user","content":"the secret prompt"}]}"#;

#[test]
fn a_box_opens_for_its_recipient_and_binding() {
    let (gw, worker, _) = keys();
    let (g, w) = (gw.node_id(), worker.node_id());
    let b = SealBinding::lease("gcsapi_1", "lease_1", &g, &w);
    let sealed = seal_to(BODY, &b).unwrap();
    assert_eq!(sealed[0], SEAL_VERSION);
    assert_eq!(sealed.len(), BODY.len() + SEAL_OVERHEAD);
    assert!(!sealed.windows(10).any(|x| x == b"the secret"), "no clear text in the box");
    assert_eq!(open_sealed(&sealed, &worker, &b).unwrap(), BODY);
    // Fresh ephemeral key every time: two seals of one body differ.
    assert_ne!(seal_to(BODY, &b).unwrap(), sealed);
}

#[test]
fn the_derived_public_key_matches_the_secret() {
    let (_, worker, _) = keys();
    let public = x25519_public(&worker.node_id()).unwrap();
    let from_secret = MontgomeryPoint::mul_base_clamped(x25519_secret(&worker)).to_bytes();
    assert_eq!(public, from_secret);
}

#[test]
fn another_key_cannot_open_it() {
    let (gw, worker, other) = keys();
    let (g, w, o) = (gw.node_id(), worker.node_id(), other.node_id());
    let sealed = seal_to(BODY, &SealBinding::lease("j", "l", &g, &w)).unwrap();
    // The other node claims to be the recipient: its key does not fit.
    let forged = SealBinding::lease("j", "l", &g, &o);
    assert_eq!(open_sealed(&sealed, &other, &forged), Err(SealError::Tampered));
    // Or it names the real recipient: refused before any crypto.
    let real = SealBinding::lease("j", "l", &g, &w);
    assert_eq!(open_sealed(&sealed, &other, &real), Err(SealError::NotForMe));
    // The gateway that sealed it cannot open it either (ephemeral-static).
    let as_gw = SealBinding::lease("j", "l", &g, &g);
    assert_eq!(open_sealed(&sealed, &gw, &as_gw), Err(SealError::Tampered));
}

#[test]
fn every_tampered_byte_is_a_typed_error() {
    let (gw, worker, _) = keys();
    let (g, w) = (gw.node_id(), worker.node_id());
    let b = SealBinding::lease("j", "l", &g, &w);
    let sealed = seal_to(BODY, &b).unwrap();
    for i in 1..sealed.len() {
        let mut t = sealed.clone();
        t[i] ^= 0x40;
        let e = open_sealed(&t, &worker, &b).unwrap_err();
        assert!(matches!(e, SealError::Tampered | SealError::DegenerateKey), "byte {i}: {e:?}");
    }
    assert_eq!(
        open_sealed(&sealed[..SEAL_OVERHEAD - 1], &worker, &b),
        Err(SealError::Truncated(48))
    );
    assert_eq!(open_sealed(&[], &worker, &b), Err(SealError::Truncated(0)));
}

#[test]
fn another_job_lease_sender_or_purpose_does_not_open_it() {
    let (gw, worker, other) = keys();
    let (g, w, o) = (gw.node_id(), worker.node_id(), other.node_id());
    let sealed = seal_to(BODY, &SealBinding::lease("job_a", "lease_a", &g, &w)).unwrap();
    for wrong in [
        SealBinding::lease("job_b", "lease_a", &g, &w),
        SealBinding::lease("job_a", "lease_b", &g, &w),
        SealBinding::lease("job_a", "lease_a", &o, &w),
        SealBinding {
            purpose: SealPurpose::AtRest,
            ..SealBinding::lease("job_a", "lease_a", &g, &w)
        },
        // Length prefixes: moving a byte between fields changes the AAD.
        SealBinding::lease("job_al", "ease_a", &g, &w),
    ] {
        assert_eq!(open_sealed(&sealed, &worker, &wrong), Err(SealError::Tampered), "{wrong:?}");
    }
}

#[test]
fn an_unknown_version_is_refused_by_its_byte() {
    let (gw, worker, _) = keys();
    let (g, w) = (gw.node_id(), worker.node_id());
    let b = SealBinding::lease("j", "l", &g, &w);
    let mut sealed = seal_to(BODY, &b).unwrap();
    sealed[0] = 2;
    assert_eq!(open_sealed(&sealed, &worker, &b), Err(SealError::UnsupportedVersion(2)));
}

#[test]
fn a_low_order_ephemeral_key_is_refused() {
    let (gw, worker, _) = keys();
    let (g, w) = (gw.node_id(), worker.node_id());
    let b = SealBinding::lease("j", "l", &g, &w);
    // The all-zero point has order 1: the shared secret is zero.
    let mut sealed = vec![SEAL_VERSION];
    sealed.extend_from_slice(&[0; 32]);
    sealed.extend_from_slice(&[7; 40]);
    assert_eq!(open_sealed(&sealed, &worker, &b), Err(SealError::DegenerateKey));
}

#[test]
fn a_gateway_opens_what_it_sealed_at_rest() {
    let (gw, worker, _) = keys();
    let g = gw.node_id();
    let b = SealBinding::at_rest("j", &g);
    let sealed = seal_to(BODY, &b).unwrap();
    assert_eq!(open_sealed(&sealed, &gw, &b).unwrap(), BODY);
    let w = worker.node_id();
    assert!(open_sealed(&sealed, &worker, &SealBinding::lease("j", "", &g, &w)).is_err());
}
