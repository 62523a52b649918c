//! Replication rules: scope, authority, usage, anti-entropy answers.

use super::*;
use gcs_protocol::ApiRequestJob;
use gcs_protocol::samples::{self, Params};

#[test]
fn forged_or_out_of_scope_deltas_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ks = Keyspace::open(dir.path(), "a", Default::default()).unwrap();
    let (w, _) = samples::keys();
    let mut reg = samples::registration(&w, &Params::default());
    gcs_protocol::sign(&mut reg, &w).unwrap();
    let good = ks
        .put(
            &format!("/gcs/nodes/registrations/{}", reg.node_id),
            gcs_protocol::encode(&reg).unwrap(),
            1,
        )
        .unwrap();
    validate(&good).unwrap();
    reg.queue.current_api_jobs += 1; // tampered after signing
    let bad =
        ks.put("/gcs/nodes/registrations/x", gcs_protocol::encode(&reg).unwrap(), 2).unwrap();
    assert!(validate(&bad).is_err());
    let private = ks.put("/gcs/api/payloads/j", b"secret prompt".to_vec(), 3).unwrap();
    assert!(validate(&private).is_err(), "payloads never replicate network-wide");
    let garbage = ks.put("/gcs/api/leases/j", b"junk".to_vec(), 4).unwrap();
    assert!(validate(&garbage).is_err());
    assert!(merge_validated(&ks, &[1, 2, 3], 5).is_err());
}

#[test]
fn answer_sends_only_differing_namespaces_and_converges() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = Keyspace::open(da.path(), "a", Default::default()).unwrap();
    let b = Keyspace::open(db.path(), "b", Default::default()).unwrap();
    for i in 0..50u8 {
        a.put(&format!("/gcs/api/states/j{i}"), vec![i], 1000).unwrap();
    }
    a.put("/gcs/local/secret", b"never sent".to_vec(), 1000).unwrap();
    let resp = answer(&a, &digest_request(&b, &[]).unwrap(), &[]).unwrap();
    assert_eq!(resp.deltas.len(), 50);
    for d in &resp.deltas {
        raw_merge(&b, d, 2000);
    }
    assert_eq!(
        a.digest(Namespace::ApiJobStates).unwrap(),
        b.digest(Namespace::ApiJobStates).unwrap()
    );
    assert!(
        answer(&a, &digest_request(&b, &[]).unwrap(), &[]).unwrap().deltas.is_empty(),
        "in sync: nothing to send"
    );
    assert_eq!(b.get("/gcs/local/secret").unwrap(), None);
}

