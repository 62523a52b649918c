//! Data acknowledged by a write survives `kill -9` of the writing process.
//!
//! The test re-runs its own binary as a child that writes in a loop and
//! prints each acknowledged key; the parent kills it mid-loop, reopens the
//! keyspace and checks every acknowledged key is there.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use gcs_keyspace::{Keyspace, KeyspaceOptions};

const CHILD_ENV: &str = "GCS_KEYSPACE_DURABILITY_CHILD";

#[test]
fn acknowledged_writes_survive_kill_9() {
    if let Some(dir) = std::env::var_os(CHILD_ENV) {
        // Child: write until killed.
        let ks = Keyspace::open(std::path::Path::new(&dir), "child", KeyspaceOptions::default())
            .unwrap();
        for i in 0u64.. {
            ks.put(&format!("/gcs/api/jobs/k{i:08}"), i.to_be_bytes().to_vec(), 1_000 + i).unwrap();
            println!("acked {i}");
        }
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "acknowledged_writes_survive_kill_9", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut last_acked = None;
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if let Some(n) = line.strip_prefix("acked ") {
            let n: u64 = n.parse().unwrap();
            last_acked = Some(n);
            if n >= 2_000 {
                break;
            }
        }
    }
    // SIGKILL, mid-write-loop.
    child.kill().unwrap();
    child.wait().unwrap();
    let last = last_acked.expect("child acknowledged nothing");
    let ks = Keyspace::open(dir.path(), "parent", KeyspaceOptions::default()).unwrap();
    for i in 0..=last {
        let v = ks.get_bytes(&format!("/gcs/api/jobs/k{i:08}")).unwrap();
        assert_eq!(v, Some(i.to_be_bytes().to_vec()), "acknowledged key {i} of {last} lost");
    }
    assert!(ks.last_seq() > last, "the log survived too");
}
