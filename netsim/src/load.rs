//! Closed-loop load through one gateway: N clients, each sending its next
//! streaming request when the last one ends, for a fixed duration. Reports
//! TTFT percentiles, delivered tokens per second, errors by kind, and the
//! peak RSS of the gateway and the workers.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::client::{self, ChatRequest, Record, Shared, Terminal};
use crate::cluster::Cluster;
use crate::scenario::{NodeSpec, Role};
use crate::Error;

/// Load parameters.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    /// Concurrent clients.
    pub clients: u32,
    /// Seconds of traffic.
    pub duration_s: u64,
    /// Worker processes.
    pub workers: u32,
    /// `max_tokens` per request.
    pub max_tokens: u32,
    /// `--max-jobs` per worker.
    pub max_jobs: u32,
}

/// Load figures.
#[derive(Clone, Debug, Serialize)]
pub struct LoadReport {
    /// Requests started.
    pub requests: usize,
    /// Requests that completed.
    pub completed: usize,
    /// Errors by kind (error code, HTTP status, or terminal).
    pub errors: BTreeMap<String, usize>,
    /// Time to first token, median, ms.
    pub ttft_p50_ms: u64,
    /// Time to first token, 99th percentile, ms.
    pub ttft_p99_ms: u64,
    /// Content frames delivered per second over the run.
    pub tokens_per_s: f64,
    /// Gateway peak RSS, MiB.
    pub gateway_peak_rss_mib: f64,
    /// Largest worker peak RSS, MiB.
    pub worker_peak_rss_mib: f64,
    /// Seconds of traffic.
    pub seconds: f64,
}

fn pct(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn kind(r: &Record) -> Option<String> {
    match r.terminal {
        Terminal::Complete => None,
        Terminal::Error => Some(
            r.error
                .as_ref()
                .and_then(|e| e["code"].as_str().map(str::to_string))
                .unwrap_or_else(|| format!("http_{}", r.status)),
        ),
        ref t => Some(format!("{t:?}").to_lowercase()),
    }
}

/// Runs the load in `workdir`.
pub fn run(spec: &LoadSpec, bin: &Path, workdir: &Path) -> Result<LoadReport, Error> {
    let mut nodes = vec![NodeSpec {
        name: "gw".into(),
        role: Role::Gateway,
        bootstrap: vec![],
        args: vec![],
        clock_skew_s: None,
        registers: true,
        admitted: vec![],
        trusts: vec![],
    }];
    for i in 0..spec.workers {
        nodes.push(NodeSpec {
            name: format!("w{i}"),
            role: Role::Worker,
            bootstrap: vec!["gw".into()],
            args: vec!["--max-jobs".into(), spec.max_jobs.to_string()],
            clock_skew_s: None,
            registers: true,
            admitted: vec![],
            trusts: vec![],
        });
    }
    let cluster = Cluster::start(bin, workdir, &nodes)?;
    let gw = cluster.nodes.get("gw").ok_or_else(|| Error::Setup("no gateway".into()))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while gw.metric("gcs_fresh_registrations").unwrap_or(0.0) < f64::from(spec.workers) {
        if Instant::now() > deadline {
            return Err(Error::Setup("not every worker registered within 60 s".into()));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let (addr, key) = (gw.http, cluster.keys.get("gw").cloned().unwrap_or_default());
    let req = ChatRequest {
        prompt: "Write a short story about a lighthouse keeper.".into(),
        max_tokens: spec.max_tokens,
        stream: true,
        ban_eos: true,
        include_usage: true,
        read_bytes_per_s: None,
        rcvbuf: None,
        vanish_after_frames: None,
        timeout: Duration::from_secs(120),
        network: None,
        continuation: None,
        sampled: None,
    };
    let records = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let handles: Vec<_> = (0..spec.clients)
        .map(|_| {
            let (req, key, records, stop) =
                (req.clone(), key.clone(), records.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let r = client::chat(addr, &key, &req, &Shared::default(), &|| false);
                    records.lock().unwrap_or_else(|e| e.into_inner()).push(r);
                }
            })
        })
        .collect();
    let (mut gw_peak, mut wk_peak) = (0u64, 0u64);
    while t0.elapsed() < Duration::from_secs(spec.duration_s) {
        for n in cluster.nodes.values() {
            let rss = n.rss_kib().unwrap_or(0);
            if n.role == Role::Gateway {
                gw_peak = gw_peak.max(rss);
            } else {
                wk_peak = wk_peak.max(rss);
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        let _ = h.join();
    }
    let seconds = t0.elapsed().as_secs_f64();
    let recs = records.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut ttft: Vec<u64> = recs.iter().filter_map(|r| r.ttft_ms).collect();
    ttft.sort_unstable();
    let mut errors = BTreeMap::new();
    for k in recs.iter().filter_map(kind) {
        *errors.entry(k).or_insert(0) += 1;
    }
    let frames: u64 = recs.iter().map(|r| r.content_frames).sum();
    Ok(LoadReport {
        requests: recs.len(),
        completed: recs.iter().filter(|r| r.terminal == Terminal::Complete).count(),
        errors,
        ttft_p50_ms: pct(&ttft, 0.5),
        ttft_p99_ms: pct(&ttft, 0.99),
        tokens_per_s: frames as f64 / seconds,
        gateway_peak_rss_mib: gw_peak as f64 / 1024.0,
        worker_peak_rss_mib: wk_peak as f64 / 1024.0,
        seconds,
    })
}
