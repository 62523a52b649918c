//! The new holder of an exact continuation: which jobs it claims, which
//! payload answers it runs, how it numbers, marks and meters its chunks.

use super::tests::{chunks, done, model, outcome, result, World, T0};
use super::*;
use gcs_gateway::payload::{Generation, JobRequest, Message as ChatMsg, Prompt, Role, Sampling};
use gcs_protocol::samples::{self, Params};
use gcs_protocol::{verify, Continuation, ContinuationOffer, CONTINUATION_VERSION};

const BUILD: &str = "gcs-engine 0.1.0";

fn hash() -> String {
    "ab".repeat(32)
}

fn served() -> ModelInfo {
    ModelInfo { engine_build: BUILD.into(), model_hash: hash(), ..model() }
}

fn body(seed: Option<u64>) -> Vec<u8> {
    JobRequest::Generation(Generation {
        prompt: Prompt::Chat(vec![ChatMsg::text(Role::User, "count to ten")]),
        max_tokens: 120,
        sampling: Sampling { temperature: 0.8, seed, ..Sampling::default() },
        stop: vec![],
        logprobs: None,
        constraint: None,
        tools: None,
    })
    .encode()
    .unwrap()
}

fn offer() -> ContinuationOffer {
    ContinuationOffer { continuation: 1, engine_build: BUILD.into(), model_hash: hash() }
}

/// A job (re-announced as continuation 1 when `offer` is set) with a real
/// generation payload, claimed and leased: its payload is being fetched.
fn leased(offer: Option<ContinuationOffer>, seed: Option<u64>) -> World {
    let (key, gw) = samples::keys();
    let mut job = samples::api_job(&gw, &Params { now_ms: T0, ..Params::default() });
    let b = body(seed);
    job.request.payload_ref.content_hash = gcs_protocol::Hash32::of(&b);
    job.request.payload_ref.size_bytes = b.len() as u64;
    job.request.payload_ref.inline = Some(b);
    job.requirements.continuation = offer;
    job.announcement = 1;
    sign(&mut job, &gw).unwrap();
    let (m, fx) = WorkerJob::new(job, &served(), &key, "reg_1".into(), T0).unwrap();
    let Some(Effect::SendClaim(c)) = fx.first() else { panic!("claim first: {fx:?}") };
    let claim = (**c).clone();
    let mut w = World { gw, key, m, now: T0, claim };
    let l = w.lease();
    let fx =
        w.feed(Input::Answer(Request::Claim, Answer::Envelope(Box::new(Message::LeaseGrant(l)))));
    assert!(matches!(&fx[..], [Effect::FetchPayload { .. }]), "{fx:?}");
    w
}

fn cont(w: &World) -> Continuation {
    Continuation {
        version: CONTINUATION_VERSION,
        job_id: w.m.job().job_id.clone(),
        continuation: 1,
        from_sequence: 5,
        delivered_tokens: vec![11, 12, 13, 14, 15, 16, 17],
        delivered_text_hash: gcs_protocol::Hash32::of(b"One, two, three"),
        seed: 42,
        engine_build: BUILD.into(),
        model_hash: hash(),
    }
}

fn answer(w: &mut World, c: Option<Continuation>) -> Vec<Effect> {
    let body = w.m.job().request.payload_ref.inline.clone().unwrap();
    let mut p = LeasedPayload::new(body, "tenant".into(), [1; 32]);
    p.continuation = c;
    w.feed(Input::Answer(Request::Payload, Answer::Payload(Box::new(p))))
}

/// Continuation 1 accepted: the engine starts with it.
fn resumed() -> World {
    let mut w = leased(Some(offer()), Some(42));
    let c = cont(&w);
    let fx = answer(&mut w, Some(c.clone()));
    match &fx[..] {
        [Effect::StartEngine(p)] => assert_eq!(p.continuation.as_ref(), Some(&c)),
        other => panic!("the engine starts with the continuation: {other:?}"),
    }
    w
}

fn delta(w: &mut World, text: &str, ids: Vec<u32>) -> Vec<Effect> {
    let tokens = ids.len() as u32;
    w.feed(Input::Delta { text: text.into(), tokens, token_ids: ids, logprobs: vec![] })
}

#[test]
fn policy_offers_a_continuation_only_to_the_same_engine_build_and_model_file() {
    let me = samples::keys().0.node_id();
    let p = Policy::default();
    let mut j = samples::api_job(&samples::keys().1, &Params::default());
    j.request.model = model().model_id;
    assert!(p.admit(&j, &me, &[model()]).is_some(), "a plain job: any build");
    j.requirements.continuation = Some(offer());
    assert!(p.admit(&j, &me, &[served()]).is_some(), "same build and file");
    let other_file = ModelInfo { model_hash: "cd".repeat(32), ..served() };
    let other_build = ModelInfo { engine_build: "gcs-engine 0.2.0".into(), ..served() };
    let unhashed = ModelInfo { model_hash: String::new(), ..served() };
    for m in [other_file, other_build, unhashed] {
        assert!(p.admit(&j, &me, std::slice::from_ref(&m)).is_none(), "{m:?}");
    }
    // Of two models answering the name, the matching one serves it.
    let other = ModelInfo { model_hash: "cd".repeat(32), ..served() };
    assert_eq!(p.admit(&j, &me, &[other, served()]).map(|m| &m.model_hash), Some(&hash()));
}

