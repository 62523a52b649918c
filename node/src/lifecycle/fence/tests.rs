use super::*;
use gcs_protocol::samples::{self, Params};
use gcs_protocol::{ids, sign, FinishReason, NodeKey};
use proptest::prelude::*;

const JOB_T: u64 = 1_783_468_800_000;

fn job_id() -> String {
    samples::chunk(&samples::keys().0, &Params::default()).job_id
}

fn chunk(key: &NodeKey, lease: &str, seq: u64, last: bool) -> StreamChunk {
    let mut c = samples::chunk(key, &Params { text: format!("t{seq} "), n: seq, now_ms: JOB_T });
    c.lease_id = lease.into();
    if last {
        c.finish_reason = Some(FinishReason::Stop);
    }
    sign(&mut c, key).unwrap();
    c
}

fn lease(n: u128) -> String {
    ids::id_from_parts(ids::LEASE, JOB_T, n)
}

fn seqs(v: &Verdict) -> Vec<u64> {
    match v {
        Verdict::Deliver(cs) => cs.iter().map(|c| c.sequence).collect(),
        _ => vec![],
    }
}

fn fence_with(holder: &NodeKey, l: &str) -> StreamFence {
    let mut f = StreamFence::new(&job_id(), FenceConfig::default());
    f.grant(l, holder.node_id());
    f
}

#[test]
fn in_order_chunks_are_delivered_and_duplicates_dropped() {
    let (w, _) = samples::keys();
    let mut f = fence_with(&w, &lease(1));
    assert_eq!(seqs(&f.on_chunk(chunk(&w, &lease(1), 0, false), 0)), vec![0]);
    assert_eq!(f.on_chunk(chunk(&w, &lease(1), 0, false), 1), Verdict::Duplicate);
    assert_eq!(seqs(&f.on_chunk(chunk(&w, &lease(1), 1, false), 2)), vec![1]);
    assert!(f.started());
    assert_eq!(f.delivered_tokens(), 2);
}

#[test]
fn small_gaps_are_buffered_and_released_in_order() {
    let (w, _) = samples::keys();
    let mut f = fence_with(&w, &lease(1));
    assert_eq!(f.on_chunk(chunk(&w, &lease(1), 2, false), 0), Verdict::Buffered);
    assert_eq!(f.on_chunk(chunk(&w, &lease(1), 1, false), 10), Verdict::Buffered);
    assert_eq!(f.on_chunk(chunk(&w, &lease(1), 2, false), 11), Verdict::Duplicate);
    assert_eq!(seqs(&f.on_chunk(chunk(&w, &lease(1), 0, false), 20)), vec![0, 1, 2]);
    assert_eq!(f.on_tick(10_000), None, "no gap left");
}

#[test]
fn a_gap_larger_than_eight_fails_the_stream() {
    let (w, _) = samples::keys();
    let mut f = fence_with(&w, &lease(1));
    assert_eq!(
        f.on_chunk(chunk(&w, &lease(1), 9, false), 0),
        Verdict::Failed(FenceFailure::GapTooLarge { expected: 0, got: 9 })
    );
    assert_eq!(
        f.on_chunk(chunk(&w, &lease(1), 0, false), 1),
        Verdict::Rejected(Rejected::AfterEnd)
    );
}

#[test]
fn a_gap_open_longer_than_250_ms_fails_the_stream() {
    let (w, _) = samples::keys();
    let mut f = fence_with(&w, &lease(1));
    assert_eq!(f.on_chunk(chunk(&w, &lease(1), 1, false), 1000), Verdict::Buffered);
    assert_eq!(f.on_tick(1250), None);
    assert_eq!(f.on_tick(1251), Some(FenceFailure::PersistentGap { missing: 0 }));
    assert!(f.ended());
}

#[test]
fn chunks_from_a_previous_lease_holder_are_rejected_despite_valid_signatures() {
    let (w, _) = samples::keys();
    let other = NodeKey::from_seed([3; 32]);
    let mut f = fence_with(&w, &lease(1));
    f.on_chunk(chunk(&w, &lease(1), 0, false), 0);
    // Requeued before... (here: after) — the new holder gets a new lease.
    f.grant(&lease(2), other.node_id());
    assert_eq!(
        f.on_chunk(chunk(&w, &lease(1), 1, false), 1),
        Verdict::Rejected(Rejected::NotLeaseHolder)
    );
    assert_eq!(seqs(&f.on_chunk(chunk(&other, &lease(2), 0, false), 2)), vec![0]);
    // Same node re-granted under a new lease: its old-lease chunks are stale.
    f.grant(&lease(3), other.node_id());
    assert_eq!(
        f.on_chunk(chunk(&other, &lease(2), 1, false), 3),
        Verdict::Rejected(Rejected::StaleLease)
    );
}

