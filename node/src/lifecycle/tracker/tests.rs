use super::*;
use gcs_protocol::samples::{self, Params};
use gcs_protocol::{FinishReason, Metering, NodeKey, ResponseBody};
use proptest::prelude::*;

const T0: u64 = 1_783_468_800_000;

struct World {
    gw: NodeKey,
    workers: Vec<NodeKey>,
    tracker: JobTracker,
    limits: Limits,
    now: u64,
    effects: Vec<Effect>,
}

impl World {
    fn new() -> Self {
        Self::with(TrackerConfig::default())
    }
    fn with(config: TrackerConfig) -> Self {
        let gw = samples::keys().1;
        let mut job = samples::api_job(&gw, &Params::default());
        sign(&mut job, &gw).unwrap();
        let config = TrackerConfig { queue_timeout_ms: 0, ..config };
        let (tracker, effects) = JobTracker::new(job, config, T0);
        let workers = (1..=3u8).map(|i| NodeKey::from_seed([i; 32])).collect();
        World { gw, workers, tracker, limits: Limits::default(), now: T0, effects }
    }
    fn feed(&mut self, input: Input) -> Vec<Effect> {
        let out = self.tracker.handle(input, self.now, &self.gw, &self.limits);
        self.effects.extend(out.clone());
        out
    }
    fn claim(&mut self, w: usize) -> Vec<Effect> {
        self.claim_as(w, false)
    }
    /// A claim from one of the job tenant's private nodes, or a public one.
    fn claim_as(&mut self, w: usize, private: bool) -> Vec<Effect> {
        let key = &self.workers[w];
        let p = Params { now_ms: self.now - 100, ..Params::default() };
        let mut reg = samples::registration(key, &p);
        if private {
            // Admitted by the tenant's key (the job names it as issuer).
            let t = samples::tenant_key();
            let mut m = samples::membership(&t, key, &Params::default());
            m.group_id = self.tracker.job.tenant.tenant_id.clone();
            sign(&mut m, &t).unwrap();
            reg.memberships = vec![m];
            reg.queue.accepts_private_jobs = true;
        }
        sign(&mut reg, key).unwrap();
        let mut c = samples::claim(key, &p);
        c.job_id = self.tracker.job.job_id.clone();
        c.claim_id = ids::new_id(ids::CLAIM, self.now).unwrap();
        sign(&mut c, key).unwrap();
        self.feed(Input::Claim(Box::new(c), Some(Box::new(reg))))
    }
    fn chunk(&mut self, w: usize, seq: u64, last: bool) -> Vec<Effect> {
        let key = &self.workers[w];
        let lease = self.tracker.lease().map(|l| l.lease_id.clone()).unwrap_or_default();
        self.chunk_under(w, &lease, seq, last, key.node_id())
    }
    fn chunk_under(
        &mut self,
        w: usize,
        lease: &str,
        seq: u64,
        last: bool,
        _n: NodeId,
    ) -> Vec<Effect> {
        let key = &self.workers[w];
        let mut c =
            samples::chunk(key, &Params { text: format!("t{seq}"), n: seq, now_ms: self.now });
        c.job_id = self.tracker.job.job_id.clone();
        c.lease_id = lease.into();
        c.finish_reason = last.then_some(FinishReason::Stop);
        sign(&mut c, key).unwrap();
        self.feed(Input::Chunk(Box::new(c)))
    }
    fn result(&mut self, w: usize, tokens: u64) -> Vec<Effect> {
        let key = &self.workers[w];
        let mut r = samples::final_result(
            key,
            &Params { n: tokens, now_ms: self.now, ..Params::default() },
        );
        r.job_id = self.tracker.job.job_id.clone();
        r.lease_id = self.tracker.lease().map(|l| l.lease_id.clone());
        r.response = Some(ResponseBody {
            format: "openai.chat.completion".into(),
            body: serde_json::Value::Null,
        });
        r.metering = Some(Metering {
            input_tokens: 10,
            output_tokens: tokens,
            tokens_sent_to_client: 0,
            cached_tokens: 4,
            compute_ms: 5,
            first_token_ms: 1,
            child_jobs: 0,
            cost_gnus: "0".into(),
        });
        sign(&mut r, key).unwrap();
        self.feed(Input::Result(Box::new(r)))
    }
    fn tick(&mut self, ms: u64) -> Vec<Effect> {
        self.now += ms;
        self.feed(Input::Tick)
    }
    fn usages(&self) -> Vec<&UsageRecord> {
        self.effects
            .iter()
            .filter_map(|e| if let Effect::Usage(u) = e { Some(u.as_ref()) } else { None })
            .collect()
    }
}

