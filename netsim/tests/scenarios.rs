//! The fast fault scenarios against real gcs-node processes, run by the
//! README's test command (`cargo test --workspace --all-targets`, which
//! builds gcs-node and netsim first). The tests take turns (a lock): on a
//! small machine, parallel scenarios would starve each other's timing.
//! Without the models they say SKIP; a scenario this machine cannot run
//! (no network namespaces, no libfaketime) says SKIP and why, on the
//! process's stderr so that a passing run shows it. Under `CI=true` each of
//! those is a failure naming what is missing (tests/support/prereq.rs):
//! the test command installs libfaketime and iproute2 and CI runs as root.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;

use std::path::Path;
use std::sync::Mutex;

use netsim::{cluster, report, runner, scenario::Scenario};

/// One scenario run at a time across the tests of this binary.
static TURN: Mutex<()> = Mutex::new(());

fn run_all(names: &[&str]) {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    if !cluster::models_present() {
        let what = format!("models in {}", cluster::model_dir().display());
        prereq::missing(&what, "run scripts/fetch-models.sh");
        return;
    }
    let bin = cluster::locate_gcs_node(None)
        .expect("gcs-node binary: run `cargo build --workspace` (or set GCS_NODE_BIN)");
    let tmp = tempfile::tempdir().unwrap();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let mut failed = vec![];
    let mut outcomes = vec![];
    for name in names {
        let s = Scenario::load(&dir.join(format!("{name}.toml"))).unwrap();
        let o = match runner::run(&s, &bin, &tmp.path().join(name)) {
            Ok(o) => o,
            Err(e) => {
                let keep = tmp.keep();
                panic!("scenario {name} could not run: {e} (logs kept in {})", keep.display());
            }
        };
        eprint!("{}", report::table(&o));
        if let Some(why) = &o.skipped {
            let what = format!("scenario {name}: {why}");
            prereq::missing(&what, "scripts/test-deps.sh installs it; namespaces need root");
        }
        if !o.ok() {
            failed.push(*name);
        }
        outcomes.push(o);
    }
    let out = tmp.path().join("report.json");
    report::write_json(&out, &outcomes).unwrap();
    if !failed.is_empty() {
        // Keep the node logs for the post-mortem.
        let keep = tmp.keep();
        panic!("scenarios failed: {failed:?}; logs and report in {}", keep.display());
    }
}

#[test]
fn fault_scenarios_keep_every_invariant() {
    run_all(&[
        "worker_crash_before_first_token",
        "worker_crash_after_first_token",
        "gateway_restart",
        "slow_client",
        "vanishing_client",
        "worker_pause_past_lease",
    ]);
}

/// Exact continuation (issue 16): holders killed mid-stream, greedy and
/// seeded sampling; each stream equals its reference run (~35 s).
#[test]
fn a_stream_continues_exactly_after_its_worker_is_killed() {
    run_all(&["worker_crash_mid_stream_continues"]);
}

/// Exact continuation: a holder paused past its lease; its late chunks
/// are fenced out and the stream equals its reference run (~30 s).
#[test]
fn a_stream_continues_exactly_after_its_worker_is_paused_past_the_lease() {
    run_all(&["worker_pause_past_lease_continues"]);
}

/// Exact continuation: a holder cut off past its lease, seeded sampling;
/// its chunks after the heal are refused and the stream equals its
/// reference run (~25 s). Network namespaces, as below.
#[test]
fn a_stream_continues_exactly_after_its_worker_is_partitioned() {
    run_all(&["partition_worker_mid_stream_continues"]);
}

/// Network namespaces: SKIP (with the reason) where they cannot be made,
/// a failure under `CI=true`.
#[test]
fn partition_scenarios_keep_every_invariant() {
    run_all(&[
        "partition_worker_before_first_token",
        "partition_worker_mid_stream",
        "partition_split_heal",
    ]);
}

/// libfaketime: SKIP (with the reason) where it is not installed, a
/// failure under `CI=true`.
#[test]
fn clock_skew_scenarios_keep_every_invariant() {
    run_all(&["clock_skew_within_tolerance", "clock_skew_beyond_expiry"]);
}

#[test]
fn a_misbehaving_peer_process_changes_no_stream() {
    run_all(&["adversary_peer"]);
}

/// Catalogue poisoning and a fake gateway's flood (issue 14 §3).
#[test]
fn a_poisoned_catalogue_and_a_fake_gateways_flood_change_nothing_honest() {
    run_all(&["adversary_trust"]);
}

/// A self-declared private member never gets a lease (issue 14 §2, §5).
#[test]
fn a_fake_private_member_never_serves_the_tenants_jobs() {
    run_all(&["adversary_membership"]);
}
