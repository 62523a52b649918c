//! The replay over the grow-only set of processing records: replicas that
//! received a contest's locks in opposite orders keep both and agree on
//! the holder (the queue's rule, not the register's last writer), and every
//! expiry of a subtask's locks counts on every replica.
#![allow(clippy::unwrap_used)]

use gcs_keyspace::{keys, MergeOutcome};
use gcs_protocol::NodeKey;

use super::records::*;
use super::records_tests::{lock, record, result, signed_delta, store, two, NOW, TASK};
use crate::replication::merge_scoped;

const EARLY: &str = "lock_01JDZ0000000000000000000E1";
const LATE: &str = "lock_01JDZ0000000000000000000E2";

#[test]
fn a_contest_winner_arriving_after_the_loser_is_kept_and_its_result_counts_everywhere() {
    let (_da, a, _db, b, trust, w1, gateway) = two();
    let w2 = NodeKey::from_seed([9; 32]);
    for ks in [&a, &b] {
        write(ks, &keys::processing_task(TASK), record(&gateway, 1), &gateway, &trust, NOW)
            .unwrap();
    }
    let key = |id: &str| keys::processing_lock(&format!("{TASK}/s0"), id);
    // w1 locks s0 on a (later), w2 on b (earlier, within the contest window).
    let late = write(&a, &key(LATE), lock("s0", LATE, &w1, NOW + 2_000), &w1, &trust, NOW + 2_000)
        .unwrap();
    let early =
        write(&b, &key(EARLY), lock("s0", EARLY, &w2, NOW + 1_000), &w2, &trust, NOW + 1_000)
            .unwrap();
    // The earlier lock wins on a although a's own write is newer: both are kept.
    assert!(matches!(
        merge_scoped(&a, early, &[], &trust, NOW + 2_500).unwrap(),
        MergeOutcome::Changed(_)
    ));
    assert!(merge_scoped(&b, late, &[], &trust, NOW + 2_500).is_err(), "b keeps w2's");
    let rkey = keys::processing_result(&format!("{TASK}/s0"), &w2.node_id().to_string());
    let r = write(&b, &rkey, result("s0", &w2, NOW + 3_000), &w2, &trust, NOW + 3_000).unwrap();
    assert!(matches!(
        merge_scoped(&a, r, &[], &trust, NOW + 3_000).unwrap(),
        MergeOutcome::Changed(_)
    ));
    // The loser's result counts nowhere.
    let lost = keys::processing_result(&format!("{TASK}/s0"), &w1.node_id().to_string());
    let (_dc, scratch) = store();
    let d = signed_delta(&scratch, &lost, result("s0", &w1, NOW + 3_100), &w1);
    assert!(merge_scoped(&a, d, &[], &trust, NOW + 3_100).is_err());
    for ks in [&a, &b] {
        let s = stored(ks, TASK).unwrap().unwrap();
        assert!(all_results(&s, NOW + 4_000), "s0 is done on every replica");
        assert!(grab(ks, TASK, &w1, 30_000, &trust, NOW + 4_000).unwrap().is_none());
    }
}

#[test]
fn every_expiry_of_a_subtasks_locks_counts_on_every_replica() {
    let (_da, a, _db, b, trust, _w, gateway) = two();
    let t = write(&a, &keys::processing_task(TASK), record(&gateway, 1), &gateway, &trust, NOW)
        .unwrap();
    merge_scoped(&b, t, &[], &trust, NOW).unwrap();
    let mut deltas = vec![];
    for i in 0..3u8 {
        // Each worker locks s0 once the last lock expired (60 s leases),
        // and dies holding it.
        let w = NodeKey::from_seed([50 + i; 32]);
        let at = NOW + 61_000 * u64::from(i);
        let id = format!("lock_01JDZ0000000000000000000X{i}");
        let k = keys::processing_lock(&format!("{TASK}/s0"), &id);
        deltas.push((at, write(&a, &k, lock("s0", &id, &w, at), &w, &trust, at).unwrap()));
    }
    let end = NOW + 61_000 * 3;
    // b hears each while it is live (a lock that arrives expired is
    // refused: it could be a made-up past lock counting a failure).
    for (at, d) in deltas {
        merge_scoped(&b, d, &[], &trust, at + 1).unwrap();
    }
    let qa = replay(&stored(&a, TASK).unwrap().unwrap(), end);
    assert!(qa.bad(TASK, "s0").is_some(), "three expiries mark it bad");
    // Before each lock had its own key, only the newest counted (one expiry).
    let sb = stored(&b, TASK).unwrap().unwrap();
    assert_eq!(sb.locks.len(), 3, "b holds every lock");
    assert_eq!(replay(&sb, end).bad(TASK, "s0"), qa.bad(TASK, "s0"));
}

#[test]
fn a_subtask_takes_at_most_its_bound_of_locks() {
    // Each lock made 1 ms before the held one wins the contest, so a
    // hostile node could store contenders without end: the bound stops it.
    let (_da, a, _db, _b, trust, w, gateway) = two();
    write(&a, &keys::processing_task(TASK), record(&gateway, 1), &gateway, &trust, NOW).unwrap();
    let at = NOW + 10_000;
    for i in 0..=MAX_LOCKS_PER_SUBTASK as u64 {
        let id = gcs_protocol::ids::id_from_parts(gcs_protocol::ids::LOCK, at - i, u128::from(i));
        let k = keys::processing_lock(&format!("{TASK}/s0"), &id);
        let r = write(&a, &k, lock("s0", &id, &w, at - i), &w, &trust, at);
        if i < MAX_LOCKS_PER_SUBTASK as u64 {
            assert!(r.is_ok(), "lock {i}: {r:?}");
        } else {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("too many locks"), "{e}");
        }
    }
    let s = stored(&a, TASK).unwrap().unwrap();
    assert_eq!(s.locks.len(), MAX_LOCKS_PER_SUBTASK);
}
