//! Per-peer budgets (sans-IO: time is an input). [`PeerQuotas`] bounds the
//! bytes and keys a peer's deltas may add to this node's keyspace per
//! window (gossip and anti-entropy pages together), so one peer cannot fill
//! the disk; [`RateLimit`] bounds how many requests a peer may make per
//! window (anti-entropy answers cost a scan). Both keep at most `max_peers`
//! entries: a flood of fresh identities cannot grow them without bound.

use std::collections::HashMap;
use std::hash::Hash;

/// What a peer may add per window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuotaConfig {
    /// Window length.
    pub window_ms: u64,
    /// Encoded delta bytes accepted per peer per window.
    pub max_bytes: u64,
    /// Changed keys accepted per peer per window.
    pub max_keys: u64,
}

impl Default for QuotaConfig {
    fn default() -> Self {
        // A busy honest gateway writes a few KiB of records per job; these
        // bounds leave it room for hundreds of jobs a second.
        Self { window_ms: 60_000, max_bytes: 64 << 20, max_keys: 50_000 }
    }
}

/// Peers tracked at most (beyond it, only peers whose window has passed
/// are forgotten; a new peer is refused until one has).
pub const MAX_TRACKED_PEERS: usize = 4096;

/// Why a peer's delta was refused by its quota.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuotaExceeded {
    /// Its bytes this window are spent.
    #[error("the peer's delta bytes for this window are spent ({0} bytes)")]
    Bytes(u64),
    /// Its keys this window are spent.
    #[error("the peer's changed keys for this window are spent ({0} keys)")]
    Keys(u64),
    /// Too many peers are tracked to take a new one.
    #[error("too many peers within their quota window")]
    TooManyPeers,
}

#[derive(Clone, Copy, Debug, Default)]
struct Window {
    start_ms: u64,
    bytes: u64,
    keys: u64,
}

/// Bytes and keys per peer per window.
#[derive(Debug)]
pub struct PeerQuotas<K> {
    config: QuotaConfig,
    peers: HashMap<K, Window>,
    max_peers: usize,
}

impl<K: Hash + Eq + Clone> PeerQuotas<K> {
    /// Empty quotas.
    pub fn new(config: QuotaConfig) -> Self {
        Self::with_max_peers(config, MAX_TRACKED_PEERS)
    }

    /// Empty quotas tracking at most `max_peers` peers.
    pub fn with_max_peers(config: QuotaConfig, max_peers: usize) -> Self {
        Self { config, peers: HashMap::new(), max_peers: max_peers.max(1) }
    }

    /// The settings.
    pub fn config(&self) -> QuotaConfig {
        self.config
    }

    fn window(&mut self, peer: &K, now_ms: u64) -> Result<&mut Window, QuotaExceeded> {
        let len = self.config.window_ms;
        if !self.peers.contains_key(peer) && self.peers.len() >= self.max_peers {
            self.peers.retain(|_, w| now_ms < w.start_ms.saturating_add(len));
            if self.peers.len() >= self.max_peers {
                return Err(QuotaExceeded::TooManyPeers);
            }
        }
        let w = self.peers.entry(peer.clone()).or_insert(Window { start_ms: now_ms, ..Default::default() });
        if now_ms >= w.start_ms.saturating_add(len) || now_ms < w.start_ms {
            *w = Window { start_ms: now_ms, ..Default::default() };
        }
        Ok(w)
    }

    /// Whether `bytes` more (and one more key) fit in the peer's window;
    /// charges nothing.
    pub fn check(&mut self, peer: &K, bytes: u64, now_ms: u64) -> Result<(), QuotaExceeded> {
        let cfg = self.config;
        let w = self.window(peer, now_ms)?;
        if w.keys.saturating_add(1) > cfg.max_keys {
            return Err(QuotaExceeded::Keys(cfg.max_keys));
        }
        if w.bytes.saturating_add(bytes) > cfg.max_bytes {
            return Err(QuotaExceeded::Bytes(cfg.max_bytes));
        }
        Ok(())
    }