#[test]
fn usage_records_go_only_to_the_tenants_gateways_and_converge() {
    let (w, g) = samples::keys();
    let (da, db, dc) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let a = Keyspace::open(da.path(), "a", Default::default()).unwrap();
    let b = Keyspace::open(db.path(), "b", Default::default()).unwrap();
    let c = Keyspace::open(dc.path(), "c", Default::default()).unwrap();
    let acme = vec!["tenant_123".to_string()];
    let other = vec!["other".to_string()];
    // g is a gateway the tenant admitted (its certificate is stored at
    // every gateway of the tenant).
    let trust = crate::tenants::records::admit_sample_gateway(&[&a, &b, &c], &g);
    let mut sent = vec![];
    for i in 0..5 {
        let mut u = samples::usage(&w, &g, &Params::default());
        u.job_id = format!("gcsapi_{i}");
        u.signature = None;
        gcs_protocol::sign(&mut u, &g).unwrap();
        sent.push(record_usage(&a, &u, 1000 + i).unwrap().encode());
    }
    // Gossip: b serves the tenant and takes every record; c does not.
    for d in &sent {
        merge_scoped(&b, Delta::decode(d).unwrap(), &acme, &trust, 2000).unwrap();
        assert!(merge_scoped(&c, Delta::decode(d).unwrap(), &other, &trust, 2000).is_err());
        assert!(merge_validated(&c, d, 2000).is_err(), "usage is not global");
    }
    assert_eq!(
        tenant_digest(&a, "tenant_123").unwrap(),
        tenant_digest(&b, "tenant_123").unwrap()
    );
    assert_eq!(tenant_digest(&c, "tenant_123").unwrap().1, 0);
    // Anti-entropy: a late gateway of the tenant gets them; one that
    // only claims another tenant gets nothing.
    let resp = answer(&a, &digest_request(&c, &acme).unwrap(), &acme).unwrap();
    assert_eq!(resp.deltas.len(), 5);
    assert!(answer(&a, &digest_request(&c, &other).unwrap(), &acme).unwrap().deltas.is_empty());
    assert!(
        answer(&c, &digest_request(&a, &acme).unwrap(), &other).unwrap().deltas.is_empty(),
        "c does not serve the tenant: it answers nothing of it"
    );
    for d in &resp.deltas {
        merge_scoped(&c, Delta::decode(d).unwrap(), &acme, &trust, 3000).unwrap();
    }
    assert_eq!(
        tenant_digest(&a, "tenant_123").unwrap(),
        tenant_digest(&c, "tenant_123").unwrap()
    );
    assert!(answer(&a, &digest_request(&c, &acme).unwrap(), &acme).unwrap().deltas.is_empty());
    // Forgeries: tampered after signing, or filed under another job.
    let mut u = samples::usage(&w, &g, &Params::default());
    gcs_protocol::sign(&mut u, &g).unwrap();
    u.output_tokens_sent_to_client += 1;
    let tampered =
        c.put(&keys::usage(&u.job_id), gcs_protocol::encode(&u).unwrap(), 4000).unwrap();
    assert!(merge_scoped(&b, tampered, &acme, &trust, 4000).is_err());
    let mut u = samples::usage(&w, &g, &Params::default());
    gcs_protocol::sign(&mut u, &g).unwrap();
    let misfiled =
        c.put(&keys::usage("gcsapi_x"), gcs_protocol::encode(&u).unwrap(), 4001).unwrap();
    assert!(merge_scoped(&b, misfiled, &acme, &trust, 4001).is_err());
}

/// The paging tests fill namespaces peers may not write (unsigned
/// filler): they test the answers' mechanics, so they merge below the
/// authority rules, which have tests of their own.
fn raw_merge(ks: &Keyspace, d: &[u8], now: u64) {
    ks.merge_bytes(d, now).unwrap();
}

fn merge_all(ks: &Keyspace, resp: &DigestResponse) {
    for d in &resp.deltas {
        raw_merge(ks, d, 9000);
    }
}

/// A job of `gw`, stored where this node keeps job records.
fn stored_job(ks: &Keyspace, gw: &gcs_protocol::NodeKey) -> ApiRequestJob {
    let mut job = samples::api_job(gw, &Params::default());
    gcs_protocol::sign(&mut job, gw).unwrap();
    ks.put(&keys::job(&job.job_id), gcs_protocol::encode(&job).unwrap(), 1).unwrap();
    job
}

fn lease(gw: &gcs_protocol::NodeKey, job: &ApiRequestJob, attempt: u32) -> Delta {
    let (worker, _) = samples::keys();
    let mut l = samples::lease(&worker, gw, &Params::default());
    l.job_id = job.job_id.clone();
    l.gateway_node_id = gw.node_id();
    l.attempt = attempt;
    gcs_protocol::sign(&mut l, gw).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let peer = Keyspace::open(dir.path(), "peer", Default::default()).unwrap();
    peer.put(
        &keys::lease(&job.job_id),
        gcs_protocol::encode(&l).unwrap(),
        50 + u64::from(attempt),
    )
    .unwrap()
}