fn leases(e: &[Effect]) -> usize {
    e.iter().filter(|e| matches!(e, Effect::Lease(_))).count()
}
fn rejection(e: &[Effect]) -> Option<gcs_protocol::ClaimRejectReason> {
    e.iter().find_map(|e| if let Effect::RejectClaim(r) = e { Some(r.reason) } else { None })
}

#[test]
fn the_first_valid_claim_wins_and_later_ones_are_told_why_they_lost() {
    let mut w = World::new();
    assert!(matches!(w.effects[0], Effect::Publish(_)));
    w.now += 50;
    assert_eq!(leases(&w.claim(0)), 1);
    assert_eq!(w.tracker.state(), JobState::Accepted);
    assert_eq!(rejection(&w.claim(1)), Some(gcs_protocol::ClaimRejectReason::AlreadyClaimed));
}

fn hybrid_world() -> World {
    let gw = samples::keys().1;
    let mut job = samples::api_job(&gw, &Params::default());
    job.routing.network = gcs_protocol::RoutingMode::Hybrid;
    job.routing.membership_issuer = Some(samples::tenant_key().node_id());
    sign(&mut job, &gw).unwrap();
    let (tracker, effects) = JobTracker::new(job, TrackerConfig::default(), T0);
    let workers = (1..=3u8).map(|i| NodeKey::from_seed([i; 32])).collect();
    World { gw, workers, tracker, limits: Limits::default(), now: T0, effects }
}

#[test]
fn hybrid_jobs_give_the_tenants_private_nodes_the_first_window() {
    let mut w = hybrid_world();
    w.now += 50;
    let turned = w.claim(0);
    assert_eq!(rejection(&turned), Some(gcs_protocol::ClaimRejectReason::PrivateFirst));
    w.now += 50;
    assert_eq!(leases(&w.claim_as(1, true)), 1, "a private node wins inside the window");
}

#[test]
fn hybrid_jobs_go_public_when_no_private_node_claims_in_the_window() {
    let mut w = hybrid_world();
    w.now += 50;
    assert_eq!(rejection(&w.claim(0)), Some(gcs_protocol::ClaimRejectReason::PrivateFirst));
    // The window closes: the job is re-announced at once (new bytes).
    let out = w.tick(250);
    assert!(out.iter().any(|e| matches!(e, Effect::Publish(j) if j.announcement >= 1)), "{out:?}");
    assert_eq!(leases(&w.claim(0)), 1, "the public node wins after the window");
}

#[test]
fn an_unclaimed_job_stays_announced_until_the_queue_timeout() {
    let mut w = World::new();
    w.tracker.config.queue_timeout_ms = 5_000;
    let mut announcements = 0;
    while w.now + 500 < T0 + 5_000 {
        let out = w.tick(500);
        assert!(
            !out.iter().any(|e| matches!(e, Effect::Requeue(_) | Effect::Fail { .. })),
            "at +{}: {out:?}",
            w.now - T0
        );
        announcements += out.iter().filter(|e| matches!(e, Effect::Publish(_))).count();
    }
    assert!(announcements >= 3, "re-announced {announcements} times");
    // A worker that was busy claims it late and wins.
    assert_eq!(leases(&w.claim(0)), 1);
}

#[test]
fn no_claim_requeues_then_fails_with_no_capable_nodes() {
    let mut w = World::new();
    let mut requeues = 0;
    for _ in 0..10 {
        let out = w.tick(1_001);
        requeues += out.iter().filter(|e| matches!(e, Effect::Requeue(_))).count();
        if w.tracker.state().is_terminal() {
            break;
        }
    }
    assert_eq!(requeues, 2, "max_requeues = 2");
    let fail = w.effects.iter().find_map(|e| {
        if let Effect::Fail { error, after_partial_output } = e {
            Some((error.code.clone(), *after_partial_output))
        } else {
            None
        }
    });
    assert_eq!(fail, Some(("gnus_no_capable_nodes".into(), false)));
    assert_eq!(w.usages().len(), 1);
}

