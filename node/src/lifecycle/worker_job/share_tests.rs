//! What one gateway may take of a worker: its share of the slots and of
//! the backlog, the `--gateways` allow-list, and the claim answer timeout.

use std::collections::BTreeSet;

use super::*;
use gcs_protocol::samples::{self, Params};

const T0: u64 = 1_783_468_800_000;

fn gw(seed: u8) -> NodeKey {
    NodeKey::from_seed([seed; 32])
}

fn job_of(g: &NodeKey, id: &str) -> ApiRequestJob {
    let mut j = samples::api_job(g, &Params { now_ms: T0, ..Params::default() });
    j.job_id = id.into();
    j.expires_at_ms = T0 + 600_000;
    j
}

fn started(o: &Offer) -> bool {
    matches!(o, Offer::Start(_))
}

/// One job of `g` runs and completes here: `g` is proven.
fn prove(s: &mut Slots, g: &NodeKey) {
    let id = format!("proof-{}", g.node_id());
    assert!(started(&s.offer(job_of(g, &id), T0)));
    s.completed(&id);
    assert_eq!(s.finished(&id, T0), None);
    assert!(s.proven(&g.node_id()));
}

#[test]
fn a_lone_gateway_may_use_every_slot() {
    let a = gw(1);
    let mut s = Slots::with_backlog(4, 8);
    for i in 0..4 {
        assert!(started(&s.offer(job_of(&a, &format!("a{i}")), T0)), "slot {i}");
    }
    assert_eq!(s.offer(job_of(&a, "a4"), T0), Offer::Backlogged);
    assert_eq!(s.peak_shared(), 0, "nobody else was active");
}

#[test]
fn with_two_gateways_a_flooder_holds_at_most_its_share_of_slots() {
    let (honest, fake) = (gw(1), gw(2));
    let mut s = Slots::with_backlog(4, 8);
    prove(&mut s, &honest);
    assert!(started(&s.offer(job_of(&honest, "h0"), T0)));
    for i in 0..10 {
        s.offer(job_of(&fake, &format!("f{i}")), T0 + 1);
    }
    assert_eq!(s.running(), 3, "the fake gateway got 2 of 4 slots (50 %), then waits");
    assert!(started(&s.offer(job_of(&honest, "h1"), T0 + 2)), "a free slot stays for the other");
    assert_eq!(s.running(), 4);
    assert_eq!(s.peak_shared(), 2);
    // A fake job ends: the next one is the fake's only while under its
    // share; the honest gateway's waiting job goes first when it is not.
    assert_eq!(s.offer(job_of(&honest, "h2"), T0 + 3), Offer::Backlogged);
    let next = s.finished("h0", T0 + 4).map(|j| j.job_id);
    assert_eq!(next.as_deref(), Some("h2"), "the fake holds its share: its backlog waits");
}

#[test]
fn a_flooder_evicts_only_its_own_backlog_entries() {
    let (honest, fake) = (gw(1), gw(2));
    let mut s = Slots::with_backlog(1, 8);
    prove(&mut s, &honest);
    assert!(started(&s.offer(job_of(&honest, "h0"), T0)));
    for i in 0..3 {
        assert_eq!(s.offer(job_of(&honest, &format!("h{}", i + 1)), T0), Offer::Backlogged);
    }
    for i in 0..100 {
        s.offer(job_of(&fake, &format!("f{i:03}")), T0 + 1);
    }
    assert_eq!(s.backlog_len(), 7, "3 honest + the fake's 4 (half of 8)");
    let mut out = vec![];
    let mut running = "h0".to_string();
    while let Some(j) = s.finished(&running, T0 + 2) {
        running = j.job_id.clone();
        out.push(j.job_id.clone());
        assert!(started(&s.offer(j, T0 + 2)));
    }
    // Every honest job is still there, and the gateways take turns (the
    // fake kept only its newest four).
    assert_eq!(out, ["f096", "h1", "f097", "h2", "f098", "h3", "f099"]);
}

#[test]
fn a_gateway_that_went_quiet_no_longer_narrows_the_share() {
    let (a, b) = (gw(1), gw(2));
    let mut s = Slots::with_backlog(4, 8);
    prove(&mut s, &a);
    assert!(started(&s.offer(job_of(&b, "b0"), T0)));
    assert!(started(&s.offer(job_of(&a, "a0"), T0)));
    assert!(started(&s.offer(job_of(&a, "a1"), T0)));
    assert_eq!(s.offer(job_of(&a, "a2"), T0), Offer::Backlogged, "b is active: half each");
    let later = T0 + slots::GATEWAY_SEEN_MS + 1;
    assert!(started(&s.offer(job_of(&a, "a3"), later)), "b has been quiet for a minute");
}

#[test]
fn the_share_is_configurable() {
    let (a, b) = (gw(1), gw(2));
    let mut s = Slots::with_backlog(10, 8).with_share(Share { percent: 20 });
    prove(&mut s, &a);
    s.offer(job_of(&b, "b0"), T0);
    let n = (0..10).filter(|i| started(&s.offer(job_of(&a, &format!("a{i}")), T0))).count();
    assert_eq!(n, 2, "20 % of 10 slots");
}

