//! The soak (netsim/scenarios/soak.toml, issue 15 "Measured"): real
//! gcs-node processes on loopback — one gateway, two workers with the real
//! model — under back-to-back streams, slowloris connections and a /health
//! probe. CI runs the short variant (`ci_duration_s`); `GCS_SOAK_SECS`
//! sets another length. Prints the figures (specs/figures.md records them).
//! Without the models it says SKIP (a failure under `CI=true`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use netsim::cluster::{self, Cluster};
use netsim::scenario::{NodeSpec, Role};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Soak {
    #[allow(dead_code)]
    duration_s: u64,
    ci_duration_s: u64,
    streams: u32,
    max_tokens: u32,
    slowloris: usize,
    slowloris_every_s: u64,
    health_p99_ms: u64,
    rss_growth_pct: f64,
    ci_rss_growth_mib: f64,
    nodes: Vec<NodeSpec>,
}

fn pct(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Keeps `n` connections open that each send one more header line every
/// `every`, never finishing the head; one the edge closes is reopened.
/// Returns how many the edge closed.
fn slowloris(addr: SocketAddr, n: usize, every: Duration, stop: &AtomicBool) -> u64 {
    let open = |s: &mut Option<TcpStream>| {
        *s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok().and_then(|mut t| {
            t.set_write_timeout(Some(Duration::from_millis(200))).ok()?;
            t.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n").ok()?;
            Some(t)
        });
    };
    let mut conns: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    conns.iter_mut().for_each(open);
    let mut closed = 0;
    while !stop.load(Ordering::Relaxed) {
        let round = Instant::now();
        for c in conns.iter_mut() {
            let alive = c.as_mut().is_some_and(|t| t.write_all(b"X-Slow: 1\r\n").is_ok());
            if !alive {
                closed += 1;
                open(c);
            }
        }
        while round.elapsed() < every && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    closed
}

/// How one stream ended.
#[derive(Clone, Debug, PartialEq)]
enum End {
    /// 200 and `data: [DONE]`.
    Complete,
    /// An HTTP error status with a JSON envelope, or an SSE error event.
    CleanError(u16),
    /// Cut, garbled or hung.
    Unclean(String),
}

/// One streamed chat request, read to its end: how it ended and the
/// milliseconds to its first content chunk.
fn stream(addr: SocketAddr, key: &str, max_tokens: u32) -> (End, Option<u64>) {
    let body = serde_json::json!({"model": "gnus-auto", "stream": true, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]})
    .to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let t0 = Instant::now();
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) else {
        return (End::Unclean("connect".into()), None);
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    if s.write_all(req.as_bytes()).is_err() {
        return (End::Unclean("send".into()), None);
    }
    let (mut got, mut buf, mut ttft) = (Vec::new(), [0u8; 8192], None);
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return (End::Unclean(format!("read: {e}")), ttft),
        }
        let text = String::from_utf8_lossy(&got);
        if ttft.is_none() && text.contains("\"content\":\"") {
            ttft = Some(t0.elapsed().as_millis() as u64);
        }
        if text.contains("data: [DONE]") {
            return (End::Complete, ttft);
        }
        if t0.elapsed() > Duration::from_secs(180) {
            return (End::Unclean("no end within 180 s".into()), ttft);
        }
    }
    let text = String::from_utf8_lossy(&got);
    let status: u16 = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    if text.contains("\"error\"") && (status >= 400 || text.contains("data: {\"error\"")) {
        return (End::CleanError(status), ttft);
    }
    (End::Unclean(format!("closed without an end (status {status})")), ttft)
}

/// One GET /health: milliseconds to the whole answer, and its status.
fn health(addr: SocketAddr) -> (u64, u16) {
    let t0 = Instant::now();
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return (t0.elapsed().as_millis() as u64, 0);
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (t0.elapsed().as_millis() as u64, status)
}

