//! The soak (netsim/scenarios/soak.toml, issue 15 "Measured"): real
//! gcs-node processes on loopback — one gateway, two workers with the real
//! model — under back-to-back streams, slowloris connections, a gossip
//! flooder (`netsim adversary --attacks flood`) and a /health probe. Run by
//! `netsim run netsim/scenarios/soak.toml` (full length) and by
//! netsim/tests/soak.rs (the CI length).
//!
//! Checks: every stream completes or ends with a clean error (an HTTP
//! status or an SSE error event, never a cut connection or a hang), /health
//! always 200 and within `health_p99_ms` at the 99th percentile, the
//! slowloris connections are cut by the edge, the flooder really flooded,
//! and every node's RSS is flat: for runs of 5 minutes or more the mean of
//! the last third within `rss_growth_pct` of the middle third's; shorter
//! runs are still warming up and are bounded in MiB.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::cluster::Cluster;
use crate::history::Check;
use crate::runner::Outcome;
use crate::scenario::{NodeSpec, Role};
use crate::Error;

mod probe;
pub use probe::{health, slowloris, stream, End};

/// The soak file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SoakSpec {
    /// Always "soak": what tells `netsim run` this is not a fault scenario.
    pub kind: String,
    /// Report name.
    pub name: String,
    /// The full run (`netsim run`).
    pub duration_s: u64,
    /// The CI run (netsim/tests/soak.rs without `GCS_SOAK_SECS`).
    pub ci_duration_s: u64,
    /// Clients streaming back to back.
    pub streams: u32,
    /// `max_tokens` of each stream.
    pub max_tokens: u32,
    /// Idle connections sending one header line every `slowloris_every_s`.
    pub slowloris: usize,
    /// Seconds between their header lines.
    pub slowloris_every_s: u64,
    /// /health's 99th percentile bound.
    pub health_p99_ms: u64,
    /// RSS growth bound, middle to last third, for runs of 5 minutes or more.
    pub rss_growth_pct: f64,
    /// RSS growth bound in MiB for shorter runs.
    pub ci_rss_growth_mib: f64,
    /// Least flood messages per second the flooder must have sent (its
    /// rate is its `--flood-rate` argument).
    #[serde(default)]
    pub flood_min_rate: f64,
    /// The topology; `role = "adversary"` nodes start once the workers
    /// are registered.
    pub nodes: Vec<NodeSpec>,
}

impl SoakSpec {
    /// Reads a soak file.
    pub fn load(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path)?;
        let s: SoakSpec = toml::from_str(&text).map_err(|e| Error::Scenario(e.to_string()))?;
        if s.kind != "soak" {
            return Err(Error::Scenario(format!("{}: kind is not \"soak\"", path.display())));
        }
        Ok(s)
    }

    /// Whether the file at `path` is a soak file (`kind = "soak"`).
    pub fn is_soak(path: &Path) -> bool {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|t| toml::from_str::<toml::Table>(&t).ok())
            .is_some_and(|t| t.get("kind").and_then(|k| k.as_str()) == Some("soak"))
    }
}

/// A soak's figures.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SoakReport {
    /// Seconds of traffic.
    pub seconds: u64,
    /// Streams started.
    pub streams: usize,
    /// Streams that completed.
    pub completed: usize,
    /// How the streams ended, by kind.
    pub ends: BTreeMap<String, usize>,
    /// Streams that did not end cleanly (at most 20 shown).
    pub unclean: Vec<String>,
    /// Time to the first content chunk, ms.
    pub ttft_p50_ms: u64,
    /// Its 99th percentile.
    pub ttft_p99_ms: u64,
    /// /health probes.
    pub health_probes: usize,
    /// /health latency, ms.
    pub health_p50_ms: u64,
    /// Its 99th percentile.
    pub health_p99_ms: u64,
    /// Its worst.
    pub health_max_ms: u64,
    /// Probes that did not get a 200.
    pub health_failed: u64,
    /// Slowloris connections the edge closed.
    pub slowloris_cut: u64,
    /// Per node: mean RSS MiB over the middle third, the last third, and
    /// the growth in percent.
    pub rss: BTreeMap<String, (f64, f64, f64)>,
    /// The flooder's own counts (`adversary.json`).
    pub flood: BTreeMap<String, u64>,
    /// What the gateway counted of the flood (its /metrics, end minus start).
    pub gateway_counters: BTreeMap<String, f64>,
    /// The gateway's RocksDB memory at the end (MiB): memtables, block
    /// cache, table readers.
    pub gateway_rocksdb_mib: BTreeMap<String, f64>,
}

