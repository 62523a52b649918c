//! The tracker's exact continuations (specs/lifecycle.md), one test per
//! loss point and per rule: a lost holder is replaced by a worker of the
//! same engine build and model file, which resumes from the fence's
//! continuation point; otherwise the stream ends with `gnus_worker_lost`
//! as before.

use super::*;
use gcs_protocol::samples::{self, Params};
use gcs_protocol::{
    ClaimRejectReason, Continuation, FinishReason, Hash32, HolderTokens, Metering, NodeKey,
    MAX_CONTINUATIONS,
};

const T0: u64 = 1_783_468_800_000;
const BUILD: &str = "gcs-engine 0.1.0";
const SEED: u64 = 0x5eed;

fn hash_a() -> String {
    "ab".repeat(32)
}

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
        Self::with(|_| {})
    }
    fn with(edit: impl FnOnce(&mut ApiRequestJob)) -> Self {
        let gw = samples::keys().1;
        let mut job = samples::api_job(&gw, &Params::default());
        edit(&mut job);
        sign(&mut job, &gw).unwrap();
        let config = TrackerConfig { queue_timeout_ms: 0, ..TrackerConfig::default() };
        let (mut tracker, effects) = JobTracker::new(job, config, T0);
        tracker.set_seed(Some(SEED));
        let workers = (1..=8u8).map(|i| NodeKey::from_seed([i; 32])).collect();
        World { gw, workers, tracker, limits: Limits::default(), now: T0 + 50, effects }
    }
    fn feed(&mut self, input: Input) -> Vec<Effect> {
        let out = self.tracker.handle(input, self.now, &self.gw, &self.limits);
        self.effects.extend(out.clone());
        out
    }
    /// A claim of worker `w`, its registration advertising `build` and
    /// `hash` for every model.
    fn claim(&mut self, w: usize, build: &str, hash: &str) -> Vec<Effect> {
        let key = &self.workers[w];
        let p = Params { now_ms: self.now - 100, ..Params::default() };
        let mut reg = samples::registration(key, &p);
        for m in &mut reg.models {
            m.engine_build = build.into();
            m.model_hash = hash.into();
        }
        sign(&mut reg, key).unwrap();
        let mut c = samples::claim(key, &p);
        c.job_id = self.tracker.job.job_id.clone();
        c.claim_id = ids::new_id(ids::CLAIM, self.now).unwrap();
        sign(&mut c, key).unwrap();
        self.feed(Input::Claim(Box::new(c), Some(Box::new(reg))))
    }
    fn lease_id(&self) -> String {
        self.tracker.lease().map(|l| l.lease_id.clone()).unwrap_or_default()
    }
    /// Chunk `seq` of `w` under `lease`: text `t{seq} `, one token with id
    /// `100 + seq`; the finish chunk carries no token.
    fn chunk_under(&mut self, w: usize, lease: &str, seq: u64, last: bool) -> Vec<Effect> {
        let key = &self.workers[w];
        let mut c =
            samples::chunk(key, &Params { text: format!("t{seq} "), n: seq, now_ms: self.now });
        c.job_id = self.tracker.job.job_id.clone();
        c.lease_id = lease.into();
        if last {
            c.finish_reason = Some(FinishReason::Stop);
            c.delta.content = None;
            c.usage_delta.output_tokens = 0;
        } else {
            c.delta.token_ids = vec![100 + seq as u32];
        }
        sign(&mut c, key).unwrap();
        self.feed(Input::Chunk(Box::new(c)))
    }
    fn chunk(&mut self, w: usize, seq: u64, last: bool) -> Vec<Effect> {
        let lease = self.lease_id();
        self.chunk_under(w, &lease, seq, last)
    }
    fn result(&mut self, w: usize, output_tokens: u64) -> Vec<Effect> {
        let key = &self.workers[w];
        let mut r = samples::final_result(key, &Params { now_ms: self.now, ..Params::default() });
        r.job_id = self.tracker.job.job_id.clone();
        r.lease_id = self.tracker.lease().map(|l| l.lease_id.clone());
        r.metering = Some(Metering {
            input_tokens: 10,
            output_tokens,
            tokens_sent_to_client: output_tokens,
            cached_tokens: 0,
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
    /// Worker `w` (build A, file A) holds the job and forwarded chunks
    /// `0..n`.
    fn streaming(&mut self, w: usize, n: u64) {
        assert_eq!(leases(&self.claim(w, BUILD, &hash_a())), 1);
        for s in 0..n {
            assert_eq!(forwarded(&self.chunk(w, s, false)), vec![s]);
        }
    }
    fn node(&self, w: usize) -> NodeId {
        self.workers[w].node_id()
    }
    fn usage(&self) -> &UsageRecord {
        let mut u = self.effects.iter().filter_map(|e| match e {
            Effect::Usage(u) => Some(u.as_ref()),
            _ => None,
        });
        let first = u.next().expect("a usage record");
        assert!(u.next().is_none(), "exactly one usage record");
        first
    }
}

fn leases(e: &[Effect]) -> usize {
    e.iter().filter(|e| matches!(e, Effect::Lease(_))).count()
}
fn forwarded(e: &[Effect]) -> Vec<u64> {
    e.iter()
        .filter_map(|e| if let Effect::Forward(cs) = e { Some(cs) } else { None })
        .flatten()
        .map(|c| c.sequence)
        .collect()
}
fn rejection(e: &[Effect]) -> Option<ClaimRejectReason> {
    e.iter().find_map(|e| if let Effect::RejectClaim(r) = e { Some(r.reason) } else { None })
}
fn continued(e: &[Effect]) -> Option<(u32, &Requeue)> {
    e.iter().find_map(|e| match e {
        Effect::Continue { requeue, continuation } => Some((*continuation, requeue)),
        _ => None,
    })
}
fn published(e: &[Effect]) -> Option<&ApiRequestJob> {
    e.iter().find_map(|e| if let Effect::Publish(j) = e { Some(j.as_ref()) } else { None })
}
fn failure(e: &[Effect]) -> Option<(&str, bool)> {
    e.iter().find_map(|e| match e {
        Effect::Fail { error, after_partial_output } => {
            Some((error.code.as_str(), *after_partial_output))
        }
        _ => None,
    })
}
fn text_hash(seqs: std::ops::Range<u64>) -> Hash32 {
    let t: String = seqs.map(|s| format!("t{s} ")).collect();
    Hash32::of(t.as_bytes())
}

/// Lost before anything reached the client (chunk 1 waits for 0): a plain
/// requeue as today — no continuation, numbering restarts for the next.
#[test]
fn lost_before_the_first_chunk_is_forwarded_is_a_plain_requeue() {
    let mut w = World::new();
    assert_eq!(leases(&w.claim(0, BUILD, &hash_a())), 1);
    assert!(forwarded(&w.chunk(0, 1, false)).is_empty(), "buffered behind 0");
    let out = w.feed(Input::WorkerDisconnected(w.node(0)));
    assert!(continued(&out).is_none(), "{out:?}");
    assert!(out.iter().any(|e| matches!(e, Effect::Requeue(_))), "{out:?}");
    let job = published(&out).expect("re-announced");
    assert_eq!(job.requirements.continuation, None, "a plain requeue offers no continuation");
    assert_eq!(w.tracker.continuations(), 0);
    assert_eq!(leases(&w.claim(1, "other build", "")), 1, "any capable worker may take it");
    assert_eq!(w.tracker.continuation(), None);
    assert_eq!(forwarded(&w.chunk(1, 0, false)), vec![0], "numbering restarts");
}

/// Lost mid-window, chunks 3 and 4 buffered behind the missing 2: the
/// continuation starts at 2 with the two delivered tokens, only a worker of
/// the same build and file may take it, the old holder's late chunks are
/// refused, and the usage record counts every token once, by holder.
#[test]
fn lost_mid_window_continues_from_the_gap_on_a_matching_worker() {
    let mut w = World::new();
    w.streaming(0, 2);
    let old = w.lease_id();
    assert!(forwarded(&w.chunk(0, 3, false)).is_empty());
    assert!(forwarded(&w.chunk(0, 4, false)).is_empty());
    w.now += 20;
    let out = w.feed(Input::WorkerDisconnected(w.node(0)));
    assert_eq!(failure(&out), None, "no error: the stream continues");
    let (n, rq) = continued(&out).expect("a continuation");
    assert_eq!(n, 1);
    assert_eq!(rq.reason, RequeueReason::WorkerDisconnected);
    assert_eq!(rq.excluded_nodes.last(), Some(&w.node(0)), "the lost holder is left out");
    let job = published(&out).expect("re-announced").clone();
    gcs_protocol::verify(&job).expect("the re-announcement is signed");
    let offer = job.requirements.continuation.clone().expect("an offer");
    assert_eq!((offer.continuation, offer.engine_build.as_str()), (1, BUILD));
    assert_eq!(offer.model_hash, hash_a());
    assert!(job.routing.excluded_nodes.contains(&w.node(0)));
    assert_eq!(w.tracker.state(), JobState::Requeued);

    // Another build, another file: refused by name; the lost holder: excluded.
    assert_eq!(
        rejection(&w.claim(1, "gcs-engine 0.2.0", &hash_a())),
        Some(ClaimRejectReason::ContinuationMismatch)
    );
    assert_eq!(
        rejection(&w.claim(1, BUILD, &"cd".repeat(32))),
        Some(ClaimRejectReason::ContinuationMismatch)
    );
    assert_eq!(rejection(&w.claim(0, BUILD, &hash_a())), Some(ClaimRejectReason::PolicyDenied));
    assert_eq!(leases(&w.claim(2, BUILD, &hash_a())), 1);
    let c = w.tracker.continuation().expect("the new holder's continuation").clone();
    let expected = Continuation {
        version: gcs_protocol::CONTINUATION_VERSION,
        job_id: w.tracker.job.job_id.clone(),
        continuation: 1,
        from_sequence: 2,
        delivered_tokens: vec![100, 101],
        delivered_text_hash: text_hash(0..2),
        seed: SEED,
        engine_build: BUILD.into(),
        model_hash: hash_a(),
    };
    assert_eq!(c, expected);
    c.check().expect("a well-formed continuation");

    // The old holder's late chunks (the missing 2, a new 5): refused.
    assert!(forwarded(&w.chunk_under(0, &old, 2, false)).is_empty());
    assert!(forwarded(&w.chunk_under(0, &old, 5, false)).is_empty());
    // The new holder continues the numbering; 3 and 4 come from it.
    assert_eq!(forwarded(&w.chunk(2, 2, false)), vec![2]);
    assert_eq!(forwarded(&w.chunk(2, 3, false)), vec![3]);
    assert_eq!(forwarded(&w.chunk(2, 4, true)), vec![4]);
    let out = w.result(2, 4);
    assert!(out.iter().any(|e| matches!(e, Effect::Complete(_))), "{out:?}");
    assert!(!out.iter().any(|e| matches!(e, Effect::Strike(_))), "metering within bounds");
    assert_eq!(w.tracker.state(), JobState::Completed);
    let u = w.usage();
    assert_eq!((u.output_tokens_sent_to_client, u.output_tokens_generated), (4, 4));
    assert_eq!(u.input_tokens, 10, "the prompt counted once");
    assert_eq!(u.requeue_count, 0, "a continuation is not a requeue");
    assert_eq!(u.node_id, Some(w.node(2)));
    assert!(!u.failed_after_partial_output);
    let holders = vec![
        HolderTokens { node_id: w.node(0), output_tokens: 2 },
        HolderTokens { node_id: w.node(2), output_tokens: 2 },
    ];
    assert_eq!(u.holders, holders, "who delivered what");
    gcs_protocol::verify(u).expect("the record, holders included, is signed");
    let mut forged = u.clone();
    forged.holders[0].output_tokens = 1;
    assert!(gcs_protocol::verify(&forged).is_err(), "holders are inside the signature");
    use gcs_protocol::SignedMessage as _;
    // (The fixture bills no project or key; a gateway's record names both.)
    let mut ok = u.clone();
    (ok.project_id, ok.api_key_id) = ("proj_1".into(), "key_1".into());
    ok.check_fields(&w.limits).expect("within bounds");
    let mut over = ok.clone();
    over.holders[0].output_tokens = 3;
    assert!(over.check_fields(&w.limits).is_err(), "holders cannot claim more than was sent");
}

/// Lost just before the final result, the finish chunk not yet sent: the
/// new holder sends only the finish chunk; once the finish chunk was
/// forwarded the stream is over and a lost holder is the error of before.
#[test]
fn lost_just_before_the_final_result() {
    let mut w = World::new();
    w.streaming(0, 3);
    let out = w.tick(TrackerConfig::default().lease_term_ms + 1);
    let (_, rq) = continued(&out).expect("lease expiry continues");
    assert_eq!(rq.reason, RequeueReason::WorkerTimeout);
    assert_eq!(leases(&w.claim(1, BUILD, &hash_a())), 1);
    assert_eq!(w.tracker.continuation().map(|c| c.from_sequence), Some(3));
    assert_eq!(forwarded(&w.chunk(1, 3, true)), vec![3]);
    assert!(w.result(1, 3).iter().any(|e| matches!(e, Effect::Complete(_))));

    let mut w = World::new();
    w.streaming(0, 3);
    assert_eq!(forwarded(&w.chunk(0, 3, true)), vec![3]);
    let out = w.feed(Input::WorkerDisconnected(w.node(0)));
    assert!(continued(&out).is_none());
    assert_eq!(failure(&out), Some(("gnus_worker_lost", true)), "{out:?}");
}

/// A failed result after partial output is a loss like any other.
#[test]
fn a_holder_that_fails_mid_stream_is_continued() {
    let mut w = World::new();
    w.streaming(0, 2);
    let key = &w.workers[0];
    let mut r = samples::final_result(key, &Params { now_ms: w.now, ..Params::default() });
    r.job_id = w.tracker.job.job_id.clone();
    r.lease_id = w.tracker.lease().map(|l| l.lease_id.clone());
    r.status = ResultStatus::Failed;
    r.response = None;
    r.metering = None;
    r.error = Some(err("server_error", "gnus_engine_error", "out of memory"));
    sign(&mut r, key).unwrap();
    let out = w.feed(Input::Result(Box::new(r)));
    assert_eq!(
        continued(&out).map(|(n, rq)| (n, rq.reason)),
        Some((1, RequeueReason::InvalidResult))
    );
}

/// `gnus.continuation: "off"` (max_continuations 0): today's error.
#[test]
fn off_keeps_the_error() {
    let mut w = World::with(|j| j.limits.max_continuations = 0);
    w.streaming(0, 2);
    let out = w.feed(Input::WorkerDisconnected(w.node(0)));
    assert!(continued(&out).is_none());
    assert_eq!(failure(&out), Some(("gnus_worker_lost", true)));
    assert_eq!(w.usage().output_tokens_sent_to_client, 2);
    assert!(w.usage().failed_after_partial_output);
    assert!(w.usage().holders.is_empty(), "a job that never continued lists no holders");
}

/// At most MAX_CONTINUATIONS per job: the fifth loss is the error.
#[test]
fn the_fifth_loss_is_the_error() {
    let mut w = World::new();
    w.streaming(0, 1);
    for k in 1..=MAX_CONTINUATIONS as usize {
        let out = w.feed(Input::WorkerDisconnected(w.node(k - 1)));
        assert_eq!(continued(&out).map(|(n, _)| n), Some(k as u32), "loss {k}");
        assert_eq!(leases(&w.claim(k, BUILD, &hash_a())), 1);
        let c = w.tracker.continuation().expect("continuation").clone();
        assert_eq!((c.continuation, c.from_sequence), (k as u32, k as u64));
        assert_eq!(forwarded(&w.chunk(k, k as u64, false)), vec![k as u64]);
    }
    let last = MAX_CONTINUATIONS as usize;
    let out = w.feed(Input::WorkerDisconnected(w.node(last)));
    assert!(continued(&out).is_none(), "{out:?}");
    assert_eq!(failure(&out), Some(("gnus_worker_lost", true)));
    assert_eq!(w.tracker.continuations(), MAX_CONTINUATIONS);
    let shares = w.tracker.holder_shares();
    assert_eq!(shares.len(), last + 1);
    assert!(shares.iter().all(|s| s.output_tokens == 1), "{shares:?}");
    assert_eq!(w.usage().output_tokens_sent_to_client, last as u64 + 1);
}

/// Worker 0 of `w` forwarded two chunks and disconnected, at a gateway
/// whose queue timeout is `queue_timeout_ms`: the continuation is announced.
fn lost_after_two_chunks(mut w: World, queue_timeout_ms: u64) -> World {
    w.tracker.config.queue_timeout_ms = queue_timeout_ms;
    w.streaming(0, 2);
    assert!(continued(&w.feed(Input::WorkerDisconnected(w.node(0)))).is_some());
    w
}

/// A continuation no worker claims in its round is announced again, round
/// after round, until the queue timeout after the loss: a matching worker
/// that frees a slot (or finishes starting) later still continues the
/// stream, from the same point.
#[test]
fn an_unclaimed_continuation_is_announced_again_until_one_claims_it() {
    let mut w = lost_after_two_chunks(World::new(), 5_000);
    let round = w.tracker.job.limits.claim_timeout_ms;
    for _ in 0..3 {
        let out = w.tick(round);
        assert!(failure(&out).is_none(), "{out:?}");
        let job = published(&out).expect("announced again");
        assert!(job.requirements.continuation.is_some(), "{job:?}");
        assert!(job.routing.excluded_nodes.contains(&w.node(0)), "{job:?}");
    }
    assert_eq!(leases(&w.claim(1, BUILD, &hash_a())), 1);
    assert_eq!(forwarded(&w.chunk(1, 2, false)), vec![2]);
    assert_eq!(w.tracker.continuation().map(|c| c.delivered_tokens.len()), Some(2));
}

/// The wait is bounded: no claim by the queue timeout after the loss is
/// the error of before.
#[test]
fn an_unclaimed_continuation_fails_at_the_queue_timeout() {
    let mut w = lost_after_two_chunks(World::new(), 5_000);
    let round = w.tracker.job.limits.claim_timeout_ms;
    for _ in 0..4 {
        assert!(failure(&w.tick(round)).is_none(), "still waiting");
    }
    let out = w.tick(5_000 - 4 * round);
    assert_eq!(failure(&out), Some(("gnus_worker_lost", true)), "{out:?}");
    assert_eq!(w.usage().output_tokens_sent_to_client, 2);
}

/// Nor past the stream's idle timeout (counted from the last chunk), which
/// would otherwise end the stream at the edge as idle, not as lost.
#[test]
fn an_unclaimed_continuation_waits_no_longer_than_the_idle_timeout() {
    let w = World::with(|j| j.limits.idle_stream_timeout_ms = 2_500);
    let mut w = lost_after_two_chunks(w, 60_000);
    let round = w.tracker.job.limits.claim_timeout_ms;
    assert!(failure(&w.tick(round)).is_none(), "still waiting");
    assert!(failure(&w.tick(round)).is_none(), "still waiting");
    let out = w.tick(round);
    assert_eq!(failure(&out), Some(("gnus_worker_lost", true)), "{out:?}");
}

/// No matching claim in the claim round (a gateway whose queue timeout is
/// 0): the error of before, after partial output.
#[test]
fn no_matching_claim_before_the_claim_timeout_is_the_error() {
    let mut w = World::new();
    w.streaming(0, 2);
    assert!(continued(&w.feed(Input::WorkerDisconnected(w.node(0)))).is_some());
    assert_eq!(
        rejection(&w.claim(1, "gcs-engine 9", &hash_a())),
        Some(ClaimRejectReason::ContinuationMismatch)
    );
    let claim_timeout = w.tracker.job.limits.claim_timeout_ms;
    assert!(failure(&w.tick(claim_timeout - 1)).is_none(), "still waiting");
    let out = w.tick(1);
    assert_eq!(failure(&out), Some(("gnus_worker_lost", true)), "{out:?}");
    assert!(w.tracker.state().is_terminal());
    assert_eq!(w.usage().output_tokens_sent_to_client, 2);
}

/// Every allowed token delivered and only the finish missing: nothing is
/// left to continue, so the error comes at once, with no claim round.
#[test]
fn a_stream_lost_with_all_its_tokens_delivered_is_not_offered() {
    let mut w = World::with(|j| j.requirements.max_output_tokens = 3);
    w.streaming(0, 3);
    let out = w.feed(Input::WorkerDisconnected(w.node(0)));
    assert!(continued(&out).is_none(), "{out:?}");
    assert_eq!(failure(&out), Some(("gnus_worker_lost", true)));
    assert_eq!(w.usage().output_tokens_sent_to_client, 3);
}

/// A holder whose registration advertised no build or file cannot be
/// matched: the error of before.
#[test]
fn an_unadvertised_build_cannot_be_continued() {
    let mut w = World::new();
    assert_eq!(leases(&w.claim(0, "", "")), 1);
    assert_eq!(forwarded(&w.chunk(0, 0, false)), vec![0]);
    let out = w.feed(Input::WorkerDisconnected(w.node(0)));
    assert_eq!(failure(&out), Some(("gnus_worker_lost", true)));
}

/// The wall timeout still holds: no continuation is offered when less than
/// a claim round is left, and the wall timeout ends a continued job.
#[test]
fn the_wall_deadline_is_respected() {
    let mut w = World::new();
    w.streaming(0, 1);
    let l = w.tracker.job.limits.clone();
    w.now = w.tracker.job.created_at_ms + l.wall_timeout_ms - l.claim_timeout_ms;
    let out = w.feed(Input::WorkerDisconnected(w.node(0)));
    assert!(continued(&out).is_none(), "{out:?}");
    assert_eq!(failure(&out), Some(("gnus_worker_lost", true)));

    let mut w = World::with(|j| j.limits.claim_timeout_ms = 60_000);
    w.streaming(0, 1);
    w.now = w.tracker.job.created_at_ms + w.tracker.job.limits.wall_timeout_ms - 60_001;
    assert!(continued(&w.feed(Input::WorkerDisconnected(w.node(0)))).is_some());
    assert_eq!(leases(&w.claim(1, BUILD, &hash_a())), 1);
    assert!(failure(&w.tick(1_000)).is_none(), "the new holder runs");
    let out = w.tick(59_001);
    assert_eq!(failure(&out).map(|f| f.0), Some("gnus_wall_timeout"), "{out:?}");
    assert!(out.iter().any(|e| matches!(e, Effect::Cancel(_))), "the new holder is stopped");
}

/// The new holder's replay of the delivered prefix is not a stalled
/// stream: the idle timer starts at the continuation's grant.
#[test]
fn the_idle_timer_restarts_at_the_continuation_grant() {
    let mut w = World::new();
    w.streaming(0, 2);
    let idle = w.tracker.job.limits.idle_stream_timeout_ms;
    w.now += idle - 100;
    assert!(continued(&w.feed(Input::WorkerDisconnected(w.node(0)))).is_some());
    w.now += 50;
    assert_eq!(leases(&w.claim(1, BUILD, &hash_a())), 1);
    for _ in 0..3 {
        // Renewals keep the lease; no chunk comes for most of the idle bound.
        assert!(failure(&w.tick(idle / 4)).is_none());
        let lease = w.tracker.lease().unwrap().clone();
        let mut r = samples::renewal(&w.workers[1], &Params { now_ms: w.now, ..Params::default() });
        r.job_id = lease.job_id.clone();
        r.lease_id = lease.lease_id.clone();
        sign(&mut r, &w.workers[1]).unwrap();
        w.feed(Input::Renewal(r));
    }
    assert_eq!(forwarded(&w.chunk(1, 2, false)), vec![2]);
}

fn revokes(e: &[Effect]) -> Vec<(&NodeId, &gcs_protocol::Cancellation)> {
    e.iter()
        .filter_map(|e| match e {
            Effect::Revoke { holder, cancellation } => Some((holder, cancellation)),
            _ => None,
        })
        .collect()
}

/// Between the loss and the continuation's grant the lost lease is
/// already revoked: a late chunk of the old holder (a paused worker waking
/// up, a cut-off one healed) is refused and does not move the point the
/// new holder resumes from, so the client sees nothing twice.
#[test]
fn a_late_chunk_between_the_loss_and_the_grant_is_refused() {
    let mut w = World::new();
    w.streaming(0, 2);
    let old = w.lease_id();
    assert!(continued(&w.tick(TrackerConfig::default().lease_term_ms + 1)).is_some());
    assert!(forwarded(&w.chunk_under(0, &old, 2, false)).is_empty(), "refused before the grant");
    assert_eq!(leases(&w.claim(1, BUILD, &hash_a())), 1);
    let c = w.tracker.continuation().expect("a continuation").clone();
    assert_eq!((c.from_sequence, c.delivered_tokens), (2, vec![100, 101]));
    assert_eq!(forwarded(&w.chunk(1, 2, false)), vec![2], "chunk 2 is the new holder's");
}

/// The lost holder is told to stop under its old lease as soon as the
/// lease is revoked (it may be paused or cut off, not dead); its first late
/// chunk or renewal after that gets the cancel once more (the first may not
/// have reached it), and no more after that.
#[test]
fn the_lost_holder_is_cancelled_under_its_revoked_lease() {
    let mut w = World::new();
    w.streaming(0, 3);
    let old = w.lease_id();
    let out = w.tick(TrackerConfig::default().lease_term_ms + 1);
    assert!(continued(&out).is_some());
    let r = revokes(&out);
    assert_eq!(r.len(), 1, "{out:?}");
    let (holder, c) = r[0];
    assert_eq!(holder, &w.node(0));
    assert_eq!(c.lease_id.as_deref(), Some(old.as_str()), "names the revoked lease only");
    assert_eq!((c.last_sequence_sent, c.partial_usage.output_tokens_sent), (Some(2), 3));
    assert_eq!(c.issued_by, w.gw.node_id());
    gcs_protocol::verify(c).expect("signed by the gateway");
    assert!(!out.iter().any(|e| matches!(e, Effect::Cancel(_))), "not the job's cancellation");

    assert_eq!(leases(&w.claim(1, BUILD, &hash_a())), 1);
    let out = w.chunk_under(0, &old, 3, false);
    assert!(forwarded(&out).is_empty());
    assert_eq!(revokes(&out).len(), 1, "sent again on its first late chunk");
    assert!(revokes(&w.chunk_under(0, &old, 4, false)).is_empty(), "once");
    let mut rn = samples::renewal(&w.workers[0], &Params { now_ms: w.now, ..Params::default() });
    rn.job_id = w.tracker.job.job_id.clone();
    rn.lease_id = old.clone();
    sign(&mut rn, &w.workers[0]).unwrap();
    assert!(w.feed(Input::Renewal(rn)).is_empty(), "its renewal is not honoured");
    // Someone else's chunk under that lease id is no reason to send one.
    let mut w2 = World::new();
    w2.streaming(0, 1);
    let old = w2.lease_id();
    w2.feed(Input::WorkerDisconnected(w2.node(0)));
    assert!(revokes(&w2.chunk_under(3, &old, 1, false)).is_empty());
    // ...and the new holder's cancel at the job's end is the usual one.
    assert!(revokes(&w.result(1, 3)).is_empty());
}

/// The seam is timed in its parts: last chunk before the loss → loss
/// detected (here the lease expiry), → continuation leased, → the first
/// continued chunk forwarded; once per continuation.
#[test]
fn the_seam_is_timed_in_its_parts() {
    let mut w = World::new();
    w.streaming(0, 3);
    let term = TrackerConfig::default().lease_term_ms;
    assert!(continued(&w.tick(term + 1)).is_some());
    w.now += 30;
    assert_eq!(leases(&w.claim(1, BUILD, &hash_a())), 1);
    w.now += 200;
    let out = w.chunk(1, 3, false);
    let seam = out.iter().find_map(|e| if let Effect::Seam(s) = e { Some(*s) } else { None });
    let seam = seam.expect("the first continued chunk closes the seam");
    assert_eq!(seam, Seam { detect_ms: term + 1, claim_ms: 30, resume_ms: 200 });
    assert_eq!(seam.total_ms(), term + 231);
    w.now += 10;
    assert!(!w.chunk(1, 4, false).iter().any(|e| matches!(e, Effect::Seam(_))), "once");
}