#[test]
fn a_worker_lost_before_its_first_token_is_replaced_transparently() {
    let mut w = World::new();
    w.now += 10;
    w.claim(0);
    let lost = w.workers[0].node_id();
    let out = w.feed(Input::WorkerDisconnected(lost.clone()));
    assert!(out
        .iter()
        .any(|e| matches!(e, Effect::Requeue(r) if r.excluded_nodes.contains(&lost))));
    assert!(out
        .iter()
        .any(|e| matches!(e, Effect::Publish(j) if j.routing.excluded_nodes.contains(&lost))));
    assert_eq!(
        rejection(&w.claim(0)),
        Some(gcs_protocol::ClaimRejectReason::PolicyDenied),
        "the failed node is excluded"
    );
    assert_eq!(leases(&w.claim(1)), 1);
    // A chunk from the old holder is not forwarded; the new holder's are.
    let old_lease = "lease_00000000000000000000000000".to_string();
    assert!(w.chunk_under(0, &old_lease, 0, false, lost).is_empty());
    assert!(matches!(w.chunk(1, 0, false)[..], [Effect::Forward(_)]));
    assert!(matches!(w.chunk(1, 1, true)[..], [Effect::Forward(_)]));
    let out = w.result(1, 2);
    assert!(matches!(out[0], Effect::Complete(_)));
    assert_eq!(w.tracker.state(), JobState::Completed);
    let u = w.usages();
    assert_eq!(u.len(), 1);
    assert_eq!(
        (u[0].requeue_count, u[0].output_tokens_sent_to_client, u[0].cached_tokens),
        (1, 2, 4)
    );
    assert_eq!(u[0].node_id, Some(w.workers[1].node_id()));
}

#[test]
fn a_worker_lost_after_its_first_token_ends_the_stream_with_an_error() {
    let mut w = World::new();
    w.claim(0);
    w.chunk(0, 0, false);
    w.chunk(0, 1, false);
    let out = w.feed(Input::WorkerDisconnected(w.workers[0].node_id()));
    assert!(out.iter().any(|e| matches!(e, Effect::Fail { after_partial_output: true, .. })));
    assert!(
        !out.iter().any(|e| matches!(e, Effect::Requeue(_) | Effect::Publish(_))),
        "never switch workers mid-stream"
    );
    let u = w.usages()[0].clone();
    assert_eq!(u.output_tokens_sent_to_client, 2);
    assert!(u.failed_after_partial_output);
}

#[test]
fn an_unrenewed_lease_expires_and_a_renewed_one_does_not() {
    let mut w = World::new();
    w.claim(0);
    let lease = w.tracker.lease().unwrap().clone();
    w.now += 8_000;
    let mut r = samples::renewal(&w.workers[0], &Params { now_ms: w.now, ..Params::default() });
    r.job_id = lease.job_id.clone();
    r.lease_id = lease.lease_id.clone();
    sign(&mut r, &w.workers[0]).unwrap();
    assert_eq!(leases(&w.feed(Input::Renewal(r))), 1);
    w.chunk(0, 0, false);
    assert!(w.tick(5_000).is_empty(), "renewed to now + 10 s");
    let out = w.tick(6_000);
    assert!(
        out.iter().any(|e| matches!(e, Effect::Fail { after_partial_output: true, .. })),
        "{out:?}"
    );
}