fn pct(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Gateway counters whose change over the run says what became of the flood.
const COUNTERS: [&str; 7] = [
    "gcs_network_events_dropped_total",
    "gcs_gossip_merges_queued_total",
    "gcs_gossip_merges_shed_total",
    "gcs_keyspace_deltas_refused_quota_total",
    "gcs_keyspace_deltas_refused_clock_total",
    "gcs_connections_denied_total",
    "gcs_fresh_registrations",
];

fn counters(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for l in text.lines() {
        let mut it = l.split_whitespace();
        if let (Some(name), Some(v)) = (it.next(), it.next()) {
            if COUNTERS.contains(&name) {
                out.insert(name.to_string(), v.parse().unwrap_or(0.0));
            }
        }
    }
    out
}

/// Sums a gauge family (`name{...} value`, or one unlabelled `name value`).
fn family_sum(text: &str, name: &str) -> f64 {
    let (labelled, bare) = (format!("{name}{{"), format!("{name} "));
    text.lines()
        .filter(|l| l.starts_with(&labelled) || l.starts_with(&bare))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum()
}

/// Runs the soak for `secs` in `workdir`.
pub fn run(spec: &SoakSpec, secs: u64, bin: &Path, workdir: &Path) -> Result<SoakReport, Error> {
    let mut cluster = Cluster::start(bin, workdir, &spec.nodes)?;
    let workers = spec.nodes.iter().filter(|n| n.role == Role::Worker).count();
    cluster.wait_registrations(workers)?;
    let gw_name = spec
        .nodes
        .iter()
        .find(|n| n.role == Role::Gateway)
        .map(|n| n.name.clone())
        .ok_or_else(|| Error::Setup("a soak needs a gateway".into()))?;
    let before = cluster.nodes[&gw_name].metrics_text().map(|t| counters(&t)).unwrap_or_default();
    cluster.start_pending()?;
    let gw = &cluster.nodes[&gw_name];
    let addr: SocketAddr = gw.http;
    let key = cluster.keys.get(&gw_name).cloned().unwrap_or_default();
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();

    let records = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..spec.streams)
        .map(|_| {
            let (key, records, stop, max_tokens) =
                (key.clone(), records.clone(), stop.clone(), spec.max_tokens);
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let r = stream(addr, &key, max_tokens);
                    records.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                }
            })
        })
        .collect();
    let loris = {
        let (stop, n, every) =
            (stop.clone(), spec.slowloris, Duration::from_secs(spec.slowloris_every_s));
        std::thread::spawn(move || slowloris(addr, n, every, &stop))
    };
    let probes = Arc::new(Mutex::new(Vec::new()));
    let bad_health = Arc::new(AtomicU64::new(0));
    let prober = {
        let (stop, probes, bad) = (stop.clone(), probes.clone(), bad_health.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let (ms, status) = health(addr);
                if status != 200 {
                    bad.fetch_add(1, Ordering::Relaxed);
                }
                probes.lock().unwrap_or_else(|p| p.into_inner()).push(ms);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    // RSS of every gcs-node once a second; the gateway's RocksDB memory
    // every 30 s (in the log, to set beside the RSS).
    let mut rss: BTreeMap<String, Vec<(f64, u64)>> = BTreeMap::new();
    let mut last_mem = Instant::now();
    while t0.elapsed() < Duration::from_secs(secs) {
        for (name, n) in cluster.nodes.iter().filter(|(_, n)| n.role != Role::Adversary) {
            if let Some(kib) = n.rss_kib() {
                rss.entry(name.clone()).or_default().push((t0.elapsed().as_secs_f64(), kib));
            }
        }
        if last_mem.elapsed() >= Duration::from_secs(30) {
            last_mem = Instant::now();
            if let Some(t) = gw.metrics_text() {
                tracing::info!(
                    t_s = t0.elapsed().as_secs(),
                    rss_mib = gw.rss_kib().unwrap_or(0) / 1024,
                    memtables_mib = family_sum(&t, "gcs_rocksdb_memtable_bytes") / 1048576.0,
                    block_cache_mib = family_sum(&t, "gcs_rocksdb_block_cache_bytes") / 1048576.0,
                    "soak gateway memory"
                );
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.join();
    }
    let slowloris_cut = loris.join().unwrap_or(0);
    let _ = prober.join();

    let mut report = SoakReport { seconds: secs, slowloris_cut, ..Default::default() };
    let recs = records.lock().unwrap_or_else(|p| p.into_inner()).clone();
    for (end, _) in &recs {
        *report.ends.entry(end.kind()).or_default() += 1;
    }
    report.streams = recs.len();
    report.completed = recs.iter().filter(|r| r.0 == End::Complete).count();
    report.unclean = recs
        .iter()
        .filter(|r| matches!(r.0, End::Unclean(_)))
        .take(20)
        .map(|r| format!("{:?}", r.0))
        .collect();
    let mut ttft: Vec<u64> = recs.iter().filter_map(|r| r.1).collect();
    ttft.sort_unstable();
    (report.ttft_p50_ms, report.ttft_p99_ms) = (pct(&ttft, 0.5), pct(&ttft, 0.99));
    let mut lat = probes.lock().unwrap_or_else(|p| p.into_inner()).clone();
    lat.sort_unstable();
    report.health_probes = lat.len();
    (report.health_p50_ms, report.health_p99_ms) = (pct(&lat, 0.5), pct(&lat, 0.99));
    report.health_max_ms = lat.last().copied().unwrap_or(0);
    report.health_failed = bad_health.load(Ordering::Relaxed);
    let third = secs as f64 / 3.0;
    let mean = |v: &[(f64, u64)], lo: f64, hi: f64| {
        let w: Vec<u64> = v.iter().filter(|(t, _)| *t >= lo && *t < hi).map(|x| x.1).collect();
        w.iter().sum::<u64>() as f64 / w.len().max(1) as f64 / 1024.0
    };
    for (name, v) in &rss {
        let (mid, last) = (mean(v, third, 2.0 * third), mean(v, 2.0 * third, f64::MAX));
        report.rss.insert(name.clone(), (mid, last, (last - mid) / mid.max(1.0) * 100.0));
    }
    for n in cluster.nodes.values().filter(|n| n.role == Role::Adversary) {
        report.flood.extend(crate::adversary::read_report(&n.dir));
    }
    if let Some(t) = gw.metrics_text() {
        for (k, v) in counters(&t) {
            let was = before.get(&k).copied().unwrap_or(0.0);
            report.gateway_counters.insert(k, v - was);
        }
        for (k, f) in [
            ("memtables", "gcs_rocksdb_memtable_bytes"),
            ("block_cache", "gcs_rocksdb_block_cache_bytes"),
            ("table_readers", "gcs_rocksdb_table_readers_bytes"),
        ] {
            report.gateway_rocksdb_mib.insert(k.into(), family_sum(&t, f) / 1048576.0);
        }
    }
    Ok(report)
}

impl SoakReport {
    /// The checks of `spec` over these figures.
    pub fn checks(&self, spec: &SoakSpec) -> Vec<Check> {
        let c = |name, ok, detail: String| Check { name, ok, detail };
        let mut out = vec![
            c(
                "streams_end_clean",
                self.unclean.is_empty(),
                format!(
                    "{} streams, ends {:?}; unclean: {:?}",
                    self.streams, self.ends, self.unclean
                ),
            ),
            c(
                "streams_complete",
                self.completed >= spec.streams as usize,
                format!("{} completed", self.completed),
            ),
            c(
                "slowloris_cut",
                self.slowloris_cut >= spec.slowloris as u64,
                format!("{} cut by the edge", self.slowloris_cut),
            ),
            c(
                "health_always_200",
                self.health_failed == 0,
                format!("{} of {} probes failed", self.health_failed, self.health_probes),
            ),
            c(
                "health_p99",
                self.health_p99_ms < spec.health_p99_ms,
                format!(
                    "p50 {} p99 {} max {} ms (bound {} ms)",
                    self.health_p50_ms, self.health_p99_ms, self.health_max_ms, spec.health_p99_ms
                ),
            ),
        ];
        if spec.nodes.iter().any(|n| n.role == Role::Adversary) {
            let sent = self.flood.get("flood_sent").copied().unwrap_or(0);
            let missing: Vec<&str> = crate::adversary_flood::REQUIRED
                .iter()
                .copied()
                .filter(|k| self.flood.get(*k).copied().unwrap_or(0) == 0)
                .collect();
            let least = spec.flood_min_rate * self.seconds as f64 * 0.5;
            out.push(c(
                "flood_sent",
                missing.is_empty() && sent as f64 >= least,
                format!(
                    "{sent} sent (least {least:.0}), kinds missing {missing:?}: {:?}",
                    self.flood
                ),
            ));
        }
        for (name, (mid, last, growth)) in &self.rss {
            let (ok, bound) = if self.seconds >= 300 {
                (*growth <= spec.rss_growth_pct, format!("{}%", spec.rss_growth_pct))
            } else {
                (last - mid <= spec.ci_rss_growth_mib, format!("{} MiB", spec.ci_rss_growth_mib))
            };
            out.push(c(
                "rss_flat",
                ok,
                format!("{name}: {mid:.1} -> {last:.1} MiB ({growth:+.1}%, bound {bound})"),
            ));
        }
        out
    }

    /// As a scenario outcome (the `netsim run` table and JSON report).
    pub fn outcome(&self, spec: &SoakSpec, seconds: f64) -> Outcome {
        Outcome {
            scenario: spec.name.clone(),
            entries: vec![],
            faults: vec![],
            unfired: vec![],
            rss_growth_mib: self.rss.iter().map(|(k, v)| (k.clone(), v.1 - v.0)).collect(),
            run_checks: self.checks(spec),
            seconds,
            skipped: None,
        }
    }

    /// One line of figures.
    pub fn summary(&self) -> String {
        format!(
            "soak {} s: {} streams ({} complete), ends {:?}, TTFT p50 {} ms p99 {} ms; /health {} \
             probes p50 {} ms p99 {} ms max {} ms ({} not 200); slowloris cut {}; RSS MiB \
             (middle third, last third, %): {:?}; flood {:?}; gateway counters {:?}; gateway \
             RocksDB MiB {:?}",
            self.seconds,
            self.streams,
            self.completed,
            self.ends,
            self.ttft_p50_ms,
            self.ttft_p99_ms,
            self.health_probes,
            self.health_p50_ms,
            self.health_p99_ms,
            self.health_max_ms,
            self.health_failed,
            self.slowloris_cut,
            self.rss,
            self.flood,
            self.gateway_counters,
            self.gateway_rocksdb_mib,
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn spec(adversary: bool) -> SoakSpec {
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/soak.toml"),
        )
        .unwrap();
        let mut s: SoakSpec = toml::from_str(&text).unwrap();
        if !adversary {
            s.nodes.retain(|n| n.role != Role::Adversary);
        }
        s
    }

    fn good(secs: u64) -> SoakReport {
        let flood = crate::adversary_flood::REQUIRED.iter().map(|k| (k.to_string(), 1)).collect();
        let mut r = SoakReport {
            seconds: secs,
            streams: 40,
            completed: 40,
            health_probes: 100,
            health_p99_ms: 10,
            slowloris_cut: 1000,
            flood,
            ..Default::default()
        };
        r.flood.insert("flood_sent".into(), 30 * secs);
        r.rss.insert("gw".into(), (80.0, 84.0, 5.0));
        r
    }

    fn failed(r: &SoakReport, s: &SoakSpec) -> Vec<&'static str> {
        r.checks(s).into_iter().filter(|c| !c.ok).map(|c| c.name).collect()
    }

    #[test]
    fn every_soak_check_can_fail() {
        let s = spec(true);
        assert!(failed(&good(600), &s).is_empty(), "{:?}", good(600).checks(&s));
        let mut r = good(600);
        r.unclean.push("cut".into());
        r.health_p99_ms = 150;
        r.health_failed = 1;
        r.slowloris_cut = 3;
        r.completed = 2;
        r.rss.insert("gw".into(), (80.0, 96.0, 20.0));
        r.flood.remove("flood_usage");
        assert_eq!(
            failed(&r, &s),
            [
                "streams_end_clean",
                "streams_complete",
                "slowloris_cut",
                "health_always_200",
                "health_p99",
                "flood_sent",
                "rss_flat"
            ]
        );
        // A short run is bounded in MiB, not percent: +16 MiB passes there.
        let mut short = good(60);
        short.rss.insert("gw".into(), (60.0, 76.0, 26.0));
        assert!(failed(&short, &s).is_empty());
        short.rss.insert("gw".into(), (60.0, 99.0, 65.0));
        assert_eq!(failed(&short, &s), ["rss_flat"]);
        // Too few flood messages for the rate.
        let mut slow = good(600);
        slow.flood.insert("flood_sent".into(), 100);
        assert_eq!(failed(&slow, &s), ["flood_sent"]);
        // Without a flooder there is no flood check.
        assert!(failed(&slow, &spec(false)).is_empty());
    }

    #[test]
    fn metrics_are_read_from_the_text_format() {
        let text = "gcs_rocksdb_memtable_bytes{cf=\"a\"} 1048576\n\
                    gcs_rocksdb_memtable_bytes{cf=\"b\"} 1048576\n\
                    gcs_rocksdb_block_cache_bytes 2097152\n\
                    gcs_gossip_merges_queued_total 12\n\
                    gcs_other 3\n";
        assert_eq!(family_sum(text, "gcs_rocksdb_memtable_bytes"), 2097152.0);
        assert_eq!(family_sum(text, "gcs_rocksdb_block_cache_bytes"), 2097152.0);
        let c = counters(text);
        assert_eq!(c.get("gcs_gossip_merges_queued_total"), Some(&12.0));
        assert!(!c.contains_key("gcs_other"));
        assert!(SoakSpec::is_soak(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/soak.toml")
        ));
        assert!(!SoakSpec::is_soak(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/slow_client.toml")
        ));
    }
}
