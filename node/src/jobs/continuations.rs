//! Exact continuations this gateway started, and how they ended
//! (`GET /metrics`; specs/lifecycle.md "Exact continuation").

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Continuations announced (one per lost holder).
static STARTED: AtomicU64 = AtomicU64::new(0);
/// Jobs that continued at least once and completed.
static SUCCEEDED: AtomicU64 = AtomicU64::new(0);
/// Jobs that continued at least once and failed anyway (no matching
/// claim in the claim round, the bound reached, the wall timeout...).
static FAILED: AtomicU64 = AtomicU64::new(0);

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
    )
}