#[test]
fn forged_and_foreign_chunks_are_rejected() {
    let (w, _) = samples::keys();
    let mut f = fence_with(&w, &lease(1));
    let mut forged = chunk(&w, &lease(1), 0, false);
    forged.delta.content = Some("injected".into());
    assert_eq!(f.on_chunk(forged, 0), Verdict::Rejected(Rejected::BadSignature));
    let mut foreign = chunk(&w, &lease(1), 0, false);
    foreign.job_id = ids::id_from_parts(ids::JOB, 5, 5);
    assert_eq!(f.on_chunk(foreign, 0), Verdict::Rejected(Rejected::WrongJob));
    let mut unleased = StreamFence::new(&job_id(), FenceConfig::default());
    assert_eq!(
        unleased.on_chunk(chunk(&w, &lease(1), 0, false), 0),
        Verdict::Rejected(Rejected::NotLeaseHolder)
    );
}

#[test]
fn nothing_after_the_terminal_chunk_is_forwarded() {
    let (w, _) = samples::keys();
    let mut f = fence_with(&w, &lease(1));
    // 2 arrives (buffered), then the terminal 1 releases... only up to 1.
    assert_eq!(f.on_chunk(chunk(&w, &lease(1), 2, false), 0), Verdict::Buffered);
    assert_eq!(f.on_chunk(chunk(&w, &lease(1), 1, true), 0), Verdict::Buffered);
    assert_eq!(seqs(&f.on_chunk(chunk(&w, &lease(1), 0, false), 0)), vec![0, 1]);
    assert!(f.ended());
    assert_eq!(
        f.on_chunk(chunk(&w, &lease(1), 3, false), 0),
        Verdict::Rejected(Rejected::AfterEnd)
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Shuffled (within a window), duplicated, delayed deliveries plus chunks
    /// from a stale lease: what reaches the client is always a gap-free,
    /// duplicate-free prefix of the worker's output, complete unless the
    /// stream failed.
    #[test]
    fn client_stream_is_always_a_prefix_of_the_worker_output(
        n in 1u64..40,
        swaps in prop::collection::vec((0usize..64, 0usize..4), 0..40),
        dups in prop::collection::vec(0usize..64, 0..20),
        delays in prop::collection::vec(0u64..400, 0..80),
        stale in prop::collection::vec(0u64..40, 0..5),
    ) {
        let (w, _) = samples::keys();
        let mut f = fence_with(&w, &lease(1));
        let out: Vec<StreamChunk> = (0..n).map(|s| chunk(&w, &lease(1), s, s == n - 1)).collect();
        let mut arrivals: Vec<StreamChunk> = out.clone();
        for (i, d) in swaps {
            let (i, j) = (i % arrivals.len(), (i + d) % arrivals.len());
            arrivals.swap(i, j);
        }
        for d in dups {
            let c = arrivals[d % arrivals.len()].clone();
            arrivals.insert(d % arrivals.len(), c);
        }
        for s in stale {
            arrivals.insert((s as usize) % arrivals.len(), chunk(&w, &lease(0), s, false));
        }
        let mut got = vec![];
        let mut t = 0u64;
        for (i, c) in arrivals.into_iter().enumerate() {
            t += delays.get(i).copied().unwrap_or(1);
            if f.on_tick(t).is_some() { break; }
            match f.on_chunk(c, t) {
                Verdict::Deliver(cs) => got.extend(cs),
                Verdict::Failed(_) => break,
                _ => {}
            }
        }
        let got_seqs: Vec<u64> = got.iter().map(|c| c.sequence).collect();
        prop_assert_eq!(&got_seqs, &(0..got.len() as u64).collect::<Vec<_>>());
        prop_assert!(got.iter().zip(&out).all(|(a, b)| a == b));
        // Every chunk of the worker arrived at least once, so the stream is
        // over: complete (ended, nothing failed) or failed, never still open.
        prop_assert!(f.ended(), "every chunk arrived, yet the stream is still open");
        prop_assert_eq!(got.len() as u64 == n, f.failure().is_none(),
            "complete exactly when nothing failed ({} of {} delivered)", got.len(), n);
        prop_assert_eq!(f.delivered_tokens(), got.len() as u64);
    }
}
