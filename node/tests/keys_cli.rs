//! `gcs-node keys` writers racing as separate processes (issue 15 §8): 16
//! concurrent `keys create` and one `keys revoke` on one data directory
//! leave every key created and the revocation in place (the key file is
//! changed under its flock and replaced by rename, gateway/src/durable.rs),
//! and no temporary file behind.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_gcs-node");

fn keys(dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(["keys"]).args(args).args(["--data-dir", dir.to_str().unwrap()]);
    c
}

fn ok(out: Output) -> String {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn concurrent_key_writers_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let victim =
        ok(keys(dir.path(), &["create", "--tenant", "t", "--project", "p"]).output().unwrap());
    let prefix: String = victim.trim().chars().take(12).collect();
    let creators: Vec<_> = (0..16)
        .map(|i| {
            keys(dir.path(), &["create", "--tenant", &format!("t{i}"), "--project", "p"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let revoke = keys(dir.path(), &["revoke", &prefix]).output().unwrap();
    assert!(revoke.status.success(), "{}", String::from_utf8_lossy(&revoke.stderr));
    for c in creators {
        ok(c.wait_with_output().unwrap());
    }
    let list = ok(keys(dir.path(), &["list", "--json"]).output().unwrap());
    let recs: Vec<serde_json::Value> =
        list.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(recs.len(), 17, "keys lost to a concurrent writer: {list}");
    for i in 0..16 {
        let t = format!("t{i}");
        assert!(recs.iter().any(|r| r["tenant_id"] == t.as_str()), "{t} missing");
    }
    let v = recs.iter().find(|r| r["prefix"] == prefix.as_str()).unwrap();
    assert!(v["revoked_at_ms"].is_u64(), "the revocation was undone: {v}");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}
