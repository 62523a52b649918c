//! The registry of fresh worker registrations (26.10): a plain state machine
//! with time as an input. Bounded: registrations are a peer's word and node
//! ids cost nothing, so at most [`MAX_NODES`] are held. When full, expired
//! ones are pruned first; then a new node takes the place of the stalest
//! node on probation — the [`PROBATION`] most recently admitted. Tenure
//! protects: a sybil flood churns only the probation slots (the flooders
//! evict each other), never a node that was admitted before them and keeps
//! refreshing, and an honest newcomer still gets in (specs/network.md,
//! "Registry").

use std::collections::BTreeMap;

use gcs_protocol::{Limits, NodeId, NodeRegistration, NodeStatus};

/// Most registrations held.
pub const MAX_NODES: usize = 4096;
/// Of a full registry, the most recently admitted this many (an eighth)
/// may be evicted for a newcomer.
pub const PROBATION: usize = MAX_NODES / 8;

/// What accepting a registration did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accepted {
    /// First registration from this node (or first after it went stale);
    /// in a full registry it took the place of the stalest node on
    /// probation (see [`Registry::evictions`]).
    New,
    /// A newer heartbeat of a known node.
    Refreshed,
    /// Not newer than the one held: ignored.
    Outdated,
    /// Already expired on arrival: ignored.
    Stale,
    /// The node said it is going offline: removed.
    Offline,
    /// A new node while full and nothing may be evicted (no probation):
    /// ignored.
    Full,
}

/// Fresh registrations by node.
#[derive(Debug, Default)]
pub struct Registry {
    nodes: BTreeMap<NodeId, Entry>,
    /// Admission order (a counter, not a clock a peer could set) → node.
    admitted: BTreeMap<u64, NodeId>,
    next_admission: u64,
    limits: Limits,
    cap: usize,
    probation: usize,
    evictions: u64,
}

#[derive(Debug)]
struct Entry {
    reg: NodeRegistration,
    /// Its key in `admitted`.
    admission: u64,
}

impl Registry {
    /// An empty registry.
    pub fn new(limits: Limits) -> Self {
        Self::with_probation(limits, MAX_NODES, PROBATION)
    }

    /// An empty registry holding at most `cap` registrations, the newest
    /// `probation` of them evictable.
    pub fn with_probation(limits: Limits, cap: usize, probation: usize) -> Self {
        Self {
            nodes: BTreeMap::new(),
            admitted: BTreeMap::new(),
            next_admission: 0,
            limits,
            cap,
            probation,
            evictions: 0,
        }
    }

    /// Nodes evicted for a newcomer so far.
    #[cfg(test)]
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    fn remove(&mut self, node: &NodeId) -> Option<Entry> {
        let e = self.nodes.remove(node)?;
        self.admitted.remove(&e.admission);
        Some(e)
    }

    /// The stalest (oldest heartbeat; on a tie the newest admitted) of the
    /// `probation` most recently admitted nodes.
    fn eviction_candidate(&self) -> Option<NodeId> {
        self.admitted
            .iter()
            .rev()
            .take(self.probation)
            .filter_map(|(seq, n)| {
                self.nodes.get(n).map(|e| (e.reg.heartbeat.created_at_ms, *seq, n))
            })
            .min_by_key(|(hb, seq, _)| (*hb, std::cmp::Reverse(*seq)))
            .map(|(_, _, n)| n.clone())
    }