#[test]
fn soak_streams_slowloris_and_health_stay_bounded() {
    if !cluster::models_present() {
        let what = format!("models in {}", cluster::model_dir().display());
        prereq::missing(&what, "run scripts/fetch-models.sh");
        return;
    }
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/soak.toml");
    let soak: Soak = toml::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let secs = std::env::var("GCS_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(soak.ci_duration_s);
    let bin = cluster::locate_gcs_node(None)
        .expect("gcs-node binary: run `cargo build --workspace` (or set GCS_NODE_BIN)");
    let tmp = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(&bin, tmp.path(), &soak.nodes).unwrap();
    let workers = soak.nodes.iter().filter(|n| n.role != Role::Gateway).count();
    cluster.wait_registrations(workers).unwrap();
    let gw = &cluster.nodes["gw"];
    let (addr, key) = (gw.http, cluster.keys["gw"].clone());
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();

    let records = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..soak.streams)
        .map(|_| {
            let (key, records, stop, max_tokens) =
                (key.clone(), records.clone(), stop.clone(), soak.max_tokens);
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let r = stream(addr, &key, max_tokens);
                    records.lock().unwrap().push(r);
                }
            })
        })
        .collect();
    let loris = {
        let (stop, n, every) =
            (stop.clone(), soak.slowloris, Duration::from_secs(soak.slowloris_every_s));
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
                probes.lock().unwrap().push(ms);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    // RSS of every node once a second.
    let mut rss: BTreeMap<String, Vec<(f64, u64)>> = BTreeMap::new();
    while t0.elapsed() < Duration::from_secs(secs) {
        for (name, n) in &cluster.nodes {
            if let Some(kib) = n.rss_kib() {
                rss.entry(name.clone()).or_default().push((t0.elapsed().as_secs_f64(), kib));
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    let closed_loris = loris.join().unwrap();
    prober.join().unwrap();

    let recs = records.lock().unwrap().clone();
    let mut ends: BTreeMap<String, usize> = BTreeMap::new();
    for (end, _) in &recs {
        *ends.entry(format!("{end:?}")).or_default() += 1;
    }
    let completed = recs.iter().filter(|r| r.0 == End::Complete).count();
    let mut ttft: Vec<u64> = recs.iter().filter_map(|r| r.1).collect();
    ttft.sort_unstable();
    let mut lat = probes.lock().unwrap().clone();
    lat.sort_unstable();
    let third = secs as f64 / 3.0;
    let mean = |v: &[(f64, u64)], lo: f64, hi: f64| {
        let w: Vec<u64> = v.iter().filter(|(t, _)| *t >= lo && *t < hi).map(|x| x.1).collect();
        w.iter().sum::<u64>() as f64 / w.len().max(1) as f64 / 1024.0
    };
    let mut growth = BTreeMap::new();
    for (name, v) in &rss {
        let (mid, last) = (mean(v, third, 2.0 * third), mean(v, 2.0 * third, f64::MAX));
        growth.insert(name.clone(), (mid, last, (last - mid) / mid.max(1.0) * 100.0));
    }
    eprintln!(
        "soak {secs} s: {} streams ({completed} complete), ends {ends:?}, TTFT p50 {} ms p99 {} \
         ms; /health {} probes p50 {} ms p99 {} ms max {} ms ({} not 200); slowloris \
         connections closed by the edge: {closed_loris}; RSS MiB (middle third, last third, \
         %): {growth:?}",
        recs.len(),
        pct(&ttft, 0.5),
        pct(&ttft, 0.99),
        lat.len(),
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        lat.last().copied().unwrap_or(0),
        bad_health.load(Ordering::Relaxed),
    );
    // Every stream completed or ended with a clean error.
    let unclean: Vec<_> = recs.iter().filter(|r| matches!(r.0, End::Unclean(_))).collect();
    assert!(unclean.is_empty(), "streams that did not end cleanly: {unclean:?}");
    assert!(completed >= soak.streams as usize, "only {completed} streams completed");
    // The slowloris connections were cut by the edge (header timeout), again and again.
    assert!(closed_loris >= soak.slowloris as u64, "slowloris closed only {closed_loris} times");
    assert_eq!(bad_health.load(Ordering::Relaxed), 0, "/health failed during the soak");
    assert!(
        pct(&lat, 0.99) < soak.health_p99_ms,
        "/health p99 {} ms (bound {} ms)",
        pct(&lat, 0.99),
        soak.health_p99_ms
    );
    for (name, (mid, last, pct_growth)) in &growth {
        if secs >= 300 {
            assert!(
                *pct_growth <= soak.rss_growth_pct,
                "{name}: RSS grew {pct_growth:.1}% from the middle to the last third"
            );
        } else {
            // A short run is still warming up (RocksDB memtables filling
            // with the jobs' records, allocator arenas): bounded in MiB.
            assert!(
                last - mid <= soak.ci_rss_growth_mib,
                "{name}: RSS grew {:.1} MiB from the middle to the last third",
                last - mid
            );
        }
    }
}
