//! `gcs-node batches list|show` against a data directory whose batch store
//! was written by the gateway library (specs/batch.md, "CLI").

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Command;

use gcs_gateway::batch::{BatchRecord, BatchStore};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_gcs-node");

fn batches(dir: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .arg("batches")
        .args(args)
        .args(["--data-dir", dir.to_str().unwrap()])
        .output()
        .unwrap();
    let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), s(&out.stdout), s(&out.stderr))
}

fn record(
    id: &str,
    tenant: &str,
    status: &str,
    created: u64,
    counts: (u64, u64, u64),
) -> BatchRecord {
    serde_json::from_value(json!({
        "v": 1, "id": id, "tenant_id": tenant, "project_id": "p",
        "api_key_id": "key_x", "endpoint": "/v1/chat/completions", "input_file_id": "file-x",
        "completion_window": "24h", "metadata": null, "status": status,
        "created_at": created, "expires_at": created + 86_400, "in_progress_at": created,
        "finalizing_at": null, "completed_at": null, "failed_at": null, "expired_at": null,
        "cancelling_at": null, "cancelled_at": null,
        "total": counts.0, "completed": counts.1, "failed": counts.2,
        "input_tokens": 10, "output_tokens": 20,
        "output_file_id": null, "error_file_id": null, "errors": []}))
    .unwrap()
}

#[test]
fn batches_list_and_show_print_status_counts_and_progress() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = ("batch_00112233445566778899aabb", "batch_ffeeddccbbaa998877665544");
    let store = BatchStore::new(dir.path().join("batches"));
    store.save(&record(a, "t", "in_progress", 1_000, (1000, 500, 12))).unwrap();
    store.save(&record(b, "u", "completed", 2_000, (4, 4, 0))).unwrap();

    let (ok, out, err) = batches(dir.path(), &["list"]);
    assert!(ok, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(lines[0].starts_with(b), "newest first: {out}");
    assert!(lines[0].contains("completed") && lines[0].contains("[##########] 4/4"), "{out}");
    let l = lines[1];
    for want in [
        a,
        "in_progress",
        "/v1/chat/completions",
        "[#####-----] 512/1000",
        "completed=500",
        "failed=12",
    ] {
        assert!(l.contains(want), "{want:?} missing in {l:?}");
    }

    let (ok, out, _) = batches(dir.path(), &["list", "--tenant", "u", "--json"]);
    assert!(ok);
    let objs: Vec<serde_json::Value> =
        out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(objs.len(), 1, "{out}");
    assert_eq!(objs[0]["id"], b);
    assert_eq!(objs[0]["request_counts"], json!({"total": 4, "completed": 4, "failed": 0}));

    let (ok, out, _) = batches(dir.path(), &["show", a]);
    assert!(ok);
    let body: String = out.lines().skip(1).collect::<Vec<_>>().join("\n");
    let obj: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!((obj["id"].as_str(), obj["status"].as_str()), (Some(a), Some("in_progress")));
    assert_eq!(obj["usage"]["total_tokens"], 30);

    let (ok, _, err) = batches(dir.path(), &["show", "batch_000000000000000000000000"]);
    assert!(!ok && err.contains("no batch"), "{err}");
    // An empty data directory is no error.
    let empty = tempfile::tempdir().unwrap();
    let (ok, out, err) = batches(empty.path(), &["list"]);
    assert!(ok && out.is_empty() && err.contains("no batches"), "{out} {err}");
}
