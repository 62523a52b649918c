//! Failing workers sit out (the Petals rule): a worker that loses a job —
//! its lease expired, it disconnected, it failed before or after its first
//! token, or it returned an invalid result — is left out of this gateway's
//! new jobs for 15 s (the gateway's `--sit-out-ms`), doubling with each
//! repeat up to 5 min. Ten clean
//! minutes after its last ban ends, its record is forgotten. Sans-IO: time
//! is an input.

use std::collections::HashMap;

use gcs_protocol::NodeId;

/// First ban.
pub const BASE_MS: u64 = 15_000;
/// Longest ban.
pub const MAX_MS: u64 = 300_000;
/// A clean stretch after which strikes are forgotten.
pub const FORGET_MS: u64 = 600_000;

#[derive(Clone, Copy, Debug)]
struct Strikes {
    count: u32,
    until_ms: u64,
}

/// Per-gateway record of recently failing workers.
#[derive(Debug)]
pub struct PenaltyBox {
    nodes: HashMap<NodeId, Strikes>,
    /// The first ban (0: never bans).
    base_ms: u64,
}

impl Default for PenaltyBox {
    fn default() -> Self {
        Self::new(BASE_MS)
    }
}

impl PenaltyBox {
    /// A box whose first ban is `base_ms` ([`BASE_MS`] unless the operator
    /// chose another with `--sit-out-ms`; 0 never bans).
    pub fn new(base_ms: u64) -> Self {
        Self { nodes: HashMap::new(), base_ms }
    }

    /// `node` lost a job at `now`; returns when its ban ends.
    pub fn strike(&mut self, node: &NodeId, now: u64) -> u64 {
        self.nodes.retain(|_, s| now <= s.until_ms + FORGET_MS);
        let s = self.nodes.entry(node.clone()).or_insert(Strikes { count: 0, until_ms: 0 });
        s.count += 1;
        let ban = (self.base_ms << (s.count - 1).min(5)).min(MAX_MS);
        s.until_ms = s.until_ms.max(now + ban);
        s.until_ms
    }

    /// Whether `node` sits out at `now`.
    pub fn is_out(&self, node: &NodeId, now: u64) -> bool {
        self.nodes.get(node).is_some_and(|s| now < s.until_ms)
    }

    /// Every node that sits out at `now`.
    pub fn out(&self, now: u64) -> Vec<NodeId> {
        self.nodes.iter().filter(|(_, s)| now < s.until_ms).map(|(n, _)| n.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bans_double_up_to_the_cap_and_are_forgotten_after_a_clean_stretch() {
        let (w, _) = gcs_protocol::samples::keys();
        let n = w.node_id();
        let mut p = PenaltyBox::default();
        assert!(!p.is_out(&n, 0));
        let mut now = 1_000;
        let mut bans = vec![];
        for _ in 0..7 {
            let until = p.strike(&n, now);
            bans.push(until - now);
            assert!(p.is_out(&n, until - 1) && !p.is_out(&n, until));
            now = until + 1_000; // fails again soon after its ban
        }
        assert_eq!(bans, [15_000, 30_000, 60_000, 120_000, 240_000, 300_000, 300_000]);
        assert_eq!(p.out(now), Vec::<NodeId>::new());
        // Ten clean minutes after the last ban: a first offence again.
        let later = now + FORGET_MS + 1;
        assert_eq!(p.strike(&n, later) - later, BASE_MS);
        assert_eq!(p.out(later), vec![n]);
    }

    #[test]
    fn a_zero_base_never_bans_and_a_shorter_one_still_doubles() {
        let (w, _) = gcs_protocol::samples::keys();
        let n = w.node_id();
        let mut p = PenaltyBox::new(0);
        for _ in 0..3 {
            p.strike(&n, 1_000);
            assert!(!p.is_out(&n, 1_000), "--sit-out-ms 0: never left out");
        }
        let mut p = PenaltyBox::new(1_000);
        assert_eq!(p.strike(&n, 0), 1_000);
        assert_eq!(p.strike(&n, 2_000), 4_000);
    }
}