    /// Takes a verified registration.
    pub fn accept(&mut self, reg: NodeRegistration, now_ms: u64) -> Accepted {
        if let Some(cur) = self.nodes.get_mut(&reg.node_id) {
            if reg.heartbeat.created_at_ms <= cur.reg.heartbeat.created_at_ms {
                return Accepted::Outdated;
            }
            if reg.status != NodeStatus::Offline && reg.is_fresh(now_ms, &self.limits) {
                // A refresh keeps the node's tenure.
                cur.reg = reg;
                return Accepted::Refreshed;
            }
        }
        if reg.status == NodeStatus::Offline {
            self.remove(&reg.node_id);
            return Accepted::Offline;
        }
        if !reg.is_fresh(now_ms, &self.limits) {
            return Accepted::Stale;
        }
        if self.nodes.len() >= self.cap {
            self.prune(now_ms);
            if self.nodes.len() >= self.cap {
                let Some(victim) = self.eviction_candidate() else { return Accepted::Full };
                tracing::debug!(node = %reg.node_id, evicted = %victim, "registry full: a node on probation made room");
                self.remove(&victim);
                self.evictions += 1;
            }
        }
        let admission = self.next_admission;
        self.next_admission += 1;
        self.admitted.insert(admission, reg.node_id.clone());
        self.nodes.insert(reg.node_id.clone(), Entry { reg, admission });
        Accepted::New
    }

