//! The registry of fresh worker registrations (26.10): a plain state machine
//! with time as an input. Bounded: registrations are a peer's word and node
//! ids cost nothing, so at most [`MAX_NODES`] are held. When full, expired
//! ones are pruned first. Then a newcomer takes the place of a registration
//! that some other peer put on the wire (its gossip author is not the node
//! it names), from the author holding most of those: many node ids behind
//! one libp2p peer compete with each other, whenever they arrived. Only when
//! no such entry is held does it take the place of the stalest node on
//! probation — the [`PROBATION`] most recently admitted. Tenure protects: a
//! sybil flood churns only the probation slots, never a node that was
//! admitted before them and keeps refreshing, and an honest newcomer still
//! gets in (specs/network.md, "Registry").

use std::collections::{BTreeMap, BTreeSet};

use libp2p::PeerId;

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

/// Who put a registration on the wire: the signed gossip author (not the
/// relay that forwarded it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The node it names (or this node itself): what honest nodes do.
    Own,
    /// Another peer: a node id behind someone else's libp2p identity.
    Peer(PeerId),
}

/// Fresh registrations by node.
#[derive(Debug, Default)]
pub struct Registry {
    nodes: BTreeMap<NodeId, Entry>,
    /// Admission order (a counter, not a clock a peer could set) → node.
    admitted: BTreeMap<u64, NodeId>,
    /// Author → the admissions of the entries it put on the wire for other
    /// nodes, and (count, author) ordered, to find the largest at once.
    by_author: BTreeMap<PeerId, BTreeSet<u64>>,
    authors: BTreeSet<(usize, PeerId)>,
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
    /// The author it was admitted from, unless it came as its own.
    author: Option<PeerId>,
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
            by_author: BTreeMap::new(),
            authors: BTreeSet::new(),
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
        if let Some(a) = e.author {
            self.group(a, e.admission, false);
        }
        Some(e)
    }

    /// Adds (`on`) or removes an admission of `author`'s group.
    fn group(&mut self, author: PeerId, admission: u64, on: bool) {
        let set = self.by_author.entry(author).or_default();
        let before = set.len();
        if on {
            set.insert(admission);
        } else {
            set.remove(&admission);
        }
        let after = set.len();
        if after == 0 {
            self.by_author.remove(&author);
        }
        self.authors.remove(&(before, author));
        if after > 0 {
            self.authors.insert((after, author));
        }
    }

    /// The stalest entry (oldest heartbeat; on a tie the newest admitted)
    /// of the author holding the most entries of other nodes.
    fn largest_author_candidate(&self) -> Option<NodeId> {
        let (_, author) = self.authors.last()?;
        self.by_author
            .get(author)?
            .iter()
            .filter_map(|seq| {
                let n = self.admitted.get(seq)?;
                self.nodes.get(n).map(|e| (e.reg.heartbeat.created_at_ms, *seq, n))
            })
            .min_by_key(|(hb, seq, _)| (*hb, std::cmp::Reverse(*seq)))
            .map(|(_, _, n)| n.clone())
    }

    /// Entries held that another peer put on the wire, by author.
    #[cfg(test)]
    pub fn held_by(&self, author: &PeerId) -> usize {
        self.by_author.get(author).map_or(0, BTreeSet::len)
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

    /// Takes a verified registration that `source` put on the wire.
    pub fn accept(&mut self, reg: NodeRegistration, source: Source, now_ms: u64) -> Accepted {
        if let Some(cur) = self.nodes.get_mut(&reg.node_id) {
            if reg.heartbeat.created_at_ms <= cur.reg.heartbeat.created_at_ms {
                return Accepted::Outdated;
            }
            if reg.status != NodeStatus::Offline && reg.is_fresh(now_ms, &self.limits) {
                // A refresh keeps the node's tenure; one the node sent
                // itself takes it out of the group of whoever relayed it
                // under their own name first.
                cur.reg = reg;
                let (admission, left) = (cur.admission, cur.author.take_if(|_| source == Source::Own));
                if let Some(a) = left {
                    self.group(a, admission, false);
                }
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
                let victim = self.largest_author_candidate().or_else(|| self.eviction_candidate());
                let Some(victim) = victim else { return Accepted::Full };
                tracing::debug!(node = %reg.node_id, evicted = %victim, "registry full: a node made room");
                self.remove(&victim);
                self.evictions += 1;
            }
        }
        let admission = self.next_admission;
        self.next_admission += 1;
        self.admitted.insert(admission, reg.node_id.clone());
        let author = match source {
            Source::Own => None,
            Source::Peer(p) => Some(p),
        };
        if let Some(a) = author {
            self.group(a, admission, true);
        }
        self.nodes.insert(reg.node_id.clone(), Entry { reg, admission, author });
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
        assert_eq!(reg.accept(r1.clone(), Source::Own, t), Accepted::New);
        assert_eq!(reg.accept(r1.clone(), Source::Own, t), Accepted::Outdated);
        let r2 = samples::registration(&w, &Params { now_ms: t + 10_000, ..p.clone() });
        assert_eq!(reg.accept(r2, Source::Own, t + 10_000), Accepted::Refreshed);
        assert_eq!(reg.accept(r1, Source::Own, t + 10_000), Accepted::Outdated);
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
        assert_eq!(reg.accept(samples::registration(&w, &p), Source::Own, p.now_ms + 30_000), Accepted::Stale);
        assert_eq!(reg.accept(samples::registration(&w, &p), Source::Own, p.now_ms), Accepted::New);
        let mut off = samples::registration(&w, &Params { now_ms: p.now_ms + 1, ..p.clone() });
        off.status = NodeStatus::Offline;
        assert_eq!(reg.accept(off, Source::Own, p.now_ms + 1), Accepted::Offline);
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
        assert_eq!(reg.accept(at(&key(0), t), Source::Own, t), Accepted::New);
        assert_eq!(reg.accept(at(&key(1), t + 5_000), Source::Own, t + 5_000), Accepted::New);
        // No probation: nothing may be evicted while both are fresh.
        assert_eq!(reg.accept(at(&key(2), t + 5_000), Source::Own, t + 5_000), Accepted::Full);
        assert_eq!(reg.accept(at(&key(1), t + 6_000), Source::Own, t + 6_000), Accepted::Refreshed);
        // The first one expires (30 s): room for the newcomer.
        assert_eq!(reg.accept(at(&key(2), t + 30_000), Source::Own, t + 30_000), Accepted::New);
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
            assert_eq!(reg.accept(at(k, t), Source::Own, t), Accepted::New);
        }
        for i in 0..10_000u32 {
            let now = t + u64::from(i);
            // The honest nodes heartbeat through the flood.
            if i % 1000 == 999 {
                for k in &honest {
                    assert_eq!(reg.accept(at(k, now), Source::Own, now), Accepted::Refreshed);
                }
            }
            assert_eq!(reg.accept(at(&key(1_000_000 + i), now), Source::Own, now), Accepted::New);
            assert!(
                honest.iter().all(|k| reg.get(&k.node_id()).is_some()),
                "an honest node was evicted"
            );
        }
        assert_eq!(reg.evictions(), 10_000 - 64, "the flood churns the probation slots");
        assert_eq!(reg.fresh(t + 10_000).count(), 128);
        let newcomer = key(500_000);
        let now = t + 10_001;
        assert_eq!(reg.accept(at(&newcomer, now), Source::Own, now), Accepted::New);
        assert!(reg.get(&newcomer.node_id()).is_some());
        // The stalest on probation goes first: a refreshing newcomer stays
        // while sybils that do not refresh arrive.
        for i in 0..100u32 {
            let now = t + 10_002 + u64::from(i);
            assert_eq!(reg.accept(at(&newcomer, now), Source::Own, now), Accepted::Refreshed);
            assert_eq!(reg.accept(at(&key(2_000_000 + i), now), Source::Own, now), Accepted::New);
        }
        assert!(reg.get(&newcomer.node_id()).is_some(), "a refreshing newcomer is not the stalest");
    }

    /// Flooders fill the registry first with ids behind their libp2p peers
    /// and keep them refreshing: honest nodes arriving later still get in,
    /// each in the place of an entry of the peer behind the most ids, and
    /// new flooder ids then evict only flooder entries. A node that sends
    /// its own registration leaves the group of whoever relayed it first.
    #[test]
    fn a_full_registry_evicts_from_the_peer_behind_most_node_ids_first() {
        let t = Params::default().now_ms;
        let mut reg = Registry::with_probation(Limits::default(), 128, 16);
        let (big, small) = (PeerId::random(), PeerId::random());
        let flooder = |j: u32| if j < 100 { (key(1_000 + j), big) } else { (key(2_000 + j), small) };
        for j in 0..128u32 {
            let (k, src) = flooder(j);
            assert_eq!(reg.accept(at(&k, t), Source::Peer(src), t), Accepted::New);
        }
        let honest: Vec<_> = (0..64).map(key).collect();
        for (i, k) in honest.iter().enumerate() {
            let now = t + 1 + i as u64;
            assert_eq!(reg.accept(at(k, now), Source::Own, now), Accepted::New);
        }
        assert_eq!((reg.held_by(&big), reg.held_by(&small)), (36, 28), "the larger lost all 64");
        // Both refresh every id (the evicted ones come back as new), then
        // send 1,000 new ids: they only take each other's places.
        for j in 0..128u32 {
            let (k, src) = flooder(j);
            reg.accept(at(&k, t + 100), Source::Peer(src), t + 100);
        }
        for i in 0..1_000u32 {
            let now = t + 200 + u64::from(i);
            let src = if i % 2 == 0 { big } else { small };
            assert_eq!(reg.accept(at(&key(3_000 + i), now), Source::Peer(src), now), Accepted::New);
        }
        assert!(honest.iter().all(|k| reg.get(&k.node_id()).is_some()), "an honest node was evicted");
        assert_eq!(reg.held_by(&big) + reg.held_by(&small), 64);
        assert!(reg.held_by(&big).abs_diff(reg.held_by(&small)) <= 2, "they evict each other");
        // An honest node whose first registration reached us under the
        // flooder's name: its own next heartbeat takes it out of the group.
        let late = key(500);
        assert_eq!(reg.accept(at(&late, t + 2_000), Source::Peer(big), t + 2_000), Accepted::New);
        let before = reg.held_by(&big);
        assert_eq!(reg.accept(at(&late, t + 2_001), Source::Own, t + 2_001), Accepted::Refreshed);
        assert_eq!(reg.held_by(&big), before - 1, "its own now");
        for i in 0..200u32 {
            let now = t + 3_000 + u64::from(i);
            assert_eq!(reg.accept(at(&key(9_000 + i), now), Source::Peer(big), now), Accepted::New);
        }
        assert!(reg.get(&late.node_id()).is_some() && reg.get(&honest[0].node_id()).is_some());
        assert_eq!(reg.fresh(t + 3_200).count(), 128);
    }

    #[test]
    fn an_offline_or_expired_node_loses_its_tenure() {
        let t = Params::default().now_ms;
        let mut reg = Registry::with_probation(Limits::default(), 4, 1);
        for i in 0..4 {
            assert_eq!(reg.accept(at(&key(i), t), Source::Own, t), Accepted::New);
        }
        let mut off = at(&key(0), t + 1);
        off.status = NodeStatus::Offline;
        assert_eq!(reg.accept(off, Source::Own, t + 1), Accepted::Offline);
        assert_eq!(reg.accept(at(&key(0), t + 2), Source::Own, t + 2), Accepted::New, "back, newest admitted");
        // Now key 0 is the one on probation.
        assert_eq!(reg.accept(at(&key(9), t + 3), Source::Own, t + 3), Accepted::New);
        assert!(reg.get(&key(0).node_id()).is_none() && reg.get(&key(1).node_id()).is_some());
    }
}
