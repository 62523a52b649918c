//! What a peer's delta must pass before it is merged, besides record
//! authority (`replication.rs`): its clock within bounds, and its sender
//! within the per-peer quota of bytes and keys. Shared by the swarm loop
//! (gossip) and the anti-entropy tasks (pages), so one quota covers both.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use gcs_keyspace::{CrdtValue, Delta, Keyspace, KeyspaceError, MergeOutcome};
use libp2p::PeerId;

use crate::quota::{PeerQuotas, QuotaExceeded};
use crate::replication::{self, RefusedDelta};
use crate::tenants::refusals::UsageRefusal;

/// Actors in a set's causal context (and dots per element) at most: a set
/// is written by the few nodes that claim one job.
pub const MAX_SET_ACTORS: usize = 256;
/// The largest dot counter accepted: an actor that has written this often
/// is lying, and a counter near `u64::MAX` would overflow our next add.
pub const MAX_DOT: u64 = 1 << 32;

/// Counters of what the network layer refused or shed (read by /metrics).
#[derive(Debug, Default)]
pub struct NetStats {
    /// Deltas refused because their sender's quota was spent.
    pub quota_refused: AtomicU64,
    /// Deltas refused for an HLC (or set clock) out of bounds.
    pub clock_refused: AtomicU64,
    /// Anti-entropy requests answered "busy" (rate or concurrency).
    pub ae_busy: AtomicU64,
    /// Anti-entropy requests answered.
    pub ae_answered: AtomicU64,
    /// Anti-entropy rounds this node started.
    pub ae_rounds: AtomicU64,
    /// Rounds stopped at the page cap (resumed next round).
    pub ae_rounds_capped: AtomicU64,
    /// Connections refused by the connection limits.
    pub connections_denied: AtomicU64,
    /// Gossiped deltas handed to the merge worker.
    pub gossip_merges_queued: AtomicU64,
    /// Gossiped deltas dropped because the merge worker's queue was full.
    pub gossip_merges_shed: AtomicU64,
}

