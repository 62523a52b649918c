//! Gossip benchmark on loopback: job-announcement propagation latency among
//! 10 real libp2p nodes (p50/p99), and registrations processed per second
//! by a receiving node.
//! Run: `cargo bench -p gcs-node --bench gossip`
//! (under `cargo test --benches` it runs a 3-node smoke version).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::type_complexity)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gcs_keyspace::Keyspace;
use gcs_node::{topics, Identity, NetEvent, Network, NetworkConfig};
use gcs_protocol::samples::{self, Params};
use gcs_protocol::{ids, sign, Message, NodeKey};

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (n_nodes, n_jobs, n_regs) = if full { (10, 300, 3000) } else { (3, 10, 100) };
    let mut dirs = vec![];
    let mut nets = vec![];
    let mut addrs: Vec<libp2p::Multiaddr> = vec![];
    let latencies: Arc<Mutex<Vec<f64>>> = Arc::default();
    let sent: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let regs_seen: Arc<Mutex<(usize, Option<Instant>, Option<Instant>)>> = Arc::default();
    for i in 0..n_nodes {
        let dir = tempfile::tempdir().unwrap();
        let id = Identity::from_seed([i as u8 + 1; 32]).unwrap();
        let ks = Arc::new(
            Keyspace::open(dir.path(), id.node_id().as_str(), Default::default()).unwrap(),
        );
        let mut cfg = NetworkConfig { mdns: false, ..NetworkConfig::default() };
        cfg.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
        // A sparse topology: each node dials the first node and its predecessor.
        cfg.bootstrap = [addrs.first(), addrs.last()].into_iter().flatten().cloned().collect();
        cfg.bootstrap.dedup();
        let (net, mut events) = Network::start(&id, cfg, ks).await.unwrap();
        net.subscribe(topics::API_JOBS_ALL).await.unwrap();
        net.subscribe(topics::CAPABILITIES_ALL).await.unwrap();
        let t = Instant::now();
        let addr = loop {
            if let Some(a) = net.listen_addrs().await.unwrap().into_iter().next() {
                break a.with(libp2p::multiaddr::Protocol::P2p(net.peer_id()));
            }
            assert!(t.elapsed() < Duration::from_secs(30), "no listen address after 30 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        addrs.push(addr);
        let (lat, sent, regs) = (latencies.clone(), sent.clone(), regs_seen.clone());
        let is_counter = i == n_nodes - 1;
        tokio::spawn(async move {
            while let Some(ev) = events.recv().await {
                if let NetEvent::Message { message, .. } = ev {
                    match *message {
                        Message::ApiRequestJob(j) => {
                            if let Some(t) = sent.lock().unwrap().get(&j.job_id) {
                                lat.lock().unwrap().push(t.elapsed().as_secs_f64() * 1000.0);
                            }
                        }
                        Message::NodeRegistration(_) if is_counter => {
                            let mut r = regs.lock().unwrap();
                            r.0 += 1;
                            r.1.get_or_insert_with(Instant::now);
                            r.2 = Some(Instant::now());
                        }
                        _ => {}
                    }
                }
            }
        });
        dirs.push(dir);
        nets.push(net);
    }
    // Let the gossip mesh form.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let gw = NodeKey::from_seed([0xaa; 32]);
    for k in 0..n_jobs {
        let now = gcs_node::now_ms();
        let mut job = samples::api_job(&gw, &Params { now_ms: now, ..Default::default() });
        job.job_id = ids::new_id(ids::JOB, now).unwrap();
        sign(&mut job, &gw).unwrap();
        let bytes = gcs_protocol::encode(&job).unwrap();
        sent.lock().unwrap().insert(job.job_id.clone(), Instant::now());
        nets[k % n_nodes].publish(topics::API_JOBS_ALL, bytes).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let expected = n_jobs * (n_nodes - 1);
    let deadline = Instant::now() + Duration::from_secs(20);
    while latencies.lock().unwrap().len() < expected && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut l = latencies.lock().unwrap().clone();
    l.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "gossip propagation, {n_nodes} nodes, {n_jobs} job announcements: delivered {}/{expected}, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        l.len(),
        pct(&l, 0.5),
        pct(&l, 0.99),
        l.last().unwrap()
    );
    assert!(l.len() * 100 >= expected * 99, "lost announcements");

    // Registrations: pre-signed by distinct keys, published in a burst from
    // node 0, counted at the last node (decode + signature + clock checks).
    let now = gcs_node::now_ms();
    let regs: Vec<Vec<u8>> = (0..n_regs)
        .map(|i| {
            let mut seed = [0u8; 32];
            seed[..8].copy_from_slice(&(i as u64 + 1000).to_le_bytes());
            let key = NodeKey::from_seed(seed);
            let mut r = samples::registration(&key, &Params { now_ms: now, ..Default::default() });
            sign(&mut r, &key).unwrap();
            gcs_protocol::encode(&r).unwrap()
        })
        .collect();
    for r in regs {
        nets[0].publish(topics::CAPABILITIES_ALL, r).await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while regs_seen.lock().unwrap().0 < n_regs && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (count, first, last) = *regs_seen.lock().unwrap();
    let secs = match (first, last) {
        (Some(a), Some(b)) => (b - a).as_secs_f64().max(1e-6),
        _ => f64::NAN,
    };
    println!(
        "registrations: {count}/{n_regs} received at the far node, {:.0} registrations/s (first to last arrival)",
        count as f64 / secs
    );
    for n in &nets {
        n.shutdown().await;
    }
}
