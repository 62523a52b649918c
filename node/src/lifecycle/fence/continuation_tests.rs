//! The fence at each point a lease holder can be lost, for an exact
//! continuation: what the client received is the continuation point, the
//! new holder's chunks continue the numbering, the old holder's are refused.

use super::*;
use gcs_protocol::samples::{self, Params};
use gcs_protocol::{ids, sign, FinishReason, NodeKey};

const JOB_T: u64 = 1_783_468_800_000;

fn job_id() -> String {
    samples::chunk(&samples::keys().0, &Params::default()).job_id
}

fn lease(n: u128) -> String {
    ids::id_from_parts(ids::LEASE, JOB_T, n)
}

/// Chunk `seq` of `key` under `lease`: text `t{seq} `, one token, id
/// `100 + seq` (none when `with_ids` is false).
fn chunk(key: &NodeKey, lease: &str, seq: u64, last: bool, with_ids: bool) -> StreamChunk {
    let mut c = samples::chunk(key, &Params { text: format!("t{seq} "), n: seq, now_ms: JOB_T });
    c.lease_id = lease.into();
    if with_ids {
        c.delta.token_ids = vec![100 + seq as u32];
    }
    if last {
        c.finish_reason = Some(FinishReason::Stop);
    }
    sign(&mut c, key).unwrap();
    c
}

fn seqs(v: &Verdict) -> Vec<u64> {
    match v {
        Verdict::Deliver(cs) => cs.iter().map(|c| c.sequence).collect(),
        _ => vec![],
    }
}

fn text_hash(seqs: std::ops::Range<u64>) -> Hash32 {
    let t: String = seqs.map(|s| format!("t{s} ")).collect();
    Hash32::of(t.as_bytes())
}

fn keys() -> (NodeKey, NodeKey) {
    (samples::keys().0, NodeKey::from_seed([9; 32]))
}

/// Lost before the first chunk was forwarded (chunk 1 waits for 0): no
/// continuation point — the worker is simply replaced, numbering restarts.
#[test]
fn lost_before_the_first_chunk_is_forwarded_has_no_continuation_point() {
    let (old, _) = keys();
    let mut f = StreamFence::new(&job_id(), FenceConfig::default());
    f.grant(&lease(1), old.node_id());
    assert_eq!(f.continuation_point(), None, "nothing at all yet");
    assert_eq!(f.on_chunk(chunk(&old, &lease(1), 1, false, true), 0), Verdict::Buffered);
    assert_eq!(f.continuation_point(), None, "a buffered chunk reached no client");
}

/// Lost mid-window: 0..=2 forwarded, 4 and 5 buffered behind the missing
/// 3. The point is sequence 3 with the ids and text of 0..=2; the buffered
/// chunks are dropped; the old holder's late 3 is refused; the new
/// holder's 3, 4, 5 are forwarded and its replays of earlier numbers are
/// duplicates.
#[test]
fn lost_mid_window_continues_from_the_first_unforwarded_sequence() {
    let (old, new) = keys();
    let mut f = StreamFence::new(&job_id(), FenceConfig::default());
    f.grant(&lease(1), old.node_id());
    for s in 0..3 {
        assert_eq!(seqs(&f.on_chunk(chunk(&old, &lease(1), s, false, true), s)), vec![s]);
    }
    for s in [4, 5] {
        assert_eq!(f.on_chunk(chunk(&old, &lease(1), s, false, true), 10), Verdict::Buffered);
    }
    let p = f.continuation_point().unwrap();
    assert_eq!(p.from_sequence, 3);
    assert_eq!(p.delivered_tokens, vec![100, 101, 102]);
    assert_eq!(p.delivered_text_hash, text_hash(0..3));

    f.continue_with(&lease(2), new.node_id());
    assert_eq!(f.on_tick(10_000), None, "the old holder's buffered chunks are gone");
    assert_eq!(
        f.on_chunk(chunk(&old, &lease(1), 3, false, true), 20),
        Verdict::Rejected(Rejected::NotLeaseHolder),
        "the old holder's late chunk"
    );
    assert_eq!(f.on_chunk(chunk(&new, &lease(2), 2, false, true), 21), Verdict::Duplicate);
    assert_eq!(seqs(&f.on_chunk(chunk(&new, &lease(2), 3, false, true), 22)), vec![3]);
    assert_eq!(f.on_chunk(chunk(&new, &lease(2), 5, true, true), 23), Verdict::Buffered);
    assert_eq!(seqs(&f.on_chunk(chunk(&new, &lease(2), 4, false, true), 24)), vec![4, 5]);
    assert!(f.ended());
    assert_eq!(f.delivered_tokens(), 6, "every token counted once across the seam");
    assert_eq!(f.continuation_point(), None, "the stream is complete");
}

/// Lost just before the final result: every token forwarded, the finish
/// chunk not yet — the point holds every token and the new holder only
/// sends the finish. Once the finish chunk is forwarded there is nothing
/// to continue.
#[test]
fn lost_just_before_the_finish_continues_with_every_token() {
    let (old, new) = keys();
    let mut f = StreamFence::new(&job_id(), FenceConfig::default());
    f.grant(&lease(1), old.node_id());
    for s in 0..4 {
        f.on_chunk(chunk(&old, &lease(1), s, false, true), s);
    }
    let p = f.continuation_point().unwrap();
    assert_eq!((p.from_sequence, p.delivered_tokens.len()), (4, 4));
    assert_eq!(p.delivered_text_hash, text_hash(0..4));
    f.continue_with(&lease(2), new.node_id());
    assert_eq!(seqs(&f.on_chunk(chunk(&new, &lease(2), 4, true, true), 10)), vec![4]);
    assert!(f.ended());
    assert_eq!(
        f.on_chunk(chunk(&old, &lease(1), 4, true, true), 11),
        Verdict::Rejected(Rejected::NotLeaseHolder)
    );
}

/// A forwarded chunk without token ids (a worker that does not report
/// them) makes the stream not continuable: the caller falls back to
/// `gnus_worker_lost`.
#[test]
fn a_chunk_without_token_ids_makes_the_stream_not_continuable() {
    let (old, _) = keys();
    let mut f = StreamFence::new(&job_id(), FenceConfig::default());
    f.grant(&lease(1), old.node_id());
    f.on_chunk(chunk(&old, &lease(1), 0, false, true), 0);
    assert!(f.continuation_point().is_some());
    f.on_chunk(chunk(&old, &lease(1), 1, false, false), 1);
    assert_eq!(f.continuation_point(), None);
}
