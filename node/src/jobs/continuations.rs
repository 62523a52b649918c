//! Exact continuations this gateway started, and how they ended
//! (`GET /metrics`; specs/lifecycle.md "Exact continuation").

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::LazyLock;

use gcs_gateway::metrics::Histogram;

use crate::lifecycle::tracker::Seam;

/// Continuations announced (one per lost holder).
static STARTED: AtomicU64 = AtomicU64::new(0);
/// Jobs that continued at least once and completed.
static SUCCEEDED: AtomicU64 = AtomicU64::new(0);
/// Jobs that continued at least once and failed anyway (no matching
/// claim in the claim round, the bound reached, the wall timeout...).
static FAILED: AtomicU64 = AtomicU64::new(0);

/// The seam's parts (`Seam`), then its whole: `gcs_continuation_seam_seconds{part=...}`.
const PARTS: [&str; 4] = ["detect", "claim", "resume", "total"];
static SEAMS: LazyLock<[Histogram; 4]> = LazyLock::new(Default::default);

/// A continuation's first chunk reached the client: its seam's parts.
pub(crate) fn seam(s: &Seam) {
    let ms = [s.detect_ms, s.claim_ms, s.resume_ms, s.total_ms()];
    for (h, v) in SEAMS.iter().zip(ms) {
        h.observe(v as f64 / 1000.0);
    }
}

/// A continuation was announced.
pub(crate) fn started() {
    STARTED.fetch_add(1, Relaxed);
}

/// A job that had continued ended: completed or not.
pub(crate) fn ended(completed: bool) {
    if completed { &SUCCEEDED } else { &FAILED }.fetch_add(1, Relaxed);
}

/// The counters in the Prometheus text format.
pub fn metrics() -> String {
    format!(
        "# HELP gcs_continuations_started_total Streams continued on another worker after their holder was lost.\n\
         # TYPE gcs_continuations_started_total counter\ngcs_continuations_started_total {}\n\
         # HELP gcs_continuations_succeeded_total Continued jobs that completed.\n\
         # TYPE gcs_continuations_succeeded_total counter\ngcs_continuations_succeeded_total {}\n\
         # HELP gcs_continuations_failed_total Continued jobs that failed anyway.\n\
         # TYPE gcs_continuations_failed_total counter\ngcs_continuations_failed_total {}\n",
        STARTED.load(Relaxed),
        SUCCEEDED.load(Relaxed),
        FAILED.load(Relaxed),
    ) + &seam_metrics()
}

fn seam_metrics() -> String {
    let name = "gcs_continuation_seam_seconds";
    let mut out = format!(
        "# HELP {name} Exact continuation seams: last chunk before the loss to the loss detected (detect), to the continuation leased (claim), to its first chunk forwarded (resume), and the whole gap (total).\n\
         # TYPE {name} histogram\n"
    );
    for (h, part) in SEAMS.iter().zip(PARTS) {
        h.render_series(&mut out, name, &format!("part=\"{part}\""));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seam_is_one_observation_per_part() {
        seam(&Seam { detect_ms: 40, claim_ms: 3, resume_ms: 200 });
        let m = metrics();
        assert!(m.contains("# TYPE gcs_continuation_seam_seconds histogram"), "{m}");
        for part in PARTS {
            let count = format!("gcs_continuation_seam_seconds_count{{part=\"{part}\"}} ");
            let n: u64 = m
                .lines()
                .find_map(|l| l.strip_prefix(&count))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            assert!(n >= 1, "{part}: {m}");
        }
        // The part label comes before `le` on every bucket line.
        assert!(m.contains("gcs_continuation_seam_seconds_bucket{part=\"total\",le=\"+Inf\"}"));
        let sum = "gcs_continuation_seam_seconds_sum{part=\"resume\"} ";
        let v: f64 = m.lines().find_map(|l| l.strip_prefix(sum)).unwrap().parse().unwrap();
        assert!(v >= 0.2, "{v}");
    }
}
