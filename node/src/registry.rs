//! The registry of fresh worker registrations (26.10): a plain state machine
//! with time as an input. Bounded: registrations are a peer's word and node
//! ids cost nothing, so at most [`MAX_NODES`] are held; expired ones are
//! pruned, and a new node finds room only when one has expired (the nodes
//! already known keep refreshing theirs: a sybil flood cannot evict them).

use std::collections::BTreeMap;

use gcs_protocol::{Limits, NodeId, NodeRegistration, NodeStatus};

/// Most registrations held.
pub const MAX_NODES: usize = 4096;

/// What accepting a registration did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accepted {
    /// First registration from this node (or first after it went stale).
    New,
    /// A newer heartbeat of a known node.
    Refreshed,
    /// Not newer than the one held: ignored.
    Outdated,
    /// Already expired on arrival: ignored.
    Stale,
    /// The node said it is going offline: removed.
    Offline,
    /// A new node while [`MAX_NODES`] fresh ones are held: ignored.
    Full,
}

/// Fresh registrations by node.
#[derive(Debug, Default)]
pub struct Registry {
    nodes: BTreeMap<NodeId, NodeRegistration>,
    limits: Limits,
    cap: usize,
}

impl Registry {
    /// An empty registry.
    pub fn new(limits: Limits) -> Self {
        Self::with_cap(limits, MAX_NODES)
    }

    /// An empty registry holding at most `cap` registrations.
    pub fn with_cap(limits: Limits, cap: usize) -> Self {
        Self { nodes: BTreeMap::new(), limits, cap }
    }

    /// Takes a verified registration.
    pub fn accept(&mut self, reg: NodeRegistration, now_ms: u64) -> Accepted {
        if let Some(cur) = self.nodes.get(&reg.node_id) {
            if reg.heartbeat.created_at_ms <= cur.heartbeat.created_at_ms {
                return Accepted::Outdated;
            }
        }
        if reg.status == NodeStatus::Offline {
            self.nodes.remove(&reg.node_id);
            return Accepted::Offline;
        }
        if !reg.is_fresh(now_ms, &self.limits) {
            return Accepted::Stale;
        }
        if self.nodes.len() >= self.cap && !self.nodes.contains_key(&reg.node_id) {
            self.prune(now_ms);
            if self.nodes.len() >= self.cap {
                return Accepted::Full;
            }
        }
        match self.nodes.insert(reg.node_id.clone(), reg) {
            None => Accepted::New,
            Some(_) => Accepted::Refreshed,
        }
    }

    /// Drops registrations that expired; returns their nodes.
    pub fn prune(&mut self, now_ms: u64) -> Vec<NodeId> {
        let limits = self.limits.clone();
        let gone: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|(_, r)| !r.is_fresh(now_ms, &limits))
            .map(|(n, _)| n.clone())
            .collect();
        for n in &gone {
            self.nodes.remove(n);
        }
        gone
    }

    /// Fresh registrations at `now_ms`.
    pub fn fresh(&self, now_ms: u64) -> impl Iterator<Item = &NodeRegistration> {
        let limits = self.limits.clone();
        self.nodes.values().filter(move |r| r.is_fresh(now_ms, &limits))
    }

    /// The registration of `node`, fresh or not.
    pub fn get(&self, node: &NodeId) -> Option<&NodeRegistration> {
        self.nodes.get(node)
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

    #[test]
    fn a_full_registry_takes_new_nodes_only_as_old_ones_expire() {
        let p = Params::default();
        let t = p.now_ms;
        let mut reg = Registry::with_cap(Limits::default(), 2);
        let keys: Vec<_> = (1u8..=3).map(|i| gcs_protocol::NodeKey::from_seed([i; 32])).collect();
        assert_eq!(reg.accept(samples::registration(&keys[0], &p), t), Accepted::New);
        let later = Params { now_ms: t + 5_000, ..p.clone() };
        assert_eq!(reg.accept(samples::registration(&keys[1], &later), t + 5_000), Accepted::New);
        assert_eq!(reg.accept(samples::registration(&keys[2], &later), t + 5_000), Accepted::Full);
        // Known nodes still refresh while full.
        let again = Params { now_ms: t + 6_000, ..p.clone() };
        assert_eq!(
            reg.accept(samples::registration(&keys[1], &again), t + 6_000),
            Accepted::Refreshed
        );
        // The first one expires (30 s): room for the newcomer.
        let late = Params { now_ms: t + 30_000, ..p.clone() };
        assert_eq!(reg.accept(samples::registration(&keys[2], &late), t + 30_000), Accepted::New);
        assert!(reg.get(&keys[0].node_id()).is_none());
        assert_eq!(reg.fresh(t + 30_000).count(), 2);
    }
}
