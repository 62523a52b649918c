//! The simulation's inputs, its figures, the table, and its random numbers.

use std::collections::BTreeMap;

use serde::Serialize;

/// Simulation parameters.
#[derive(Clone, Debug)]
pub struct ScaleSpec {
    /// Seed of every random choice.
    pub seed: u64,
    /// Jobs per second (Poisson arrivals) during `duration_s`.
    pub rate_per_s: f64,
    /// Seconds of arrivals.
    pub duration_s: u64,
    /// Concurrent jobs per worker.
    pub slots: u32,
    /// Mean job duration (exponential), ms.
    pub service_ms: f64,
    /// Loss probability of a gossip transmission or a claim exchange.
    pub loss: f64,
    /// Fraction of busy workers killed halfway (at least one).
    pub kill_fraction: f64,
}

/// One row of the table.
#[derive(Clone, Debug, Serialize)]
pub struct ScaleRow {
    /// Workers.
    pub nodes: usize,
    /// Jobs submitted.
    pub jobs: u64,
    /// Jobs completed.
    pub completed: u64,
    /// Jobs failed.
    pub failed: u64,
    /// Publish to lease granted, median, ms.
    pub claim_p50_ms: u64,
    /// Publish to lease granted, 99th percentile, ms.
    pub claim_p99_ms: u64,
    /// Gossip transmissions per job (mesh forwarding, no IHAVE/IWANT).
    pub gossip_per_job: f64,
    /// Claims the gateway received per lease it granted.
    pub claims_per_win: f64,
    /// Jain's fairness index of wins across workers (1 = equal).
    pub fairness: f64,
    /// Largest worker's wins over the mean.
    pub max_over_mean: f64,
    /// Dead worker killed to the tracker's requeue or failure, mean ms.
    pub detect_mean_ms: u64,
    /// Same, largest.
    pub detect_max_ms: u64,
    /// Requeues.
    pub requeues: u64,
    /// Failures by error code.
    pub fail_codes: BTreeMap<String, u64>,
    /// Requeues by reason.
    pub requeue_reasons: BTreeMap<String, u64>,
    /// Claim rejections by reason.
    pub reject_reasons: BTreeMap<String, u64>,
}

/// SplitMix64: tiny, seedable, and good enough for a simulation.
#[derive(Debug)]
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub(super) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub(super) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    pub(super) fn exp(&mut self, mean: f64) -> u64 {
        (-mean * (1.0 - self.unit()).ln()) as u64
    }
    pub(super) fn lost(&mut self, p: f64) -> bool {
        self.unit() < p
    }
}

/// The table the `scale` command prints.
pub fn table(spec: &ScaleSpec, rows: &[ScaleRow]) -> String {
    use std::fmt::Write as _;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "seed {} | {} jobs/s for {} s | {} slots/worker | service {} ms | loss {} | kill {}",
        spec.seed,
        spec.rate_per_s,
        spec.duration_s,
        spec.slots,
        spec.service_ms,
        spec.loss,
        spec.kill_fraction
    );
    let _ = writeln!(
        t,
        "{:>6} {:>6} {:>6} {:>5} {:>9} {:>9} {:>11} {:>10} {:>8} {:>8} {:>10} {:>10} {:>8}",
        "nodes",
        "jobs",
        "done",
        "fail",
        "claim p50",
        "claim p99",
        "gossip/job",
        "claims/win",
        "fairness",
        "max/mean",
        "detect avg",
        "detect max",
        "requeues"
    );
    for r in rows {
        let _ = writeln!(
            t,
            "{:>6} {:>6} {:>6} {:>5} {:>7}ms {:>7}ms {:>11.0} {:>10.1} {:>8.3} {:>8.2} {:>8}ms {:>8}ms {:>8}",
            r.nodes, r.jobs, r.completed, r.failed, r.claim_p50_ms, r.claim_p99_ms, r.gossip_per_job,
            r.claims_per_win, r.fairness, r.max_over_mean, r.detect_mean_ms, r.detect_max_ms, r.requeues
        );
    }
    for r in rows.iter().filter(|r| !r.fail_codes.is_empty() || !r.requeue_reasons.is_empty()) {
        let _ = writeln!(
            t,
            "{:>6}: failures {:?}, requeues {:?}",
            r.nodes, r.fail_codes, r.requeue_reasons
        );
        let _ = writeln!(t, "{:>6}: rejected claims {:?}", r.nodes, r.reject_reasons);
    }
    t
}
