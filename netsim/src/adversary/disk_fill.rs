//! The disk-fill attack (issue 14 §1, issue 15 §3): a second identity in the
//! adversary process — its own libp2p peer, so the penalties it earns do
//! not silence the adversary's other attacks — gossips validly signed job
//! records of a gateway of its own making on `gcs.keyspace.deltas` as fast
//! as it can, and floods every peer with anti-entropy requests naming one
//! tenant thousands of times. The honest nodes must keep what it adds to
//! their keyspace within its per-peer quota (`--peer-quota-bytes`) and
//! answer its requests beyond the per-peer rate with "busy"; the scenario
//! checks both on the gateway's /metrics (`crate::checks::disk_fill`).

use std::sync::Arc;

use gcs_keyspace::{keys, Keyspace, KeyspaceOptions};
use gcs_node::network::AntiEntropyRequest;
use gcs_node::{now_ms, Identity, Network, NetworkConfig};
use gcs_protocol::NodeKey;

use super::Adv;

/// Attack kinds the disk-fill identity must have carried out.
pub const DISK_REQUIRED: [&str; 2] = ["disk_fill_delta", "anti_entropy_flood"];

/// The disk-fill kinds a run with this report must have carried out (the
/// wire attacks run it; the trust attacks do not).
pub fn disk_required(report: &std::collections::BTreeMap<String, u64>) -> &'static [&'static str] {
    if report.contains_key(super::TRUST_MODE) {
        &[]
    } else {
        &DISK_REQUIRED
    }
}

/// Job deltas gossiped per tick (~1.6 KB each).
const DELTAS_PER_TICK: u64 = 200;
/// Anti-entropy requests per peer per tick.
const REQUESTS_PER_TICK: usize = 30;

/// The flooding identity.
pub(super) struct Filler {
    net: Network,
    key: NodeKey,
    ks: Arc<Keyspace>,
    sent: std::sync::atomic::AtomicU64,
}

impl Filler {
    /// Starts the second identity next to the adversary (its own data
    /// directory, the same bootstrap, any free port on the same address).
    pub(super) async fn start(
        dir: &std::path::Path,
        listen: &str,
        bootstrap: &[String],
    ) -> anyhow::Result<Filler> {
        let dir = dir.join("disk-fill");
        std::fs::create_dir_all(&dir)?;
        let identity = Identity::load_or_create(&dir)?;
        let ks = Arc::new(Keyspace::open(
            &dir.join("keyspace"),
            identity.node_id().as_str(),
            KeyspaceOptions::default(),
        )?);
        let mut cfg = NetworkConfig { mdns: false, ..NetworkConfig::default() };
        let any_port: libp2p::Multiaddr = listen
            .parse::<libp2p::Multiaddr>()?
            .iter()
            .map(|p| match p {
                libp2p::multiaddr::Protocol::Tcp(_) => libp2p::multiaddr::Protocol::Tcp(0),
                p => p,
            })
            .collect();
        cfg.listen = vec![any_port];
        cfg.bootstrap = bootstrap.iter().map(|b| b.parse()).collect::<Result<_, _>>()?;
        let (net, events) = Network::start(&identity, cfg, ks.clone()).await?;
        // Nobody reads its events; dropping the receiver is fine (the loop
        // never waits on it).
        drop(events);
        net.subscribe(gcs_node::topics::KEYSPACE_DELTAS).await?;
        let key = NodeKey::from_seed(identity.key.seed());
        Ok(Filler { net, key, ks, sent: Default::default() })
    }

    /// One tick of the attack.
    pub(super) async fn tick(&self, adv: &Adv) {
        use std::sync::atomic::Ordering::Relaxed;
        for _ in 0..DELTAS_PER_TICK {
            let n = self.sent.fetch_add(1, Relaxed);
            let p = gcs_protocol::samples::Params { now_ms: now_ms(), n, ..Default::default() };
            let mut job = gcs_protocol::samples::api_job(&self.key, &p);
            job.job_id = format!("gcsapi_diskfill{n:08}");
            job.signature = None;
            if gcs_protocol::sign(&mut job, &self.key).is_err() {
                continue;
            }
            let Ok(bytes) = gcs_protocol::encode(&job) else { continue };
            let Ok(delta) = self.ks.put(&keys::job(&job.job_id), bytes, now_ms()) else { continue };
            if self.net.publish(gcs_node::topics::KEYSPACE_DELTAS, delta.encode()).await.is_ok() {
                adv.bump("disk_fill_delta");
            }
        }
        let req = AntiEntropyRequest {
            version: 1,
            digests: vec![],
            tenants: vec![("tenant_1".into(), vec![0; 32], 1); 2000],
            since: None,
            after: vec![],
        };
        for peer in self.net.peers().await.unwrap_or_default() {
            let mut reqs = vec![];
            for _ in 0..REQUESTS_PER_TICK {
                let (net, req) = (self.net.clone(), req.clone());
                reqs.push(tokio::spawn(async move { net.anti_entropy_request(peer, req).await }));
            }
            for r in reqs {
                adv.bump("anti_entropy_flood");
                if let Ok(Ok(a)) = r.await {
                    adv.bump(if a.busy { "anti_entropy_busy" } else { "anti_entropy_answered" });
                }
            }
        }
    }
}

/// Bytes under `dir`, recursively (a data directory's size on disk).
pub fn dir_bytes(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}