/// 200 fake gateway ids, one job each, against a worker of 8 slots that a
/// proven gateway uses: the fakes together hold the unproven pool (4 of 8,
/// not 4 each) and half the backlog; the proven gateway keeps its share.
/// A fake id that does complete work is proven like any gateway.
#[test]
fn unproven_gateways_share_one_pool_whatever_their_number() {
    let honest = gw(1);
    let mut s = Slots::with_backlog(8, 16);
    prove(&mut s, &honest);
    let fakes: Vec<NodeKey> = (0..200u32)
        .map(|i| {
            let mut seed = [9u8; 32];
            seed[..4].copy_from_slice(&i.to_le_bytes());
            NodeKey::from_seed(seed)
        })
        .collect();
    let fake_started = fakes
        .iter()
        .enumerate()
        .filter(|(i, f)| started(&s.offer(job_of(f, &format!("f{i:03}")), T0 + 1)))
        .count();
    assert_eq!(fake_started, 4, "the unproven pool: half the slots for all fakes together");
    assert_eq!(s.backlog_len(), 8, "and half the backlog");
    let honest_started =
        (0..8).filter(|i| started(&s.offer(job_of(&honest, &format!("h{i}")), T0 + 2))).count();
    assert_eq!(honest_started, 4, "the proven gateway's share is free");
    // A slot of the pool frees: the next start is a fake's (its pool has
    // room), never a fifth pool slot while four are held.
    let next = s.finished("f000", T0 + 3).expect("a waiting job");
    assert!(next.job_id.starts_with('f'), "{}", next.job_id);
    assert!(started(&s.offer(next, T0 + 3)));
    assert_eq!(s.offer(job_of(&fakes[199], "late"), T0 + 3), Offer::Backlogged);
    // Completed work proves a gateway: it leaves the pool.
    s.completed("f001");
    assert!(s.proven(&fakes[1].node_id()) && !s.proven(&fakes[2].node_id()));
}

#[test]
fn only_allowed_gateways_jobs_are_admitted() {
    let me = samples::keys().0.node_id();
    let model = samples::registration(&samples::keys().0, &Params::default()).models[0].clone();
    let (allowed, other) = (gw(1), gw(2));
    let p = Policy { gateways: Some(BTreeSet::from([allowed.node_id()])), ..Policy::default() };
    let mut j = job_of(&allowed, "x");
    j.request.model = model.model_id.clone();
    let models = [model];
    assert!(p.admit(&j, &me, &models).is_some());
    let mut k = job_of(&other, "y");
    k.request.model = j.request.model.clone();
    assert!(p.admit(&k, &me, &models).is_none(), "not on --gateways");
    assert!(Policy::default().admit(&k, &me, &models).is_some(), "no list: any gateway");
}

#[test]
fn an_unanswered_claim_is_given_up_near_the_claim_timeout() {
    let (key, g) = samples::keys();
    let mut job = samples::api_job(&g, &Params { now_ms: T0, ..Params::default() });
    job.limits.claim_timeout_ms = 1_000;
    let model = samples::registration(&key, &Params::default()).models[0].clone();
    let (mut m, _) = WorkerJob::new(job.clone(), &model, &key, "reg".into(), T0).unwrap();
    let deadline = T0 + 1_000 + CLAIM_ANSWER_SLACK_MS;
    assert_eq!(m.poll_timeout(), Some(deadline));
    assert!(m.handle(Input::Tick, deadline - 1, &key).is_empty());
    let fx = m.handle(Input::Tick, deadline, &key);
    assert!(matches!(&fx[..], [Effect::Done(Termination::Gateway(_))]), "{fx:?}");
    // A gateway asking for an hour still gets at most MAX_CLAIM_WAIT_MS.
    job.limits.claim_timeout_ms = 3_600_000;
    let (m, _) = WorkerJob::new(job, &model, &key, "reg".into(), T0).unwrap();
    assert_eq!(m.poll_timeout(), Some(T0 + MAX_CLAIM_WAIT_MS));
}

#[test]
fn a_payload_answer_of_the_wrong_form_is_not_run() {
    let (key, g) = samples::keys();
    let mut job = samples::api_job(&g, &Params { now_ms: T0, ..Params::default() });
    sign(&mut job, &g).unwrap();
    let model = samples::registration(&key, &Params::default()).models[0].clone();
    let body = job.request.payload_ref.inline.clone().unwrap();
    let good = LeasedPayload::new(body.clone(), "tenant".into(), [1; 32]);
    let short_salt = LeasedPayload { cache_salt: vec![1; 8], ..good.clone() };
    let no_tenant = LeasedPayload { tenant_id: String::new(), ..good.clone() };
    let future = LeasedPayload { version: 9, ..good.clone() };
    for (bad, why) in [(short_salt, "salt"), (no_tenant, "tenant"), (future, "version")] {
        let (mut m, _) = WorkerJob::new(job.clone(), &model, &key, "reg".into(), T0).unwrap();
        let mut l = samples::lease(&key, &g, &Params { now_ms: T0, ..Params::default() });
        l.job_id = job.job_id.clone();
        l.claim_id = m.claim.claim_id.clone();
        sign(&mut l, &g).unwrap();
        m.handle(
            Input::Answer(Request::Claim, Answer::Envelope(Box::new(Message::LeaseGrant(l)))),
            T0,
            &key,
        );
        let fx =
            m.handle(Input::Answer(Request::Payload, Answer::Payload(Box::new(bad))), T0, &key);
        assert!(matches!(&fx[..], [Effect::Done(Termination::Gateway(_))]), "{why}: {fx:?}");
    }
}
