//! Unit tests of the store that need its internals.

use super::*;

fn open(dir: &tempfile::TempDir, actor: &str) -> Keyspace {
    Keyspace::open(dir.path(), actor, KeyspaceOptions::default()).unwrap()
}

#[test]
fn put_get_delete_and_prefix_scan() {
    let d = tempfile::tempdir().unwrap();
    let ks = open(&d, "a");
    ks.put("/gcs/api/jobs/j1", b"one".to_vec(), 1000).unwrap();
    ks.put("/gcs/api/jobs/j2", b"two".to_vec(), 1001).unwrap();
    ks.put("/gcs/api/jobs_by_tenant/t/j1", b"x".to_vec(), 1001).unwrap();
    assert_eq!(ks.get_bytes("/gcs/api/jobs/j1").unwrap().unwrap(), b"one");
    let scan = ks.scan_prefix("/gcs/api/jobs/").unwrap();
    assert_eq!(scan.len(), 2, "jobs_by_tenant must not leak into the jobs prefix");
    assert_eq!(ks.scan_prefix("/gcs/api/").unwrap().len(), 3);
    ks.delete("/gcs/api/jobs/j1", 1002).unwrap();
    assert_eq!(ks.get_bytes("/gcs/api/jobs/j1").unwrap(), None);
    assert!(ks.get("/gcs/api/jobs/j1").unwrap().is_some(), "a delete is a tombstone");
}

#[test]
fn kinds_are_enforced_per_namespace() {
    let d = tempfile::tempdir().unwrap();
    let ks = open(&d, "a");
    assert!(matches!(
        ks.set_add("/gcs/api/jobs/j1", b"x", 1),
        Err(KeyspaceError::KindMismatch { .. })
    ));
    assert!(matches!(
        ks.put("/gcs/api/claims/j1", b"x".to_vec(), 1),
        Err(KeyspaceError::KindMismatch { .. })
    ));
    assert!(matches!(ks.put("/nope/x", vec![], 1), Err(KeyspaceError::UnknownNamespace(_))));
}

#[test]
fn corrupt_value_gives_typed_error_and_other_keys_stay_readable() {
    let d = tempfile::tempdir().unwrap();
    let ks = open(&d, "a");
    ks.put("/gcs/api/jobs/good", b"ok".to_vec(), 1000).unwrap();
    ks.raw_put("/gcs/api/jobs/bad", &[1, 0xff, 0x13, 0x37]).unwrap();
    ks.raw_put("/gcs/api/jobs/future", &[9, 1, 2]).unwrap();
    assert!(matches!(ks.get("/gcs/api/jobs/bad"), Err(KeyspaceError::Corrupt { .. })));
    assert!(matches!(ks.get("/gcs/api/jobs/future"), Err(KeyspaceError::UnsupportedFormat(9))));
    assert_eq!(ks.get_bytes("/gcs/api/jobs/good").unwrap().unwrap(), b"ok");
    let keys: Vec<_> = ks.scan_prefix("/gcs/api/jobs/").unwrap().into_iter().map(|e| e.0).collect();
    assert_eq!(keys, vec!["/gcs/api/jobs/good"]);
    // A later write repairs it.
    ks.put("/gcs/api/jobs/bad", b"fixed".to_vec(), 1001).unwrap();
    assert_eq!(ks.get_bytes("/gcs/api/jobs/bad").unwrap().unwrap(), b"fixed");
}

#[test]
fn malformed_deltas_are_typed_errors() {
    let d = tempfile::tempdir().unwrap();
    let ks = open(&d, "a");
    for bytes in [&[][..], &[1][..], &[1, 0xa1, 0x61][..], &[7, 0][..], &[1, 0x80][..]] {
        assert!(ks.merge_bytes(bytes, 1).is_err(), "{bytes:?}");
    }
    let wrong_kind = Delta {
        key: "/gcs/api/claims/j".into(),
        value: CrdtValue::Register(Register::new(Some(vec![1]), Hlc::default(), "b")),
    };
    assert!(matches!(ks.merge(wrong_kind, 1), Err(KeyspaceError::KindMismatch { .. })));
}

#[test]
fn merge_is_idempotent_and_logs_only_changes() {
    let d1 = tempfile::tempdir().unwrap();
    let d2 = tempfile::tempdir().unwrap();
    let a = open(&d1, "a");
    let b = open(&d2, "b");
    let delta = a.put("/gcs/nodes/registrations/n1", b"r1".to_vec(), 5000).unwrap();
    assert!(matches!(b.merge(delta.clone(), 5000).unwrap(), MergeOutcome::Changed(_)));
    assert_eq!(b.merge(delta, 5000).unwrap(), MergeOutcome::Unchanged);
    assert_eq!(b.last_seq(), 1);
    assert_eq!(
        a.digest(Namespace::NodeRegistrations).unwrap(),
        b.digest(Namespace::NodeRegistrations).unwrap()
    );
}