    /// Charges one changed key of `bytes` to the peer's window.
    pub fn charge(&mut self, peer: &K, bytes: u64, now_ms: u64) {
        if let Ok(w) = self.window(peer, now_ms) {
            w.bytes = w.bytes.saturating_add(bytes);
            w.keys = w.keys.saturating_add(1);
        }
    }

    /// What the peer has used in its current window: (bytes, keys).
    pub fn used(&self, peer: &K) -> (u64, u64) {
        self.peers.get(peer).map_or((0, 0), |w| (w.bytes, w.keys))
    }
}

/// At most `per_window` events per peer per window.
#[derive(Debug)]
pub struct RateLimit<K> {
    per_window: u32,
    window_ms: u64,
    peers: HashMap<K, (u64, u32)>,
    max_peers: usize,
}

impl<K: Hash + Eq + Clone> RateLimit<K> {
    /// A limit of `per_window` per `window_ms`.
    pub fn new(per_window: u32, window_ms: u64) -> Self {
        Self { per_window, window_ms: window_ms.max(1), peers: HashMap::new(), max_peers: MAX_TRACKED_PEERS }
    }

    /// Counts one event of `peer`; false when it is over its limit.
    pub fn allow(&mut self, peer: &K, now_ms: u64) -> bool {
        let len = self.window_ms;
        if !self.peers.contains_key(peer) && self.peers.len() >= self.max_peers {
            self.peers.retain(|_, (start, _)| now_ms < start.saturating_add(len));
            if self.peers.len() >= self.max_peers {
                return false;
            }
        }
        let (start, n) = self.peers.entry(peer.clone()).or_insert((now_ms, 0));
        if now_ms >= start.saturating_add(len) || now_ms < *start {
            (*start, *n) = (now_ms, 0);
        }
        if *n >= self.per_window {
            return false;
        }
        *n += 1;
        true
    }

    /// Forgets a peer (it disconnected).
    pub fn forget(&mut self, peer: &K) {
        self.peers.remove(peer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> QuotaConfig {
        QuotaConfig { window_ms: 1000, max_bytes: 100, max_keys: 3 }
    }

    #[test]
    fn bytes_beyond_the_window_budget_are_refused_until_it_passes() {
        let mut q = PeerQuotas::new(cfg());
        q.check(&"a", 60, 0).unwrap();
        q.charge(&"a", 60, 0);
        assert_eq!(q.check(&"a", 50, 10), Err(QuotaExceeded::Bytes(100)));
        q.check(&"a", 40, 10).unwrap();
        q.check(&"b", 90, 10).unwrap();
        assert!(q.check(&"a", 50, 1000).is_ok(), "a new window");
        assert_eq!(q.used(&"a"), (0, 0));
    }

    #[test]
    fn keys_beyond_the_window_budget_are_refused() {
        let mut q = PeerQuotas::new(cfg());
        for _ in 0..3 {
            q.check(&"a", 1, 5).unwrap();
            q.charge(&"a", 1, 5);
        }
        assert_eq!(q.check(&"a", 1, 6), Err(QuotaExceeded::Keys(3)));
        assert_eq!(q.used(&"a"), (3, 3));
    }

    #[test]
    fn tracked_peers_are_bounded_and_only_expired_ones_forgotten() {
        let mut q = PeerQuotas::with_max_peers(cfg(), 2);
        q.charge(&"a", 90, 0);
        q.charge(&"b", 1, 500);
        assert_eq!(q.check(&"c", 1, 600), Err(QuotaExceeded::TooManyPeers));
        // a's window has passed: it is forgotten, c fits, b keeps its use.
        q.check(&"c", 1, 1000).unwrap();
        assert_eq!(q.used(&"b"), (1, 1));
        assert_eq!(q.used(&"a"), (0, 0));
    }

    #[test]
    fn a_rate_limit_counts_per_peer_per_window() {
        let mut r = RateLimit::new(2, 1000);
        assert!(r.allow(&"a", 0) && r.allow(&"a", 1));
        assert!(!r.allow(&"a", 2), "third in the window");
        assert!(r.allow(&"b", 2), "another peer has its own");
        assert!(r.allow(&"a", 1000), "the next window");
        r.forget(&"a");
        assert!(r.allow(&"a", 1001) && r.allow(&"a", 1002) && !r.allow(&"a", 1003));
    }
}
