//! One test per input of the worker's job machine, and its slots.

use super::*;
use gcs_protocol::samples::{self, Params};
use gcs_protocol::{verify, ClaimRejectReason, RoutingMode};

pub(super) const T0: u64 = 1_783_468_800_000;

pub(super) struct World {
    pub(super) gw: NodeKey,
    pub(super) key: NodeKey,
    pub(super) m: WorkerJob,
    pub(super) now: u64,
    pub(super) claim: JobClaim,
}

pub(super) fn model() -> ModelInfo {
    samples::registration(&samples::keys().0, &Params::default()).models[0].clone()
}

pub(super) fn outcome(tokens: u64) -> ExecOutcome {
    ExecOutcome {
        finish_reason: FinishReason::Stop,
        input_tokens: 12,
        output_tokens: tokens,
        cached_tokens: 40,
        body: serde_json::json!({"choices": []}),
    }
}

impl World {
    fn new() -> (Self, Vec<Effect>) {
        let (key, gw) = samples::keys();
        let mut job = samples::api_job(&gw, &Params { now_ms: T0, ..Params::default() });
        sign(&mut job, &gw).unwrap();
        let (m, fx) = WorkerJob::new(job, &model(), &key, "reg_1".into(), T0).unwrap();
        let claim = match &fx[..] {
            [Effect::SendClaim(c)] => (**c).clone(),
            other => panic!("the first effect is the claim: {other:?}"),
        };
        (World { gw, key, m, now: T0, claim }, fx)
    }

    pub(super) fn feed(&mut self, input: Input) -> Vec<Effect> {
        self.m.handle(input, self.now, &self.key)
    }

    pub(super) fn lease(&self) -> LeaseGrant {
        let mut l =
            samples::lease(&self.key, &self.gw, &Params { now_ms: self.now, ..Params::default() });
        l.job_id = self.m.job().job_id.clone();
        l.claim_id = self.claim.claim_id.clone();
        sign(&mut l, &self.gw).unwrap();
        l
    }

    fn payload(&self) -> Vec<u8> {
        self.m.job().request.payload_ref.inline.clone().unwrap()
    }

    /// Claimed, leased, fetched: the engine runs.
    fn running() -> Self {
        let (mut w, _) = World::new();
        let l = w.lease();
        w.feed(Input::Answer(Request::Claim, Answer::Envelope(Box::new(Message::LeaseGrant(l)))));
        let p = LeasedPayload::new(w.payload(), "tenant".into(), [1; 32]);
        let fx = w.feed(Input::Answer(Request::Payload, Answer::Payload(Box::new(p))));
        assert!(matches!(&fx[..], [Effect::StartEngine(_)]), "{fx:?}");
        w
    }

    /// A cancellation by the job's gateway.
    fn cancel(&self, lease_id: Option<String>) -> Input {
        Input::Cancel { issued_by: self.gw.node_id(), lease_id }
    }

    fn delta(&mut self, text: &str) -> Vec<Effect> {
        self.feed(Input::Delta {
            text: text.into(),
            tokens: 1,
            token_ids: vec![],
            logprobs: vec![],
        })
    }
}

pub(super) fn chunks(fx: &[Effect]) -> Vec<&StreamChunk> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::SendChunk(c) => Some(&**c),
            _ => None,
        })
        .collect()
}

