//! The sealed (`encrypted_payload`) payload answer: opened in memory on
//! the lease holder, refused with a typed, signed failure otherwise.

use super::*;
use crate::jobs::sealed;
use gcs_protocol::samples::{self, Params};
use gcs_protocol::verify;

const T0: u64 = 1_783_468_800_000;
const BODY: &[u8] = br#"{"messages":[{"role":"user","content":"sealed prompt"}]}"#;

struct Sealed {
    gw: NodeKey,
    key: NodeKey,
    m: WorkerJob,
    lease: LeaseGrant,
    committed: Vec<u8>,
}

/// A sealed job, claimed and leased: the payload is being fetched.
fn leased() -> Sealed {
    let (key, gw) = samples::keys();
    let mut job = samples::api_job(&gw, &Params { now_ms: T0, ..Params::default() });
    let committed = sealed::committed(BODY).unwrap();
    job.request.payload_ref.encrypted = true;
    job.request.payload_ref.inline = None;
    job.request.payload_ref.content_hash = Hash32::of(&committed);
    sign(&mut job, &gw).unwrap();
    let model = samples::registration(&key, &Params::default()).models[0].clone();
    let (mut m, fx) = WorkerJob::new(job, &model, &key, "reg_1".into(), T0).unwrap();
    let Some(Effect::SendClaim(c)) = fx.first() else { panic!("claim first: {fx:?}") };
    let mut l = samples::lease(&key, &gw, &Params { now_ms: T0, ..Params::default() });
    l.job_id = m.job().job_id.clone();
    l.claim_id = c.claim_id.clone();
    sign(&mut l, &gw).unwrap();
    let lm = Message::LeaseGrant(l.clone());
    let fx = m.handle(Input::Answer(Request::Claim, Answer::Envelope(Box::new(lm))), T0, &key);
    assert!(matches!(&fx[..], [Effect::FetchPayload { .. }]), "{fx:?}");
    Sealed { gw, key, m, lease: l, committed }
}

impl Sealed {
    fn answer(&mut self, body: Vec<u8>) -> Vec<Effect> {
        let p = LeasedPayload::new(body, "tenant".into(), [1; 32]);
        self.m.handle(
            Input::Answer(Request::Payload, Answer::Payload(Box::new(p))),
            T0 + 5,
            &self.key,
        )
    }

    fn sealed_for(&self, lease_id: &str) -> Vec<u8> {
        let at_rest =
            sealed::seal_at_rest(&self.gw, &self.m.job().job_id, &self.committed).unwrap();
        let job_id = self.m.job().job_id.clone();
        sealed::reseal_for(&self.gw, &job_id, lease_id, &self.key.node_id(), &at_rest).unwrap()
    }
}

#[test]
fn the_holder_opens_the_sealed_body_in_memory_and_runs_it() {
    let mut s = leased();
    let lease_id = s.lease.lease_id.clone();
    let fx = s.answer(s.sealed_for(&lease_id));
    match &fx[..] {
        [Effect::StartEngine(p)] => assert_eq!(p.body, BODY, "the engine gets the clear body"),
        other => panic!("engine not started: {other:?}"),
    }
}

fn unreadable(fx: &[Effect], key: &NodeKey) -> FinalResult {
    let r = fx
        .iter()
        .find_map(|e| match e {
            Effect::SendResult(r) => Some((**r).clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no failed result: {fx:?}"));
    verify(&r).unwrap();
    assert_eq!(r.node_id, key.node_id());
    assert_eq!(r.status, ResultStatus::Failed);
    assert_eq!(r.chunks_sent, 0, "before the first token");
    assert_eq!(r.error.as_ref().unwrap().code, sealed::PayloadError::CODE);
    assert!(!fx.iter().any(|e| matches!(e, Effect::StartEngine(_))));
    r
}

#[test]
fn a_box_for_another_lease_tampered_or_in_clear_is_a_signed_failure_under_the_lease() {
    let mut s = leased();
    let lease_id = s.lease.lease_id.clone();
    // Sealed under another lease of the same job.
    let fx = s.answer(s.sealed_for("gcslease_other"));
    let r = unreadable(&fx, &s.key);
    assert_eq!(r.lease_id.as_deref(), Some(lease_id.as_str()));
    assert!(r.error.unwrap().message.contains("does not open"));

    let mut s = leased();
    let mut t = s.sealed_for(&lease_id);
    let last = t.len() - 1;
    t[last] ^= 1;
    unreadable(&s.answer(t), &s.key);

    // A gateway that sends the clear body for a sealed job is refused too:
    // the job said sealed, and the worker does not take it in clear.
    let mut s = leased();
    unreadable(&s.answer(s.committed.clone()), &s.key);
}

#[test]
fn after_the_failure_is_answered_the_job_ends_as_the_gateways_fault() {
    let mut s = leased();
    let fx = s.answer(vec![1, 2, 3]);
    unreadable(&fx, &s.key);
    let fx = s.m.handle(Input::Answer(Request::Result, Answer::Ack), T0 + 6, &s.key);
    assert!(
        matches!(
            fx.iter().find_map(|e| match e {
                Effect::Done(t) => Some(t),
                _ => None,
            }),
            Some(Termination::Gateway(_))
        ),
        "{fx:?}"
    );
    assert!(s.m.is_done());
}