#[test]
fn a_continuation_numbers_from_its_sequence_and_sends_no_role() {
    let mut w = resumed();
    let fx = delta(&mut w, " four", vec![18]);
    let fx2 = delta(&mut w, ",", vec![19]);
    let cs: Vec<_> = chunks(&fx).into_iter().chain(chunks(&fx2)).cloned().collect();
    assert_eq!(cs.iter().map(|c| c.sequence).collect::<Vec<_>>(), [5, 6]);
    assert!(cs.iter().all(|c| c.delta.role.is_none()), "the client has the role");
    assert_eq!(cs[0].delta.token_ids, [18]);
    assert!(cs.iter().all(|c| verify(c).is_ok()));
}

#[test]
fn a_plain_job_still_starts_at_zero_with_the_role() {
    let mut w = leased(None, Some(42));
    assert!(
        matches!(&answer(&mut w, None)[..], [Effect::StartEngine(p)] if p.continuation.is_none())
    );
    let fx = delta(&mut w, "One", vec![11]);
    let c = chunks(&fx)[0];
    assert_eq!((c.sequence, c.delta.role.as_deref()), (0, Some("assistant")));
}

#[test]
fn a_mismatched_continuation_is_not_run() {
    let refused = |offer: Option<ContinuationOffer>, seed, f: fn(&mut Continuation)| {
        let mut w = leased(offer, seed);
        let mut c = cont(&w);
        f(&mut c);
        let fx = answer(&mut w, Some(c.clone()));
        match done(&fx) {
            Some(Termination::Gateway(why)) => why.clone(),
            other => panic!("{c:?} must end as the gateway's fault: {other:?} in {fx:?}"),
        }
    };
    let m = |e: Mismatch| e.to_string();
    assert_eq!(refused(None, Some(42), |_| {}), m(Mismatch::Unannounced));
    assert_eq!(
        refused(Some(offer()), Some(42), |c| c.continuation = 2),
        m(Mismatch::Number { got: 2, announced: 1 })
    );
    let other_job = |c: &mut Continuation| c.job_id = "gcsapi_01HZX3K9Q2W8E7R6T5Y4V3M2N1".into();
    assert_eq!(refused(Some(offer()), Some(42), other_job), m(Mismatch::OtherJob));
    let other_build = |c: &mut Continuation| c.engine_build = "gcs-engine 9".into();
    assert_eq!(refused(Some(offer()), Some(42), other_build), m(Mismatch::Build));
    let other_file = |c: &mut Continuation| c.model_hash = "cd".repeat(32);
    assert_eq!(refused(Some(offer()), Some(42), other_file), m(Mismatch::Build));
    assert_eq!(refused(Some(offer()), Some(7), |_| {}), m(Mismatch::Seed));
    let exhausted = |c: &mut Continuation| c.delivered_tokens = vec![1; 120];
    assert_eq!(refused(Some(offer()), Some(42), exhausted), m(Mismatch::Exhausted));
    // A greedy payload fixes no seed: the continuation's is taken.
    let mut w = leased(Some(offer()), None);
    let c = cont(&w);
    assert!(matches!(&answer(&mut w, Some(c))[..], [Effect::StartEngine(_)]));
    // Announced as a continuation, answered as a fresh run: not run.
    let mut w = leased(Some(offer()), Some(42));
    let fx = answer(&mut w, None);
    assert_eq!(done(&fx), Some(&Termination::Gateway(m(Mismatch::Missing))));
}

#[test]
fn a_continuation_meters_the_whole_completion_once() {
    let mut w = resumed();
    let fx = delta(&mut w, " four, five", vec![18, 19, 20]);
    let seq = chunks(&fx)[0].sequence;
    w.feed(Input::Answer(Request::Chunk(seq), Answer::Ack));
    // The engine counts the whole completion: 7 delivered + 3 new.
    let fx = w.feed(Input::EngineDone(Ok(outcome(10))));
    let finish = chunks(&fx)[0].clone();
    assert_eq!((finish.sequence, finish.delta.role.as_deref()), (seq + 1, None));
    let fx = w.feed(Input::Answer(Request::Chunk(finish.sequence), Answer::Ack));
    let r = result(&fx);
    let m = r.metering.as_ref().unwrap();
    // The gateway's one usage record comes from the last holder: every
    // token once, the delivered prefix included, the prompt once.
    assert_eq!((m.input_tokens, m.output_tokens), (12, 10));
    assert_eq!(r.status, ResultStatus::Completed);
    assert_eq!(r.chunks_sent, seq + 2, "the stream's next sequence");
}

#[test]
fn a_refused_replay_is_the_workers_failure_not_the_clients() {
    let mut w = resumed();
    let e = ExecError::Invalid(
        "continuation: the delivered text is not what this engine's replay releases".into(),
    );
    let fx = w.feed(Input::EngineDone(Err(e.clone())));
    let r = result(&fx);
    assert_eq!(r.status, ResultStatus::Failed);
    let err = r.error.as_ref().unwrap();
    assert_eq!((err.kind.as_str(), err.code.as_str()), ("server_error", REFUSED_CODE));
    assert!(!err.is_client_error(), "the gateway must not answer the client with it");
    assert!(err.message.contains("replay"));
    assert!(chunks(&fx).is_empty(), "no finish chunk");
    let fx = w.feed(Input::Answer(Request::Result, Answer::Ack));
    assert_eq!(done(&fx), Some(&Termination::EngineFailed(e)));
}
