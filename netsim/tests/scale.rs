//! The scale simulation is deterministic in its seed and its figures obey
//! the lifecycle's own bounds.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use netsim::scale::{simulate, table, ScaleSpec};

fn spec(seed: u64) -> ScaleSpec {
    ScaleSpec {
        seed,
        rate_per_s: 5.0,
        duration_s: 20,
        slots: 4,
        service_ms: 3000.0,
        loss: 0.01,
        kill_fraction: 0.01,
    }
}

#[test]
fn same_seed_same_table_and_sane_figures() {
    let rows = |s: u64| vec![simulate(10, &spec(s)), simulate(50, &spec(s))];
    let (a, b) = (rows(3), rows(3));
    assert_eq!(table(&spec(3), &a), table(&spec(3), &b));
    for r in &a {
        assert!(r.jobs > 50, "{r:?}");
        // Every job ends: completed or failed, none left hanging.
        assert_eq!(r.completed + r.failed, r.jobs, "{r:?}");
        // A dead holder is noticed within one lease term (10 s) plus a tick.
        assert!(r.detect_max_ms <= 10_250, "{r:?}");
        // Every idle worker claims: contention grows with the fleet.
        assert!(r.claims_per_win > 1.0 && r.claims_per_win <= r.nodes as f64 + 1.0, "{r:?}");
    }
    assert!(a[1].claims_per_win > a[0].claims_per_win);
}