impl NetStats {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Why a peer's delta was not merged.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// Its sender's quota is spent.
    #[error(transparent)]
    Quota(#[from] QuotaExceeded),
    /// Its HLC is too far ahead, or a counter is out of bounds.
    #[error("clock out of bounds: {0}")]
    Clock(String),
    /// Refused by decoding or by record authority.
    #[error(transparent)]
    Delta(#[from] RefusedDelta),
}

/// Checks a delta's clocks: the HLC within `max_drift_ms` of `now_ms` and a
/// bounded logical counter; a set's causal context and dots bounded.
pub fn check_clock(d: &Delta, now_ms: u64, max_drift_ms: u64) -> Result<(), Refused> {
    gcs_keyspace::check_remote(d.value.updated(), now_ms, max_drift_ms)
        .map_err(|e: KeyspaceError| Refused::Clock(e.to_string()))?;
    if let CrdtValue::Set(s) = &d.value {
        let bad = |dots: &std::collections::BTreeMap<String, u64>| {
            dots.len() > MAX_SET_ACTORS || dots.values().any(|c| *c > MAX_DOT)
        };
        if bad(&s.clock.dots) || s.entries.values().any(bad) {
            return Err(Refused::Clock("set clock out of bounds".into()));
        }
    }
    Ok(())
}

/// The merge path every peer delta takes.
#[derive(Clone, Debug)]
pub struct Intake {
    /// The store.
    pub keyspace: Arc<Keyspace>,
    /// Bytes and keys per peer per window.
    pub quotas: Arc<Mutex<PeerQuotas<PeerId>>>,
    /// Counters.
    pub stats: Arc<NetStats>,
    /// Which tenant gateways may write usage records.
    pub trust: crate::tenants::TrustHandle,
}

impl Intake {
    fn quotas(&self) -> std::sync::MutexGuard<'_, PeerQuotas<PeerId>> {
        self.quotas.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks and merges one encoded delta from `peer`, of a global
    /// namespace or the usage of a tenant in `served`. Only a delta that
    /// changed the store is charged to the peer's quota.
    pub fn merge(
        &self,
        peer: &PeerId,
        bytes: &[u8],
        served: &[String],
        now_ms: u64,
    ) -> Result<MergeOutcome, Refused> {
        // Decoded once here; authority and the merge take the value.
        let d = Delta::decode(bytes).map_err(RefusedDelta::from)?;
        // Usage refused before its own checks still counts as a refused
        // usage record (`gcs_usage_refused_total`).
        let usage = |why| {
            if gcs_keyspace::Namespace::of_key(&d.key).ok()
                == Some(gcs_keyspace::Namespace::ApiUsage)
            {
                self.trust.count_refused_usage(why);
            }
        };
        if let Err(e) = check_clock(&d, now_ms, self.keyspace.max_clock_drift_ms()) {
            NetStats::bump(&self.stats.clock_refused);
            usage(UsageRefusal::Clock);
            return Err(e);
        }
        let size = bytes.len() as u64;
        if let Err(e) = self.quotas().check(peer, size, now_ms) {
            NetStats::bump(&self.stats.quota_refused);
            usage(UsageRefusal::Quota);
            return Err(e.into());
        }
        let out = replication::merge_scoped(&self.keyspace, d, served, &self.trust, now_ms);
        // A stale record cost a replay and is not penalised: its author's
        // quota bounds how many a peer can send.
        if matches!(out, Ok(MergeOutcome::Changed(_)) | Err(RefusedDelta::Stale(_))) {
            self.quotas().charge(peer, size, now_ms);
        }
        Ok(out?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::QuotaConfig;
    use gcs_protocol::samples::{self, Params};

    fn intake(dir: &tempfile::TempDir, cfg: QuotaConfig) -> Intake {
        let ks = Keyspace::open(dir.path(), "me", Default::default()).unwrap();
        Intake {
            keyspace: Arc::new(ks),
            quotas: Arc::new(Mutex::new(PeerQuotas::new(cfg))),
            stats: Arc::default(),
            trust: Arc::default(),
        }
    }

    /// Signed jobs of a self-made gateway: what any peer may publish.
    fn jobs(n: usize, at: u64) -> Vec<Vec<u8>> {
        let dir = tempfile::tempdir().unwrap();
        let peer = Keyspace::open(dir.path(), "peer", Default::default()).unwrap();
        let (_, gw) = samples::keys();
        (0..n)
            .map(|i| {
                let mut job = samples::api_job(&gw, &Params::default());
                job.job_id = format!("gcsapi_{i:05}");
                job.signature = None;
                gcs_protocol::sign(&mut job, &gw).unwrap();
                let key = gcs_keyspace::keys::job(&job.job_id);
                peer.put(&key, gcs_protocol::encode(&job).unwrap(), at).unwrap().encode()
            })
            .collect()
    }

    #[test]
    fn a_peer_beyond_its_quota_adds_nothing_more() {
        let dir = tempfile::tempdir().unwrap();
        let deltas = jobs(30, 1_000);
        let size = deltas[0].len() as u64;
        let i =
            intake(&dir, QuotaConfig { window_ms: 60_000, max_bytes: 10 * size, max_keys: 1000 });
        let (flooder, honest) = (PeerId::random(), PeerId::random());
        let mut accepted = 0;
        for d in &deltas[..20] {
            match i.merge(&flooder, d, &[], 2_000) {
                Ok(MergeOutcome::Changed(_)) => accepted += 1,
                Err(Refused::Quota(QuotaExceeded::Bytes(_))) => {}
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(accepted, 10, "exactly the quota's worth");
        assert_eq!(i.stats.quota_refused.load(Ordering::Relaxed), 10);
        let stored = i.keyspace.digest(gcs_keyspace::Namespace::ApiJobs).unwrap().count;
        assert_eq!(stored, 10);
        // Another peer has its own quota; a duplicate costs nothing.
        assert!(matches!(i.merge(&honest, &deltas[20], &[], 2_000), Ok(MergeOutcome::Changed(_))));
        assert_eq!(i.merge(&honest, &deltas[20], &[], 2_000).unwrap(), MergeOutcome::Unchanged);
        assert_eq!(i.quotas().used(&honest), (size, 1));
        // The next window takes the flooder's deltas again.
        assert!(i.merge(&flooder, &deltas[25], &[], 62_001).is_ok());
    }

    #[test]
    fn the_key_quota_counts_changed_keys() {
        let dir = tempfile::tempdir().unwrap();
        let deltas = jobs(5, 1_000);
        let i = intake(&dir, QuotaConfig { window_ms: 60_000, max_bytes: u64::MAX, max_keys: 3 });
        let p = PeerId::random();
        let ok = deltas.iter().filter(|d| i.merge(&p, d, &[], 2_000).is_ok()).count();
        assert_eq!(ok, 3);
    }

    #[test]
    fn deltas_with_clocks_out_of_bounds_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let i = intake(&dir, QuotaConfig::default());
        let p = PeerId::random();
        let future = jobs(1, 100_000).remove(0);
        assert!(matches!(i.merge(&p, &future, &[], 60_000), Err(Refused::Clock(_))), "40 s ahead");
        assert!(i.merge(&p, &future, &[], 75_000).is_ok(), "within 30 s");
        let mut d = Delta::decode(&jobs(1, 1_000)[0]).unwrap();
        if let CrdtValue::Register(r) = &mut d.value {
            r.0.marker.hlc.logical = u32::MAX;
        }
        assert!(matches!(i.merge(&p, &d.encode(), &[], 2_000), Err(Refused::Clock(_))));
        // A claims set whose context holds a counter that would overflow.
        let (w, _) = samples::keys();
        let mut c = samples::claim(&w, &Params::default());
        gcs_protocol::sign(&mut c, &w).unwrap();
        let peer_dir = tempfile::tempdir().unwrap();
        let peer = Keyspace::open(peer_dir.path(), "peer", Default::default()).unwrap();
        let mut set = peer
            .set_add(
                &gcs_keyspace::keys::claims(&c.job_id),
                &gcs_protocol::encode(&c).unwrap(),
                1_000,
            )
            .unwrap();
        if let CrdtValue::Set(s) = &mut set.value {
            s.clock.dots.insert("me".into(), u64::MAX);
        }
        assert!(matches!(i.merge(&p, &set.encode(), &[], 2_000), Err(Refused::Clock(_))));
        assert_eq!(i.stats.clock_refused.load(Ordering::Relaxed), 3);
    }
}
