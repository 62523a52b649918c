//! A misbehaving peer, in process: the gateway's real `JobTracker` (with
//! its stream fence) receives an honest worker's stream mixed with
//! duplicates, local reorderings, forged chunks (altered text, the honest
//! signature kept), chunks signed by an outsider, and validly signed
//! chunks from a previous lease holder. Whatever the mix, the client side
//! must see exactly the honest stream, once, in order. (A replayed copy is
//! placed after its original: a copy arriving far ahead of the stream is a
//! gap, which the fence rightly fails once it exceeds the reorder window.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gcs_node::lifecycle::tracker::{Effect, Input, JobTracker, TrackerConfig};
use gcs_protocol::samples::{self, Params};
use gcs_protocol::{ids, sign, FinishReason, Limits, NodeKey, StreamChunk};
use proptest::prelude::*;

const T0: u64 = 1_783_468_800_000;

struct Gw {
    key: NodeKey,
    tracker: JobTracker,
    limits: Limits,
    now: u64,
    out: Vec<Effect>,
}

impl Gw {
    fn feed(&mut self, i: Input) {
        self.now += 1;
        let e = self.tracker.handle(i, self.now, &self.key, &self.limits);
        self.out.extend(e);
    }

    fn claim(&mut self, w: &NodeKey) {
        let p = Params { now_ms: self.now - 100, ..Params::default() };
        let mut reg = samples::registration(w, &p);
        reg.queue.current_api_jobs = 0;
        sign(&mut reg, w).unwrap();
        let mut c = samples::claim(w, &p);
        c.job_id = self.job_id();
        c.claim_id = ids::new_id(ids::CLAIM, self.now).unwrap();
        sign(&mut c, w).unwrap();
        self.feed(Input::Claim(Box::new(c), Some(Box::new(reg))));
    }

    fn job_id(&self) -> String {
        self.tracker.lease().map(|l| l.job_id.clone()).unwrap_or_else(|| {
            let gw = samples::keys().1;
            samples::api_job(&gw, &Params::default()).job_id
        })
    }

    fn lease_id(&self) -> String {
        self.tracker.lease().map(|l| l.lease_id.clone()).unwrap()
    }
}

fn chunk(w: &NodeKey, job: &str, lease: &str, seq: u64, text: &str, last: bool) -> StreamChunk {
    let mut c = samples::chunk(w, &Params { text: text.into(), n: seq, now_ms: T0 });
    c.job_id = job.into();
    c.lease_id = lease.into();
    c.finish_reason = last.then_some(FinishReason::Length);
    sign(&mut c, w).unwrap();
    c
}

/// What the adversary adds to the honest stream.
#[derive(Clone, Debug)]
enum Noise {
    Duplicate(usize),
    Forged(usize),
    Outsider(usize),
    StaleHolder(usize),
}

fn noise() -> impl Strategy<Value = Noise> {
    prop_oneof![
        (0usize..64).prop_map(Noise::Duplicate),
        (0usize..64).prop_map(Noise::Forged),
        (0usize..64).prop_map(Noise::Outsider),
        (0usize..64).prop_map(Noise::StaleHolder),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn client_sees_exactly_the_honest_stream(
        n in 1usize..16,
        swaps in prop::collection::vec(0usize..64, 0..6),
        noise in prop::collection::vec((noise(), 0usize..64), 0..24),
    ) {
        let gw_key = samples::keys().1;
        let mut job = samples::api_job(&gw_key, &Params::default());
        sign(&mut job, &gw_key).unwrap();
        let config = TrackerConfig { queue_timeout_ms: 0, ..TrackerConfig::default() };
        let (tracker, out) = JobTracker::new(job.clone(), config, T0);
        let mut gw = Gw { key: gw_key, tracker, limits: Limits::default(), now: T0, out };
        let (stale, honest, outsider) =
            (NodeKey::from_seed([1; 32]), NodeKey::from_seed([2; 32]), NodeKey::from_seed([3; 32]));
        // The first holder is lost before its first token: the job moves to
        // the honest worker, and the first holder's lease becomes stale.
        gw.claim(&stale);
        let stale_lease = gw.lease_id();
        gw.feed(Input::WorkerDisconnected(stale.node_id()));
        gw.claim(&honest);
        let lease = gw.lease_id();
        let texts: Vec<String> = (0..n).map(|i| format!("t{i} ")).collect();
        let good: Vec<StreamChunk> = (0..n)
            .map(|i| chunk(&honest, &job.job_id, &lease, i as u64, &texts[i], i + 1 == n))
            .collect();
        // Local reordering: adjacent swaps, fewer than the reorder window.
        let mut wire = good.clone();
        for s in swaps {
            if wire.len() > 1 {
                let i = s % (wire.len() - 1);
                wire.swap(i, i + 1);
            }
        }
        for (kind, at) in noise {
            let (c, after) = match kind {
                // A copy can only be replayed once the original was sent.
                Noise::Duplicate(i) => {
                    // The original is the honest chunk itself, not a forged
                    // copy with its sequence number (a valid chunk far ahead
                    // of the stream is a gap the fence rightly fails on).
                    let orig = wire.iter().position(|c| *c == good[i % n]);
                    (good[i % n].clone(), orig.map_or(0, |p| p + 1))
                }
                Noise::Forged(i) => {
                    let mut c = good[i % n].clone();
                    c.delta.content = Some("EVIL ".into());
                    (c, 0)
                }
                Noise::Outsider(i) => {
                    (chunk(&outsider, &job.job_id, &lease, (i % n) as u64, "EVIL ", false), 0)
                }
                Noise::StaleHolder(i) => {
                    (chunk(&stale, &job.job_id, &stale_lease, (i % n) as u64, "EVIL ", false), 0)
                }
            };
            let pos = after + at % (wire.len() + 1 - after);
            wire.insert(pos, c);
        }
        for c in wire {
            gw.feed(Input::Chunk(Box::new(c)));
        }
        let mut delivered = String::new();
        for e in &gw.out {
            match e {
                Effect::Forward(cs) => {
                    for c in cs {
                        delivered.push_str(c.delta.content.as_deref().unwrap_or(""));
                    }
                }
                Effect::Fail { error, .. } => prop_assert!(false, "stream failed: {error:?}"),
                _ => {}
            }
        }
        prop_assert_eq!(delivered, texts.concat());
        prop_assert_eq!(gw.tracker.delivered_tokens(), n as u64);
    }
}
