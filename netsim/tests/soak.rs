//! The soak (netsim/scenarios/soak.toml, netsim/src/soak.rs): CI runs its
//! short variant (`ci_duration_s`); `GCS_SOAK_SECS` sets another length.
//! Prints the figures (specs/figures.md records them). Without the models
//! it says SKIP (a failure under `CI=true`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;

use std::path::Path;

use netsim::cluster;
use netsim::soak::{self, SoakSpec};

#[test]
fn soak_streams_slowloris_flood_and_health_stay_bounded() {
    if !cluster::models_present() {
        let what = format!("models in {}", cluster::model_dir().display());
        prereq::missing(&what, "run scripts/fetch-models.sh");
        return;
    }
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/soak.toml");
    let spec = SoakSpec::load(&file).unwrap();
    let secs = std::env::var("GCS_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(spec.ci_duration_s);
    let bin = cluster::locate_gcs_node(None)
        .expect("gcs-node binary: run `cargo build --workspace` (or set GCS_NODE_BIN)");
    let tmp = tempfile::tempdir().unwrap();
    let report = soak::run(&spec, secs, &bin, tmp.path()).unwrap();
    eprintln!("{}", report.summary());
    let failed: Vec<_> = report.checks(&spec).into_iter().filter(|c| !c.ok).collect();
    assert!(failed.is_empty(), "soak checks failed: {failed:#?}");
}