#[test]
fn only_a_jobs_gateway_writes_its_lease_and_only_forward() {
    let dir = tempfile::tempdir().unwrap();
    let ks = Keyspace::open(dir.path(), "me", Default::default()).unwrap();
    let (_, gw) = samples::keys();
    let job = stored_job(&ks, &gw);
    let thief = gcs_protocol::NodeKey::from_seed([66; 32]);
    let forged = lease(&thief, &job, 5);
    assert!(matches!(merge_global(&ks, forged, 100), Err(RefusedDelta::NotTheAuthor(_))));
    let first = lease(&gw, &job, 1);
    assert!(matches!(merge_global(&ks, first.clone(), 100), Ok(MergeOutcome::Changed(_))));
    assert_eq!(merge_global(&ks, first, 200).unwrap(), MergeOutcome::Unchanged, "a replay");
    let older = lease(&gw, &job, 0);
    assert_eq!(merge_global(&ks, older, 300).unwrap(), MergeOutcome::Unchanged, "rolled back");
    let newer = lease(&gw, &job, 2);
    assert!(matches!(merge_global(&ks, newer, 400), Ok(MergeOutcome::Changed(_))));
    let l: gcs_protocol::LeaseGrant = ks.get_cbor(&keys::lease(&job.job_id)).unwrap().unwrap();
    assert_eq!((l.attempt, l.gateway_node_id), (2, gw.node_id()));
}

#[test]
fn a_job_record_keeps_its_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let ks = Keyspace::open(dir.path(), "me", Default::default()).unwrap();
    let (_, gw) = samples::keys();
    let job = stored_job(&ks, &gw);
    let thief = gcs_protocol::NodeKey::from_seed([66; 32]);
    let mut hijack = job.clone();
    hijack.gateway_node_id = thief.node_id();
    hijack.announcement = 9;
    hijack.signature = None;
    gcs_protocol::sign(&mut hijack, &thief).unwrap();
    let peer_dir = tempfile::tempdir().unwrap();
    let peer = Keyspace::open(peer_dir.path(), "peer", Default::default()).unwrap();
    let key = keys::job(&job.job_id);
    let hijack = peer.put(&key, gcs_protocol::encode(&hijack).unwrap(), 10).unwrap();
    assert!(matches!(merge_global(&ks, hijack, 20), Err(RefusedDelta::NotTheAuthor(_))));
}

#[test]
fn peers_never_delete_and_never_write_what_nobody_reads_from_them() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Keyspace::open(dir.path(), "peer", Default::default()).unwrap();
    let filler = peer.put("/gcs/api/states/j", vec![1; 1000], 1).unwrap();
    assert!(matches!(validate(&filler), Err(RefusedDelta::NotFromPeers(_))));
    let hb = peer.put("/gcs/nodes/heartbeat/n", vec![1], 1).unwrap();
    assert!(matches!(validate(&hb), Err(RefusedDelta::NotFromPeers(_))));
    let (w, gw) = samples::keys();
    let mut reg = samples::registration(&w, &Params::default());
    gcs_protocol::sign(&mut reg, &w).unwrap();
    let key = keys::registration(reg.node_id.as_str());
    peer.put(&key, gcs_protocol::encode(&reg).unwrap(), 2).unwrap();
    let tombstone = peer.delete(&key, 3).unwrap();
    assert!(matches!(validate(&tombstone), Err(RefusedDelta::Tombstone)));
    // A lease where a registration belongs.
    let mut l = samples::lease(&w, &gw, &Params::default());
    gcs_protocol::sign(&mut l, &gw).unwrap();
    let wrong = peer.put(&key, gcs_protocol::encode(&l).unwrap(), 4).unwrap();
    assert!(matches!(validate(&wrong), Err(RefusedDelta::WrongType { .. })));
}

#[test]
fn a_claims_set_over_its_cap_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Keyspace::open(dir.path(), "peer", Default::default()).unwrap();
    let (w, _) = samples::keys();
    let mut last = None;
    for i in 0..=MAX_CLAIMS_PER_JOB {
        let mut c = samples::claim(&w, &Params::default());
        c.claim_id = format!("clm_{i}");
        gcs_protocol::sign(&mut c, &w).unwrap();
        let key = keys::claims(&c.job_id);
        let d = peer.set_add(&key, &gcs_protocol::encode(&c).unwrap(), 10 + i as u64).unwrap();
        if i + 1 == MAX_CLAIMS_PER_JOB {
            validate(&d).unwrap();
        }
        last = Some(d);
    }
    assert!(matches!(validate(&last.unwrap()), Err(RefusedDelta::TooMany(_))));
}