/// `--lease-ms`: the grant, every renewal and the expiry all use the
/// configured term, and the holder is told to renew five times a term.
#[test]
fn the_configured_lease_term_is_granted_renewed_and_enforced() {
    let d = TrackerConfig::default();
    assert_eq!((d.lease_term_ms, d.renew_interval_ms), (10_000, 2_000));
    let mut w = World::with(TrackerConfig::with_lease_term(2_000));
    w.claim(0);
    let lease = w.tracker.lease().unwrap().clone();
    assert_eq!(lease.expires_at_ms - lease.created_at_ms, 2_000);
    assert_eq!(lease.renew_interval_ms, 400);
    w.now += 1_500;
    let mut r = samples::renewal(&w.workers[0], &Params { now_ms: w.now, ..Params::default() });
    r.job_id = lease.job_id.clone();
    r.lease_id = lease.lease_id.clone();
    sign(&mut r, &w.workers[0]).unwrap();
    let renewed = w.feed(Input::Renewal(r));
    let Some(Effect::Lease(l)) = renewed.first() else { panic!("{renewed:?}") };
    assert_eq!(l.expires_at_ms, w.now + 2_000);
    w.chunk(0, 0, false);
    assert!(w.tick(1_900).is_empty(), "renewed to now + 2 s");
    let out = w.tick(200);
    assert!(
        out.iter().any(|e| matches!(e, Effect::Fail { after_partial_output: true, .. })),
        "expired 2 s after the renewal, not 10: {out:?}"
    );
}

#[test]
fn client_cancel_tells_the_worker_and_stops_forwarding() {
    let mut w = World::new();
    w.claim(0);
    w.chunk(0, 0, false);
    let out = w.feed(Input::Cancel(CancellationReason::ClientDisconnected));
    assert!(out.iter().any(|e| matches!(e, Effect::Cancel(c) if c.last_sequence_sent == Some(0) && c.partial_usage.output_tokens_sent == 1)));
    assert!(w.chunk(0, 1, false).is_empty());
    assert_eq!(w.tracker.state(), JobState::Cancelled);
    let u = w.usages()[0].clone();
    assert_eq!(u.cancellation_reason, Some(CancellationReason::ClientDisconnected));
    // The worker's result reports more generated than delivered.
    w.result(0, 7);
    assert_eq!(w.usages().len(), 1, "one usage record per job");
}

#[test]
fn requeues_exhausted_after_leases_is_not_no_capable_nodes() {
    let mut w = World::new();
    for who in 0..3 {
        w.claim(who);
        w.feed(Input::WorkerDisconnected(w.workers[who].node_id()));
    }
    let fail = w.effects.iter().find_map(|e| {
        if let Effect::Fail { error, .. } = e {
            Some(error.code.clone())
        } else {
            None
        }
    });
    assert_eq!(fail.as_deref(), Some("gnus_requeue_exhausted"));
}

#[test]
fn first_token_timeout_requeues() {
    let mut w = World::new();
    w.claim(0);
    let out = w.tick(10_000);
    assert!(out.iter().any(|e| matches!(e, Effect::Requeue(r) if r.reason == RequeueReason::WorkerFailedBeforeFirstToken)));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Random schedules of claims, chunks, results, disconnects, cancels and
    /// ticks: every job ends in exactly one terminal state with exactly one
    /// usage record, and delivered tokens never exceed generated ones.
    #[test]
    fn every_job_ends_once_with_one_usage_record(events in prop::collection::vec((0u8..7, 0usize..3, 0u64..6), 1..60)) {
        let mut w = World::new();
        let mut seqs = [0u64; 3];
        for (kind, who, arg) in events {
            match kind {
                0 => { w.claim(who); }
                1 | 2 => { let s = seqs[who]; seqs[who] += 1; w.chunk(who, s, kind == 2 && arg == 0); }
                3 => { w.result(who, arg + seqs[who]); }
                4 => { w.feed(Input::WorkerDisconnected(w.workers[who].node_id())); }
                5 => { if arg == 0 { w.feed(Input::Cancel(CancellationReason::ClientDisconnected)); } }
                _ => { w.tick(arg * 2_000); }
            }
        }
        for _ in 0..200 {
            if w.tracker.state().is_terminal() { break; }
            w.tick(5_000);
        }
        prop_assert!(w.tracker.state().is_terminal());
        let terminals = w.effects.iter().filter(|e| matches!(e, Effect::Complete(_) | Effect::Fail { .. })).count()
            + usize::from(w.tracker.state() == JobState::Cancelled);
        prop_assert_eq!(terminals, 1);
        let u = w.usages();
        prop_assert_eq!(u.len(), 1);
        prop_assert!(u[0].output_tokens_sent_to_client <= u[0].output_tokens_generated);
    }
}