#[test]
fn deltas_since_and_truncation() {
    let d = tempfile::tempdir().unwrap();
    let opts = KeyspaceOptions { log_capacity: 5, ..Default::default() };
    let ks = Keyspace::open(d.path(), "a", opts).unwrap();
    for i in 0..12 {
        ks.put(&format!("/gcs/api/jobs/j{i}"), vec![i], 1000 + u64::from(i)).unwrap();
    }
    assert_eq!(ks.last_seq(), 12);
    match ks.deltas_since(9, 100).unwrap() {
        Since::Deltas(d) => assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![10, 11, 12]),
        other => panic!("{other:?}"),
    }
    assert!(matches!(ks.deltas_since(2, 100).unwrap(), Since::Truncated { log_start: 8 }));
    assert_eq!(ks.snapshot(Namespace::ApiJobs).unwrap().len(), 12);
}

#[test]
fn retention_compacts_and_refuses_stale_deltas() {
    let d = tempfile::tempdir().unwrap();
    let ks = open(&d, "a");
    let old = ks.put("/gcs/nodes/registrations/n1", b"r".to_vec(), 1_000).unwrap();
    ks.put("/gcs/nodes/registrations/n2", b"r".to_vec(), 600_000).unwrap();
    ks.put("/gcs/api/jobs/j1", b"kept for a day".to_vec(), 1_000).unwrap();
    let stats = ks.compact(700_000).unwrap();
    assert_eq!(stats.removed.get(&Namespace::NodeRegistrations), Some(&1));
    assert_eq!(ks.get("/gcs/nodes/registrations/n1").unwrap(), None);
    assert!(ks.get("/gcs/nodes/registrations/n2").unwrap().is_some());
    assert!(ks.get("/gcs/api/jobs/j1").unwrap().is_some());
    assert_eq!(ks.merge(old, 700_000).unwrap(), MergeOutcome::Expired);
    assert_eq!(ks.digest(Namespace::NodeRegistrations).unwrap().count, 1);
}

#[tokio::test]
async fn watch_sees_changes_under_its_prefix_only() {
    let d = tempfile::tempdir().unwrap();
    let ks = open(&d, "a");
    let mut w = ks.watch("/gcs/api/claims/j1");
    ks.set_add("/gcs/api/claims/j2", b"c", 1).unwrap();
    ks.set_add("/gcs/api/claims/j1", b"c1", 2).unwrap();
    let c = w.recv().await.unwrap();
    assert_eq!(c.key, "/gcs/api/claims/j1");
    assert!(c.value.as_set().unwrap().contains(b"c1"));
    assert_eq!(w.try_recv().unwrap(), None);
}

#[test]
fn watch_lag_is_reported_not_blocking() {
    let d = tempfile::tempdir().unwrap();
    let opts = KeyspaceOptions { watch_capacity: 4, ..Default::default() };
    let ks = Keyspace::open(d.path(), "a", opts).unwrap();
    let mut w = ks.watch("/gcs/api/jobs/");
    for i in 0..10u8 {
        ks.put(&format!("/gcs/api/jobs/j{i}"), vec![i], 1).unwrap();
    }
    assert!(matches!(w.try_recv(), Err(WatchError::Lagged(_))));
}

#[test]
fn reopen_keeps_data_sequence_and_clock() {
    let d = tempfile::tempdir().unwrap();
    let hlc_before;
    {
        let ks = open(&d, "a");
        ks.put("/gcs/api/jobs/j1", b"v".to_vec(), 50_000).unwrap();
        hlc_before = ks.get("/gcs/api/jobs/j1").unwrap().unwrap().updated();
    }
    let ks = open(&d, "a");
    assert_eq!(ks.last_seq(), 1);
    // Wall clock went backwards across the restart: the write still wins.
    ks.put("/gcs/api/jobs/j1", b"w".to_vec(), 10).unwrap();
    assert_eq!(ks.get_bytes("/gcs/api/jobs/j1").unwrap().unwrap(), b"w");
    assert!(ks.get("/gcs/api/jobs/j1").unwrap().unwrap().updated() > hlc_before);
}

#[test]
fn a_snapshot_page_starts_after_its_key_and_stops_at_its_caps() {
    let d = tempfile::tempdir().unwrap();
    let ks = open(&d, "a");
    for i in 0..30u8 {
        ks.put(&format!("/gcs/api/jobs/j{i:02}"), vec![i; 100], 1000).unwrap();
    }
    ks.put("/gcs/api/jobs_by_tenant/t/j", vec![], 1000).unwrap();
    let (page, more) = ks.snapshot_page(Namespace::ApiJobs, None, 10, usize::MAX).unwrap();
    assert_eq!((page.len(), more), (10, true));
    assert_eq!(page[9].key, "/gcs/api/jobs/j09");
    let (page, more) =
        ks.snapshot_page(Namespace::ApiJobs, Some("/gcs/api/jobs/j09"), 100, usize::MAX).unwrap();
    assert_eq!((page.len(), more), (20, false), "the rest, nothing of the next namespace");
    assert_eq!(page[0].key, "/gcs/api/jobs/j10");
    // The byte cap: entries of ~130 stored bytes, a 300-byte budget.
    let (page, more) = ks.snapshot_page(Namespace::ApiJobs, None, 100, 300).unwrap();
    assert!(more && (2..=3).contains(&page.len()), "{}", page.len());
    let (page, _) = ks.snapshot_page(Namespace::ApiJobs, None, 100, 1).unwrap();
    assert_eq!(page.len(), 1, "a page holds at least one entry");
}

