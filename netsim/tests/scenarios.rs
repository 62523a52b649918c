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

use netsim::{cluster, report, runner, scenario::Scenario, series};

/// One scenario run at a time across the tests of this binary.
static TURN: Mutex<()> = Mutex::new(());

fn run_all(names: &[&str]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let list = names
        .iter()
        .map(|name| Scenario::load(&dir.join(format!("{name}.toml"))).unwrap())
        .collect();
    run_scenarios(list);
}

fn run_scenarios(list: Vec<Scenario>) {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    if !cluster::models_present() {
        let what = format!("models in {}", cluster::model_dir().display());
        prereq::missing(&what, "run scripts/fetch-models.sh");
        return;
    }
    let bin = cluster::locate_gcs_node(None)
        .expect("gcs-node binary: run `cargo build --workspace` (or set GCS_NODE_BIN)");
    let tmp = tempfile::tempdir().unwrap();
    let mut failed = vec![];
    let mut outcomes = vec![];
    for s in &list {
        let name = s.name.as_str();
        let o = match runner::run(s, &bin, &tmp.path().join(name)) {
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
            failed.push(name.to_string());
        }
        outcomes.push(o);
    }
    print_gaps(&outcomes);
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

/// Exact continuation, one of two shapes. By default (CI) the scenario's
/// `[series]`: one topology, N greedy and N seeded T=0.8 faulted streams in
/// turn (`GCS_CONTINUATION_STREAMS=N`; unset or 0: the file's counts, 20 +
/// 20), every fault index and seed drawn from `GCS_SEED` (printed, so a
/// failing run replays). With `GCS_CONTINUATION_RUNS=N` instead the older
/// shape: N whole topologies, run 0 the file as written, run i > 0 its
/// faults moved and its seeds redrawn (`varied`).
fn continuation_runs(name: &str) {
    let base: u64 =
        std::env::var("GCS_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            t.as_nanos() as u64
        });
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let s = Scenario::load(&dir.join(format!("{name}.toml"))).unwrap();
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u32>().ok());
    if let Some(runs) = env("GCS_CONTINUATION_RUNS") {
        eprintln!("{name}: {runs} run(s), GCS_SEED={base} GCS_CONTINUATION_RUNS={runs}");
        run_scenarios((0..runs).map(|i| varied(&s, i, base)).collect());
        return;
    }
    let spec = s.series.clone().expect("a continuation scenario has a [series]");
    let (greedy, seeded) = match env("GCS_CONTINUATION_STREAMS").unwrap_or(0) {
        0 => (spec.greedy, spec.seeded),
        n => (n, n),
    };
    eprintln!("{name}: series of {greedy} greedy + {seeded} seeded streams, GCS_SEED={base}");
    run_series(&s, &series::Plan { greedy, seeded, seed: base });
}

fn run_series(s: &Scenario, plan: &series::Plan) {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    if !cluster::models_present() {
        let what = format!("models in {}", cluster::model_dir().display());
        prereq::missing(&what, "run scripts/fetch-models.sh");
        return;
    }
    let bin = cluster::locate_gcs_node(None)
        .expect("gcs-node binary: run `cargo build --workspace` (or set GCS_NODE_BIN)");
    let tmp = tempfile::tempdir().unwrap();
    let o = match series::run(s, plan, &bin, &tmp.path().join(&s.name)) {
        Ok(o) => o,
        Err(e) => {
            let keep = tmp.keep();
            panic!("series {} could not run: {e} (logs kept in {})", s.name, keep.display());
        }
    };
    eprint!("{}", series::summary(&o));
    if let Some(why) = &o.skipped {
        let what = format!("series {}: {why}", s.name);
        prereq::missing(&what, "scripts/test-deps.sh installs it; namespaces need root");
        return;
    }
    let out = tmp.path().join("series.json");
    std::fs::write(&out, serde_json::to_string_pretty(&o).unwrap()).unwrap();
    let wanted = (plan.greedy + plan.seeded) as usize;
    if !o.ok() || o.streams.len() != wanted {
        let keep = tmp.keep();
        panic!(
            "series {} failed ({} of {wanted} streams ran); logs and series.json in {}",
            s.name,
            o.streams.len(),
            keep.display()
        );
    }
}

fn varied(s: &Scenario, i: u32, base: u64) -> Scenario {
    if i == 0 {
        return s.clone();
    }
    let mut v = s.clone();
    v.name = format!("{}-run{i}", s.name);
    let mut draw = series::mix(base ^ u64::from(i).wrapping_mul(0x1000_0001));
    let mut next = || {
        draw = series::mix(draw);
        draw
    };
    let single = v.requests.len() == 1;
    for r in v.requests.iter_mut().filter(|r| r.reference) {
        if single && i % 2 == 1 {
            (r.temperature, r.seed) = (None, None);
        } else if r.temperature.is_some() || single {
            (r.temperature, r.seed) = (Some(0.8), Some(next() % 1_000_000));
        }
    }
    for f in &mut v.faults {
        let max = v
            .requests
            .iter()
            .find(|r| Some(&r.name) == f.trigger.request.as_ref())
            .map_or(32, |r| r.max_tokens);
        // Anywhere after the first token and well before the last.
        let last = u64::from(max.saturating_sub(20)).max(2);
        f.trigger.after_tokens = Some(1 + next() % last);
    }
    v
}

/// The client's longest wait between two content frames, per request
/// (the seam as the client sees it), and p50/p99 over the runs.
fn print_gaps(outcomes: &[runner::Outcome]) {
    let mut gaps: Vec<u64> = vec![];
    for o in outcomes {
        for e in &o.entries {
            eprintln!(
                "{} {}: longest gap between deltas {} ms",
                o.scenario, e.group, e.record.max_gap_ms
            );
            gaps.push(e.record.max_gap_ms);
        }
    }
    gaps.sort_unstable();
    if let (Some(p50), Some(p99)) = (gaps.get(gaps.len() / 2), gaps.get(gaps.len() * 99 / 100)) {
        eprintln!("client-side seam gap over {} streams: p50 {p50} ms, p99 {p99} ms", gaps.len());
    }
}

/// Exact continuation (issue 16): holders killed mid-stream, greedy and
/// seeded sampling; each stream equals its reference run.
#[test]
fn a_stream_continues_exactly_after_its_worker_is_killed() {
    continuation_runs("worker_crash_mid_stream_continues");
}

/// Exact continuation: a holder paused past its (2 s) lease; its late
/// chunks are fenced out, it stops on its cancel once running again, and
/// the stream equals its reference run.
#[test]
fn a_stream_continues_exactly_after_its_worker_is_paused_past_the_lease() {
    continuation_runs("worker_pause_past_lease_continues");
}

/// Exact continuation: a holder cut off past its (2 s) lease; its chunks
/// after the heal are refused, it stops, and the stream equals its
/// reference run. Network namespaces, as below.
#[test]
fn a_stream_continues_exactly_after_its_worker_is_partitioned() {
    continuation_runs("partition_worker_mid_stream_continues");
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

/// Batches on the processing queue (issue 20 §4): a worker holding a
/// subtask's lock killed mid-batch while interactive streams run, the
/// gateway restarted mid-batch, and the gateway down for 20 s while the
/// workers go on through the tenant's other gateway, and the gateway lost
/// for good while the other takes the batch over; each batch completes
/// with every line answered once, equal to the request sent alone,
/// metered once.
#[test]
fn a_batch_survives_a_killed_worker_and_a_restarted_gateway() {
    run_all(&[
        "batch_worker_killed",
        "batch_gateway_restart",
        "batch_gateway_down",
        "batch_gateway_lost",
    ]);
}