#[test]
fn after_first_contact_only_the_log_since_the_cursor_is_sent() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = Keyspace::open(da.path(), "a", Default::default()).unwrap();
    let b = Keyspace::open(db.path(), "b", Default::default()).unwrap();
    for i in 0..40u8 {
        a.put(&format!("/gcs/api/states/j{i}"), vec![i], 1000).unwrap();
    }
    let first = answer(&a, &digest_request(&b, &[]).unwrap(), &[]).unwrap();
    assert_eq!(first.deltas.len(), 40, "first contact: the differing namespace");
    merge_all(&b, &first);
    let cursor = first.last_seq.unwrap();
    for i in 0..3u8 {
        a.put(&format!("/gcs/nodes/heartbeat/n{i}"), vec![i], 2000).unwrap();
    }
    a.put("/gcs/api/payloads/j0", b"private prompt".to_vec(), 2000).unwrap();
    a.put("/gcs/api/states/j0", vec![9], 2000).unwrap();
    let mut req = digest_request(&b, &[]).unwrap();
    req.since = Some(cursor);
    let next = answer(&a, &req, &[]).unwrap();
    assert_eq!(next.deltas.len(), 4, "three heartbeats and one state, no payload");
    assert_eq!(next.last_seq, Some(a.last_seq()));
    merge_all(&b, &next);
    for ns in global_namespaces() {
        assert_eq!(a.digest(ns).unwrap(), b.digest(ns).unwrap(), "{ns:?}");
    }
    // Nothing new: an empty answer, the cursor stays.
    req.since = next.last_seq;
    let idle = answer(&a, &req, &[]).unwrap();
    assert!(idle.deltas.is_empty() && idle.last_seq == next.last_seq);
    // A cursor ahead of the log (the peer lost its store): digests decide.
    req.since = Some(a.last_seq() + 100);
    let b2 = tempfile::tempdir().unwrap();
    let fresh = Keyspace::open(b2.path(), "c", Default::default()).unwrap();
    req.digests = digest_request(&fresh, &[]).unwrap().digests;
    assert_eq!(answer(&a, &req, &[]).unwrap().deltas.len(), 43);
}

#[test]
fn a_namespace_over_the_cap_arrives_in_pages() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = Keyspace::open(da.path(), "a", Default::default()).unwrap();
    let b = Keyspace::open(db.path(), "b", Default::default()).unwrap();
    let n = MAX_ENTRIES_PER_NAMESPACE + 25;
    for i in 0..n {
        a.put(&format!("/gcs/api/states/j{i:06}"), vec![1], 1000).unwrap();
    }
    let first = answer(&a, &digest_request(&b, &[]).unwrap(), &[]).unwrap();
    assert_eq!(first.deltas.len(), MAX_ENTRIES_PER_NAMESPACE);
    assert_eq!(first.resume.len(), 1);
    assert!(first.last_seq.is_some());
    merge_all(&b, &first);
    let mut req = digest_request(&b, &[]).unwrap();
    req.after = first.resume.clone();
    let second = answer(&a, &req, &[]).unwrap();
    assert_eq!(second.deltas.len(), 25, "the rest, not the first page again");
    assert!(second.resume.is_empty() && second.last_seq.is_none());
    merge_all(&b, &second);
    assert_eq!(
        a.digest(Namespace::ApiJobStates).unwrap(),
        b.digest(Namespace::ApiJobStates).unwrap()
    );
}