#[test]
fn compaction_deletes_in_batches_and_keeps_what_was_written_meanwhile() {
    let d = tempfile::tempdir().unwrap();
    let ks = open(&d, "a");
    for i in 0..25u8 {
        ks.put(&format!("/gcs/nodes/heartbeat/n{i:02}"), vec![i], 1_000).unwrap();
    }
    ks.put("/gcs/nodes/heartbeat/zz", vec![1], 650_000).unwrap();
    let stats = ks.compact_in_batches(700_000, 10).unwrap();
    assert_eq!(stats.removed.get(&Namespace::NodeHeartbeat), Some(&25));
    assert!(stats.batches >= 3, "25 entries in batches of 10: {}", stats.batches);
    assert_eq!(ks.digest(Namespace::NodeHeartbeat).unwrap().count, 1);
    // Deleting is re-checked under the lock: an entry rewritten after the
    // scan is kept (the bytes scanned no longer match).
    ks.put("/gcs/nodes/heartbeat/n00", vec![1], 1_000).unwrap();
    let before = ks.get("/gcs/nodes/heartbeat/n00").unwrap().unwrap();
    let scanned = crate::codec::encode_value(&before);
    ks.put("/gcs/nodes/heartbeat/n00", vec![2], 690_000).unwrap();
    let entries = vec![(b"/gcs/nodes/heartbeat/n00".to_vec(), scanned)];
    assert_eq!(ks.delete_unchanged_for_test(Namespace::NodeHeartbeat, &entries).unwrap(), 0);
    assert_eq!(ks.get_bytes("/gcs/nodes/heartbeat/n00").unwrap().unwrap(), vec![2]);
}

#[test]
fn every_namespace_but_the_local_markers_is_compacted() {
    let d = tempfile::tempdir().unwrap();
    let ks = open(&d, "a");
    let day = 24 * 3_600_000;
    for ns in Namespace::ALL {
        let key = format!("{}x", ns.prefix());
        match ns.kind() {
            crate::ValueKind::Register => drop(ks.put(&key, vec![1], 1_000).unwrap()),
            crate::ValueKind::Set => drop(ks.set_add(&key, b"e", 1_000).unwrap()),
        }
    }
    ks.compact(crate::USAGE_RETENTION_MS + day).unwrap();
    for ns in Namespace::ALL {
        let kept = ks.get(&format!("{}x", ns.prefix())).unwrap().is_some();
        assert_eq!(kept, *ns == Namespace::Local, "{ns:?}");
    }
}

#[test]
fn local_records_of_an_older_layout_move_to_their_namespaces() {
    let d = tempfile::tempdir().unwrap();
    {
        // Written by a build that kept everything local in one family.
        let db = rocksdb::DB::open_cf(
            &{
                let mut o = rocksdb::Options::default();
                o.create_if_missing(true);
                o.create_missing_column_families(true);
                o
            },
            d.path(),
            ["local"],
        )
        .unwrap();
        let cf = db.cf_handle("local").unwrap();
        let v = crate::codec::encode_value(&crate::CrdtValue::Register(crate::Register::new(
            Some(b"entry".to_vec()),
            crate::Hlc { wall_ms: 5, logical: 0 },
            "a",
        )));
        db.put_cf(cf, crate::keys::idempotency("h").as_bytes(), &v).unwrap();
        db.put_cf(cf, b"/gcs/local/other", &v).unwrap();
    }
    let ks = open(&d, "a");
    assert_eq!(ks.get_bytes(&crate::keys::idempotency("h")).unwrap().unwrap(), b"entry");
    assert_eq!(ks.get_bytes("/gcs/local/other").unwrap().unwrap(), b"entry");
}

#[test]
fn a_range_scan_reads_only_its_range() {
    let d = tempfile::tempdir().unwrap();
    let ks = open(&d, "a");
    for (t, j) in [(5u64, "a"), (10, "b"), (15, "c"), (20, "d")] {
        ks.put(&crate::keys::usage_of_key("k1", t, j), vec![], 1).unwrap();
        ks.put(&crate::keys::usage_of_key("k2", t, j), vec![], 1).unwrap();
    }
    let from = crate::keys::usage_of_key_from("k1", 10);
    let to = crate::keys::usage_of_key_from("k1", 20);
    let got: Vec<_> = ks.scan_range(&from, &to, 100).unwrap().into_iter().map(|e| e.0).collect();
    assert_eq!(got, vec![crate::keys::usage_of_key("k1", 10, "b"), crate::keys::usage_of_key("k1", 15, "c")]);
    assert_eq!(ks.scan_range(&from, &to, 1).unwrap().len(), 1, "the limit");
}