#[test]
fn a_workers_metering_is_bounded_by_what_the_gateway_knows() {
    let gw = samples::keys().1;
    let job = samples::api_job(&gw, &Params::default());
    let lie = Metering {
        input_tokens: u64::MAX,
        output_tokens: u64::MAX,
        tokens_sent_to_client: 0,
        cached_tokens: u64::MAX,
        compute_ms: 5,
        first_token_ms: 1,
        child_jobs: 0,
        cost_gnus: "0".into(),
    };
    let m = bounded_metering(&job, &lie, 7);
    let max_out = u64::from(job.requirements.max_output_tokens);
    assert_eq!(m.output_tokens, max_out, "at most max_output_tokens");
    assert_eq!(m.input_tokens, job.request.payload_ref.size_bytes + TEMPLATE_TOKENS);
    assert_eq!(m.cached_tokens, m.input_tokens);
    let under = Metering { output_tokens: 2, input_tokens: 3, cached_tokens: 1, ..lie };
    let m = bounded_metering(&job, &under, 7);
    assert_eq!((m.output_tokens, m.input_tokens, m.cached_tokens), (7, 3, 1), "never below delivered");
}

fn failed_result(w: &mut World, worker: usize, error: ErrorInfo) -> Vec<Effect> {
    let key = &w.workers[worker];
    let mut r = samples::final_result(key, &Params { now_ms: w.now, ..Params::default() });
    r.job_id = w.tracker.job.job_id.clone();
    r.lease_id = w.tracker.lease().map(|l| l.lease_id.clone());
    r.status = ResultStatus::Failed;
    r.response = None;
    r.error = Some(error);
    sign(&mut r, key).unwrap();
    w.feed(Input::Result(Box::new(r)))
}

#[test]
fn a_client_error_result_fails_the_job_at_once_without_requeue_or_strike() {
    let mut w = World::new();
    w.claim(0);
    let mut e = ErrorInfo::invalid_request("logit_bias token 999999 beyond the vocabulary");
    e.code = "worker_chosen_code".into();
    let fx = failed_result(&mut w, 0, e);
    assert!(!fx.iter().any(|e| matches!(e, Effect::Requeue(_) | Effect::Publish(_))), "{fx:?}");
    let fail = fx.iter().find_map(|e| match e {
        Effect::Fail { error, after_partial_output } => Some((error, *after_partial_output)),
        _ => None,
    });
    let (error, partial) = fail.expect("the job fails at once");
    assert!(error.is_client_error() && !partial);
    // Our code, not the worker's; and not the code that strikes the worker.
    assert_eq!(error.code, ErrorInfo::INVALID_REQUEST_CODE);
    assert!(error.message.contains("beyond the vocabulary"));
    assert!(w.tracker.state().is_terminal());
    assert_eq!(w.usages().len(), 1, "a failed job still has its one usage record");
}

#[test]
fn an_engine_failure_before_the_first_token_still_requeues() {
    let mut w = World::new();
    w.claim(0);
    let e = ErrorInfo {
        kind: "server_error".into(),
        code: "gnus_engine_error".into(),
        message: "out of KV blocks".into(),
    };
    let fx = failed_result(&mut w, 0, e);
    assert!(fx.iter().any(|e| matches!(e, Effect::Requeue(_))), "{fx:?}");
    assert!(!w.tracker.state().is_terminal());
}

#[test]
fn a_sealed_payload_that_did_not_open_requeues_without_the_holder_and_without_a_strike() {
    let mut w = World::new();
    w.claim(0);
    let e = ErrorInfo {
        kind: "server_error".into(),
        code: crate::jobs::sealed::PayloadError::CODE.into(),
        message: "sealed payload does not open".into(),
    };
    let fx = failed_result(&mut w, 0, e);
    let r = fx
        .iter()
        .find_map(|e| match e {
            Effect::Requeue(r) => Some(r),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no requeue: {fx:?}"));
    assert_eq!(r.reason, RequeueReason::PayloadUnreadable);
    assert_eq!(r.excluded_nodes.last(), Some(&w.workers[0].node_id()), "the holder is left out");
    assert!(!fx.iter().any(|e| matches!(e, Effect::Strike(_))), "{fx:?}");
    assert!(!w.tracker.state().is_terminal());
}