#[test]
fn an_old_or_misfiled_registration_does_not_replace_the_record() {
    let (w, g) = samples::keys();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = Keyspace::open(da.path(), "a", Default::default()).unwrap();
    let b = Keyspace::open(db.path(), "b", Default::default()).unwrap();
    let reg_at = |t: u64| {
        let mut r = samples::registration(&w, &Params::default());
        r.heartbeat.created_at_ms = t;
        r.heartbeat.expires_at_ms = t + 30_000;
        gcs_protocol::sign(&mut r, &w).unwrap();
        r
    };
    let (old, new) = (reg_at(1_000), reg_at(2_000));
    let key = format!("/gcs/nodes/registrations/{}", new.node_id);
    b.put(&key, gcs_protocol::encode(&new).unwrap(), 3_000).unwrap();
    // A peer writes the old one later (a newer writer clock).
    let replay = a.put(&key, gcs_protocol::encode(&old).unwrap(), 9_000).unwrap();
    assert_eq!(merge_validated(&b, &replay.encode(), 9_000).unwrap(), MergeOutcome::Unchanged);
    let kept: gcs_protocol::NodeRegistration =
        gcs_protocol::codec::from_cbor_bytes(&b.get_bytes(&key).unwrap().unwrap()).unwrap();
    assert_eq!(kept.heartbeat.created_at_ms, 2_000);
    // A newer one does replace it.
    let newer = a.put(&key, gcs_protocol::encode(&reg_at(4_000)).unwrap(), 9_001).unwrap();
    assert!(matches!(
        merge_validated(&b, &newer.encode(), 9_001).unwrap(),
        MergeOutcome::Changed(_)
    ));
    // A valid registration filed under another node's key is refused,
    // and so is a lease under another job's key.
    let (_, other) = samples::keys();
    let misfiled = a
        .put(
            &format!("/gcs/nodes/registrations/{}", other.node_id()),
            gcs_protocol::encode(&new).unwrap(),
            9_002,
        )
        .unwrap();
    assert!(merge_validated(&b, &misfiled.encode(), 9_002).is_err());
    let mut lease = samples::lease(&w, &g, &Params::default());
    gcs_protocol::sign(&mut lease, &g).unwrap();
    let wrong_job = a
        .put("/gcs/api/leases/gcsapi_other", gcs_protocol::encode(&lease).unwrap(), 9_003)
        .unwrap();
    assert!(merge_validated(&b, &wrong_job.encode(), 9_003).is_err());
    let right_job = a
        .put(
            &format!("/gcs/api/leases/{}", lease.job_id),
            gcs_protocol::encode(&lease).unwrap(),
            9_004,
        )
        .unwrap();
    merge_validated(&b, &right_job.encode(), 9_004).unwrap();
}

#[test]
fn answers_stay_under_the_byte_budget_and_page_to_the_end() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = Keyspace::open(da.path(), "a", Default::default()).unwrap();
    let b = Keyspace::open(db.path(), "b", Default::default()).unwrap();
    for i in 0..12u8 {
        a.put(&format!("/gcs/api/states/j{i:02}"), vec![i; 1 << 20], 1000).unwrap();
        a.put(&format!("/gcs/nodes/heartbeat/n{i:02}"), vec![i; 16], 1000).unwrap();
    }
    let mut req = digest_request(&b, &[]).unwrap();
    let (mut pages, mut got) = (0, 0);
    loop {
        let resp = answer(&a, &req, &[]).unwrap();
        let size: usize = resp.deltas.iter().map(Vec::len).sum();
        assert!(size <= RESPONSE_BUDGET + (1 << 20) + 4096, "page of {size} bytes");
        got += resp.deltas.len();
        merge_all(&b, &resp);
        pages += 1;
        if resp.resume.is_empty() {
            break;
        }
        req = digest_request(&b, &[]).unwrap();
        req.after = resp.resume;
        assert!(pages < 10, "no progress");
    }
    assert!(pages >= 3, "12 MiB in pages of 4 MiB: {pages}");
    assert!(got >= 24);
    for ns in [Namespace::ApiJobStates, Namespace::NodeHeartbeat] {
        assert_eq!(a.digest(ns).unwrap(), b.digest(ns).unwrap(), "{ns:?}");
    }
}