pub(super) fn result(fx: &[Effect]) -> &FinalResult {
    fx.iter()
        .find_map(|e| match e {
            Effect::SendResult(r) => Some(&**r),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no result in {fx:?}"))
}

pub(super) fn done(fx: &[Effect]) -> Option<&Termination> {
    fx.iter().find_map(|e| match e {
        Effect::Done(t) => Some(t),
        _ => None,
    })
}

#[test]
fn new_sends_a_signed_claim_for_the_job() {
    let (w, _) = World::new();
    verify(&w.claim).unwrap();
    assert_eq!(w.claim.job_id, w.m.job().job_id);
    assert_eq!(w.claim.registration_id, "reg_1");
    assert_eq!(w.claim.expires_at_ms, T0 + CLAIM_TTL_MS);
    let claim_wait = w.m.job().limits.claim_timeout_ms + CLAIM_ANSWER_SLACK_MS;
    assert_eq!(w.m.poll_timeout(), Some(T0 + claim_wait), "no lease: only the claim's deadline");
}

#[test]
fn granted_fetches_the_payload_under_the_lease() {
    let (mut w, _) = World::new();
    let l = w.lease();
    let fx = w.feed(Input::Answer(
        Request::Claim,
        Answer::Envelope(Box::new(Message::LeaseGrant(l.clone()))),
    ));
    match &fx[..] {
        [Effect::FetchPayload { job_id, lease_id }] => {
            assert_eq!((job_id, lease_id), (&l.job_id, &l.lease_id));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(w.m.poll_timeout(), Some(T0 + l.renew_interval_ms));
}

#[test]
fn a_lease_for_another_claim_or_gateway_is_not_taken() {
    let (mut w, _) = World::new();
    let mut l = w.lease();
    l.claim_id = "clm_other".into();
    let fx =
        w.feed(Input::Answer(Request::Claim, Answer::Envelope(Box::new(Message::LeaseGrant(l)))));
    assert!(matches!(done(&fx), Some(Termination::Gateway(_))), "{fx:?}");

    let (mut w, _) = World::new();
    let mut l = w.lease();
    l.gateway_node_id = NodeKey::from_seed([9; 32]).node_id();
    let fx =
        w.feed(Input::Answer(Request::Claim, Answer::Envelope(Box::new(Message::LeaseGrant(l)))));
    assert!(matches!(done(&fx), Some(Termination::Gateway(_))), "{fx:?}");
}

#[test]
fn a_rejected_or_unanswered_claim_ends_the_job() {
    let (mut w, _) = World::new();
    let mut r = samples::claim_rejection(&w.key, &w.gw, &Params::default());
    r.claim_id = w.claim.claim_id.clone();
    r.reason = ClaimRejectReason::AlreadyClaimed;
    let fx = w.feed(Input::Answer(
        Request::Claim,
        Answer::Envelope(Box::new(Message::ClaimRejection(r))),
    ));
    assert_eq!(done(&fx), Some(&Termination::ClaimLost(ClaimRejectReason::AlreadyClaimed)));
    assert!(w.m.is_done());
    assert!(w.feed(Input::Tick).is_empty(), "a finished machine does nothing");

    let (mut w, _) = World::new();
    let fx = w.feed(Input::Answer(Request::Claim, Answer::Failed("timeout".into())));
    assert!(matches!(done(&fx), Some(Termination::Gateway(_))));
}

#[test]
fn payload_starts_the_engine_only_when_its_hash_matches() {
    let w = World::running();
    assert!(w.m.wants_delta());

    let (mut w, _) = World::new();
    let l = w.lease();
    w.feed(Input::Answer(Request::Claim, Answer::Envelope(Box::new(Message::LeaseGrant(l)))));
    let forged = LeasedPayload::new(b"forged".to_vec(), "tenant".into(), [1; 32]);
    let fx = w.feed(Input::Answer(Request::Payload, Answer::Payload(Box::new(forged))));
    assert_eq!(done(&fx), Some(&Termination::Gateway("payload hash mismatch".into())));
}

#[test]
fn deltas_become_signed_sequenced_chunks_within_the_window() {
    let mut w = World::running();
    let mut sent = vec![];
    for i in 0..IN_FLIGHT {
        assert!(w.m.wants_delta());
        let fx = w.delta(&format!("t{i}"));
        sent.extend(chunks(&fx).into_iter().cloned());
    }
    assert_eq!(sent.len(), IN_FLIGHT);
    for (i, c) in sent.iter().enumerate() {
        verify(c).unwrap();
        assert_eq!(c.sequence, i as u64);
        assert_eq!(c.lease_id, w.lease().lease_id);
        assert_eq!(c.delta.role.is_some(), i == 0, "the role rides on the first chunk only");
        assert_eq!(c.finish_reason, None);
    }
    assert!(!w.m.wants_delta(), "the window is full");
    // One more delta anyway: held, and sent when a chunk is acknowledged.
    assert!(chunks(&w.delta("late")).is_empty());
    let fx = w.feed(Input::Answer(Request::Chunk(0), Answer::Ack));
    assert_eq!(chunks(&fx).iter().map(|c| c.sequence).collect::<Vec<_>>(), vec![IN_FLIGHT as u64]);
}

/// A delta's token ids ride on its chunk (signed) when they account for
/// every counted token; a partial list is dropped rather than sent.
#[test]
fn chunks_carry_the_token_ids_the_engine_reports() {
    let mut w = World::running();
    let d =
        |tokens, token_ids| Input::Delta { text: "ab".into(), tokens, token_ids, logprobs: vec![] };
    let fx = w.feed(d(2, vec![7, 9]));
    let c = chunks(&fx)[0].clone();
    verify(&c).unwrap();
    assert_eq!((c.delta.token_ids.clone(), c.usage_delta.output_tokens), (vec![7, 9], 2));
    let fx = w.feed(d(3, vec![7, 9]));
    let c = chunks(&fx)[0];
    assert!(c.delta.token_ids.is_empty());
    assert_eq!(c.usage_delta.output_tokens, 3);
}

#[test]
fn engine_done_sends_the_finish_chunk_after_every_ack_then_the_result() {
    let mut w = World::running();
    w.delta("a");
    w.delta("b");
    w.now += 500;
    let fx = w.feed(Input::EngineDone(Ok(outcome(2))));
    assert!(fx.is_empty(), "two chunks are not answered yet: {fx:?}");
    assert!(w.feed(Input::Answer(Request::Chunk(0), Answer::Ack)).is_empty());
    let fx = w.feed(Input::Answer(Request::Chunk(1), Answer::Ack));
    let finish = chunks(&fx);
    assert_eq!(finish.len(), 1);
    assert_eq!((finish[0].sequence, finish[0].finish_reason), (2, Some(FinishReason::Stop)));
    assert!(finish[0].delta.content.is_none());
    let fx = w.feed(Input::Answer(Request::Chunk(2), Answer::Ack));
    let r = result(&fx);
    verify(r).unwrap();
    assert_eq!(r.status, ResultStatus::Completed);
    assert_eq!(r.chunks_sent, 3);
    let m = r.metering.as_ref().unwrap();
    assert_eq!((m.output_tokens, m.cached_tokens, m.compute_ms), (2, 12, 500));
    assert_eq!(r.attestation.as_ref().unwrap().claim_id, w.claim.claim_id);
    assert_eq!(done(&fx), None, "over only once the result is answered");
    let fx = w.feed(Input::Answer(Request::Result, Answer::Ack));
    assert_eq!(done(&fx), Some(&Termination::Completed));
}

#[test]
fn an_engine_failure_is_reported_without_a_finish_chunk() {
    let mut w = World::running();
    w.delta("a");
    w.feed(Input::EngineDone(Err(ExecError::Engine("out of KV blocks".into()))));
    let fx = w.feed(Input::Answer(Request::Chunk(0), Answer::Ack));
    assert!(chunks(&fx).is_empty());
    let r = result(&fx);
    assert_eq!(r.status, ResultStatus::Failed);
    assert_eq!(r.error.as_ref().unwrap().code, "gnus_engine_error");
    assert_eq!(r.chunks_sent, 1);
    let fx = w.feed(Input::Answer(Request::Result, Answer::Failed("closed".into())));
    assert_eq!(
        done(&fx),
        Some(&Termination::EngineFailed(ExecError::Engine("out of KV blocks".into())))
    );
}

#[test]
fn an_invalid_request_is_reported_as_a_client_error() {
    let mut w = World::running();
    let fx =
        w.feed(Input::EngineDone(Err(ExecError::Invalid("prompt longer than the context".into()))));
    let r = result(&fx);
    assert_eq!(r.status, ResultStatus::Failed);
    let e = r.error.as_ref().unwrap();
    assert!(e.is_client_error(), "{e:?}");
    assert_eq!(e.code, gcs_protocol::ErrorInfo::INVALID_REQUEST_CODE);
    assert_eq!(e.message, "prompt longer than the context");
}

#[test]
fn cancel_stops_the_engine_once_and_the_result_meters_what_was_generated() {
    let mut w = World::running();
    w.delta("a");
    assert!(matches!(&w.feed(w.cancel(None))[..], [Effect::StopEngine]));
    assert!(w.feed(w.cancel(None)).is_empty(), "stopped once");
    assert!(w.m.wants_delta(), "a stopped engine's deltas are drained");
    assert!(chunks(&w.delta("b")).is_empty(), "and dropped");
    w.feed(Input::Answer(Request::Chunk(0), Answer::Ack));
    let fx = w.feed(Input::EngineDone(Ok(outcome(5))));
    let r = result(&fx);
    verify(r).unwrap();
    assert_eq!(r.status, ResultStatus::Cancelled);
    assert_eq!(r.error.as_ref().unwrap().code, "gnus_cancelled");
    assert_eq!(r.metering.as_ref().unwrap().output_tokens, 5, "generated, not delivered");
    assert_eq!(r.chunks_sent, 1);
    let fx = w.feed(Input::Answer(Request::Result, Answer::Ack));
    assert_eq!(done(&fx), Some(&Termination::Cancelled));
}

#[test]
fn only_the_jobs_gateway_cancels_and_only_this_runs_lease() {
    let mut w = World::running();
    let thief = NodeKey::from_seed([66; 32]).node_id();
    let forged = Input::Cancel { issued_by: thief, lease_id: None };
    assert!(w.feed(forged).is_empty(), "another node's cancellation");
    assert!(w.feed(w.cancel(Some("lse_other".into()))).is_empty(), "another lease's");
    assert!(w.m.wants_delta(), "still running");
    let ours = w.cancel(Some(w.lease().lease_id));
    assert!(matches!(&w.feed(ours)[..], [Effect::StopEngine]));
}

#[test]
fn cancel_before_the_engine_starts_just_ends_the_job() {
    let (mut w, _) = World::new();
    assert_eq!(done(&w.feed(w.cancel(None))), Some(&Termination::Cancelled));
}

#[test]
fn a_refused_chunk_stops_the_engine() {
    let mut w = World::running();
    w.delta("a");
    let fx = w.feed(Input::Answer(Request::Chunk(0), Answer::Refused("job ended".into())));
    assert!(matches!(&fx[..], [Effect::StopEngine]), "{fx:?}");
    let fx = w.feed(Input::EngineDone(Ok(outcome(1))));
    assert_eq!(result(&fx).status, ResultStatus::Cancelled);
}

#[test]
fn tick_renews_the_lease_on_time_until_the_result() {
    let mut w = World::running();
    let l = w.lease();
    let due = w.m.poll_timeout().unwrap();
    w.now = due - 1;
    assert!(w.feed(Input::Tick).is_empty(), "not due yet");
    w.now = due;
    let fx = w.feed(Input::Tick);
    match &fx[..] {
        [Effect::SendRenewal(r)] => {
            verify(r).unwrap();
            assert_eq!(r.lease_id, l.lease_id);
            assert_eq!(r.expires_at_ms, due + (l.expires_at_ms - l.created_at_ms));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(w.m.poll_timeout(), Some(due + l.renew_interval_ms));
    w.feed(Input::EngineDone(Ok(outcome(0))));
    assert!(w.m.poll_timeout().is_some(), "renewed while the finish chunk is in flight");
    w.feed(Input::Answer(Request::Chunk(0), Answer::Ack));
    assert_eq!(w.m.poll_timeout(), None, "no renewals once the result is sent");
}

/// A grant whose renewal period outlasts its term (a gateway's
/// `--lease-ms` below its period, or a hostile one) is renewed at a third
/// of the term, so the lease never lapses between renewals.
#[test]
fn renewals_come_at_least_three_times_a_granted_term() {
    let (mut w, _) = World::new();
    let mut l = w.lease();
    l.renew_interval_ms = 20_000;
    l.expires_at_ms = l.created_at_ms + 3_000;
    sign(&mut l, &w.gw).unwrap();
    w.feed(Input::Answer(Request::Claim, Answer::Envelope(Box::new(Message::LeaseGrant(l)))));
    assert_eq!(w.m.poll_timeout(), Some(T0 + 1_000));
}

#[test]
fn renewal_and_stale_answers_change_nothing() {
    let mut w = World::running();
    assert!(w.feed(Input::Answer(Request::Renewal, Answer::Refused("x".into()))).is_empty());
    assert!(w.feed(Input::Answer(Request::Claim, Answer::Failed("late".into()))).is_empty());
    assert!(w.m.wants_delta());
}

fn job(id: &str, expires_at_ms: u64) -> ApiRequestJob {
    let mut j = samples::api_job(&samples::keys().1, &Params::default());
    j.job_id = id.into();
    j.expires_at_ms = expires_at_ms;
    j
}

#[test]
fn slots_start_then_backlog_bounded_then_free_oldest_unexpired() {
    let mut s = Slots::with_backlog(1, 2);
    assert!(matches!(s.offer(job("a", T0), T0), Offer::Start(_)));
    assert_eq!(s.offer(job("a", T0), T0), Offer::Duplicate);
    assert_eq!(s.offer(job("b", T0), T0), Offer::Backlogged);
    assert_eq!(s.offer(job("b", T0), T0), Offer::Duplicate);
    assert_eq!(s.offer(job("c", T0 + 10), T0), Offer::Backlogged);
    assert_eq!(s.offer(job("d", T0 + 10), T0), Offer::Backlogged);
    assert_eq!(s.backlog_len(), 2, "the oldest (b) was forgotten");
    assert_eq!(s.finished("zzz", T0), None, "not running here");
    assert_eq!(s.finished("a", T0 + 10).map(|j| j.job_id), None, "c expired; d expired too");
    assert_eq!(s.running(), 0);
    assert!(matches!(s.offer(job("e", T0), T0), Offer::Start(_)));
    s.offer(job("f", T0 + 100), T0);
    assert_eq!(s.finished("e", T0).map(|j| j.job_id).as_deref(), Some("f"));
}

#[test]
fn policy_admits_by_routing_exclusion_and_model() {
    let me = samples::keys().0.node_id();
    let models = vec![model()];
    let p = Policy::default();
    let mut j = samples::api_job(&samples::keys().1, &Params::default());
    j.request.model = models[0].model_id.clone();
    assert!(p.admit(&j, &me, &models).is_some());
    j.routing.excluded_nodes.push(me.clone());
    assert!(p.admit(&j, &me, &models).is_none(), "excluded");
    j.routing.excluded_nodes.clear();
    j.routing.network = RoutingMode::Private;
    assert!(p.admit(&j, &me, &models).is_none(), "not the tenant's node");
    let private = Policy { private_tenant: Some(j.tenant.tenant_id.clone()), ..Policy::default() };
    assert!(private.admit(&j, &me, &models).is_some());
    j.routing.network = RoutingMode::LocalOnly;
    assert!(p.admit(&j, &me, &models).is_none(), "the public swarm takes no local job");
    j.routing.network = RoutingMode::GatewayLocal;
    assert!(p.admit(&j, &me, &models).is_none(), "not attached to the job's gateway");
    let attached = Policy {
        gateway_local: [j.gateway_node_id.clone()].into_iter().collect(),
        ..Policy::default()
    };
    assert!(attached.admit(&j, &me, &models).is_some());
    assert!(p.admit(&j, &j.gateway_node_id, &models).is_some(), "the gateway's own worker");
    j.routing.network = RoutingMode::Public;
    j.request.model = "no-such-model".into();
    assert!(p.admit(&j, &me, &models).is_none());
}