    /// Drops registrations that expired; returns their nodes.
    pub fn prune(&mut self, now_ms: u64) -> Vec<NodeId> {
        let limits = self.limits.clone();
        let gone: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|(_, e)| !e.reg.is_fresh(now_ms, &limits))
            .map(|(n, _)| n.clone())
            .collect();
        for n in &gone {
            self.remove(n);
        }
        gone
    }

    /// Fresh registrations at `now_ms`.
    pub fn fresh(&self, now_ms: u64) -> impl Iterator<Item = &NodeRegistration> {
        let limits = self.limits.clone();
        self.nodes.values().map(|e| &e.reg).filter(move |r| r.is_fresh(now_ms, &limits))
    }

    /// The registration of `node`, fresh or not.
    pub fn get(&self, node: &NodeId) -> Option<&NodeRegistration> {
        self.nodes.get(node).map(|e| &e.reg)
    }

    /// Whether empty.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gcs_protocol::samples::{self, Params};

    #[test]
    fn newer_heartbeats_refresh_older_ones_are_ignored_and_expiry_prunes() {
        let (w, _) = samples::keys();
        let p = Params::default();
        let t = p.now_ms;
        let mut reg = Registry::new(Limits::default());
        let r1 = samples::registration(&w, &p);
        assert_eq!(reg.accept(r1.clone(), t), Accepted::New);
        assert_eq!(reg.accept(r1.clone(), t), Accepted::Outdated);
        let r2 = samples::registration(&w, &Params { now_ms: t + 10_000, ..p.clone() });
        assert_eq!(reg.accept(r2, t + 10_000), Accepted::Refreshed);
        assert_eq!(reg.accept(r1, t + 10_000), Accepted::Outdated);
        assert_eq!(reg.fresh(t + 39_999).count(), 1);
        assert_eq!(reg.prune(t + 39_999), vec![]);
        assert_eq!(reg.prune(t + 40_000), vec![w.node_id()]);
        assert!(reg.is_empty());
    }

    #[test]
    fn stale_on_arrival_and_offline_registrations() {
        let (w, _) = samples::keys();
        let p = Params::default();
        let mut reg = Registry::new(Limits::default());
        assert_eq!(reg.accept(samples::registration(&w, &p), p.now_ms + 30_000), Accepted::Stale);
        assert_eq!(reg.accept(samples::registration(&w, &p), p.now_ms), Accepted::New);
        let mut off = samples::registration(&w, &Params { now_ms: p.now_ms + 1, ..p.clone() });
        off.status = NodeStatus::Offline;
        assert_eq!(reg.accept(off, p.now_ms + 1), Accepted::Offline);
        assert!(reg.get(&w.node_id()).is_none());
    }

    fn key(i: u32) -> gcs_protocol::NodeKey {
        let mut seed = [7u8; 32];
        seed[..4].copy_from_slice(&i.to_le_bytes());
        gcs_protocol::NodeKey::from_seed(seed)
    }

    fn at(k: &gcs_protocol::NodeKey, ms: u64) -> NodeRegistration {
        samples::registration(k, &Params { now_ms: ms, ..Params::default() })
    }

    #[test]
    fn a_full_registry_prunes_expired_nodes_first() {
        let t = Params::default().now_ms;
        let mut reg = Registry::with_probation(Limits::default(), 2, 0);
        assert_eq!(reg.accept(at(&key(0), t), t), Accepted::New);
        assert_eq!(reg.accept(at(&key(1), t + 5_000), t + 5_000), Accepted::New);
        // No probation: nothing may be evicted while both are fresh.
        assert_eq!(reg.accept(at(&key(2), t + 5_000), t + 5_000), Accepted::Full);
        assert_eq!(reg.accept(at(&key(1), t + 6_000), t + 6_000), Accepted::Refreshed);
        // The first one expires (30 s): room for the newcomer.
        assert_eq!(reg.accept(at(&key(2), t + 30_000), t + 30_000), Accepted::New);
        assert!(reg.get(&key(0).node_id()).is_none());
        assert_eq!(reg.fresh(t + 30_000).count(), 2);
    }

    /// 64 long-known honest nodes, then a flood of 10 000 fresh sybil ids
    /// into a registry of 128 (probation 16): every honest node stays, the
    /// sybils hold at most the 64 slots that were free plus probation, and
    /// an honest newcomer after the flood still gets in.
    #[test]
    fn a_sybil_flood_never_evicts_long_known_nodes_and_newcomers_still_get_in() {
        let t = Params::default().now_ms;
        let mut reg = Registry::with_probation(Limits::default(), 128, 16);
        let honest: Vec<_> = (0..64).map(key).collect();
        for k in &honest {
            assert_eq!(reg.accept(at(k, t), t), Accepted::New);
        }
        for i in 0..10_000u32 {
            let now = t + u64::from(i);
            // The honest nodes heartbeat through the flood.
            if i % 1000 == 999 {
                for k in &honest {
                    assert_eq!(reg.accept(at(k, now), now), Accepted::Refreshed);
                }
            }
            assert_eq!(reg.accept(at(&key(1_000_000 + i), now), now), Accepted::New);
            assert!(
                honest.iter().all(|k| reg.get(&k.node_id()).is_some()),
                "an honest node was evicted"
            );
        }
        assert_eq!(reg.evictions(), 10_000 - 64, "the flood churns the probation slots");
        assert_eq!(reg.fresh(t + 10_000).count(), 128);
        let newcomer = key(500_000);
        let now = t + 10_001;
        assert_eq!(reg.accept(at(&newcomer, now), now), Accepted::New);
        assert!(reg.get(&newcomer.node_id()).is_some());
        // The stalest on probation goes first: a refreshing newcomer stays
        // while sybils that do not refresh arrive.
        for i in 0..100u32 {
            let now = t + 10_002 + u64::from(i);
            assert_eq!(reg.accept(at(&newcomer, now), now), Accepted::Refreshed);
            assert_eq!(reg.accept(at(&key(2_000_000 + i), now), now), Accepted::New);
        }
        assert!(reg.get(&newcomer.node_id()).is_some(), "a refreshing newcomer is not the stalest");
    }

    #[test]
    fn an_offline_or_expired_node_loses_its_tenure() {
        let t = Params::default().now_ms;
        let mut reg = Registry::with_probation(Limits::default(), 4, 1);
        for i in 0..4 {
            assert_eq!(reg.accept(at(&key(i), t), t), Accepted::New);
        }
        let mut off = at(&key(0), t + 1);
        off.status = NodeStatus::Offline;
        assert_eq!(reg.accept(off, t + 1), Accepted::Offline);
        assert_eq!(reg.accept(at(&key(0), t + 2), t + 2), Accepted::New, "back, newest admitted");
        // Now key 0 is the one on probation.
        assert_eq!(reg.accept(at(&key(9), t + 3), t + 3), Accepted::New);
        assert!(reg.get(&key(0).node_id()).is_none() && reg.get(&key(1).node_id()).is_some());
    }
}
