//! When this node runs an anti-entropy round with a peer, and how far it
//! follows the peer's pages (sans-IO: time is an input). At most one round
//! per peer at once and one start per peer per interval (a peer that
//! reconnects over and over does not get a round per connection); at most
//! `max_active` rounds at once; a round follows at most
//! [`MAX_PAGES_PER_ROUND`] pages, and one cut there resumes from its last
//! resume points next round instead of starting over.

use std::collections::HashMap;
use std::hash::Hash;

/// Pages one round follows; the rest waits for the next round.
pub const MAX_PAGES_PER_ROUND: u32 = 16;

/// Resume points of a paged snapshot: (column family, last key received).
pub type Resume = Vec<(String, String)>;

/// What to do after a page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Ask for the next page from these resume points (empty: the log).
    Ask(Resume),
    /// The round is over.
    Done,
    /// The round stopped at the page cap; it resumes next round.
    Capped,
}

/// The rounds of one node.
#[derive(Debug)]
pub struct Rounds<K> {
    interval_ms: u64,
    max_active: usize,
    max_tracked: usize,
    active: HashMap<K, u32>,
    last_start: HashMap<K, u64>,
    resume: HashMap<K, Resume>,
}

impl<K: Hash + Eq + Clone> Rounds<K> {
    /// Rounds at most once per `interval_ms` per peer, `max_active` at once,
    /// remembering at most `max_tracked` peers' starts and resume points.
    pub fn new(interval_ms: u64, max_active: usize, max_tracked: usize) -> Self {
        Self {
            interval_ms: interval_ms.max(1),
            max_active,
            max_tracked,
            active: HashMap::new(),
            last_start: HashMap::new(),
            resume: HashMap::new(),
        }
    }

    /// Starts a round with `peer` if it may: returns where the first
    /// request resumes (empty: from the digests).
    pub fn start(&mut self, peer: &K, now_ms: u64) -> Option<Resume> {
        let len = self.interval_ms;
        let recent = self.last_start.get(peer).is_some_and(|t| now_ms < t.saturating_add(len));
        if self.active.contains_key(peer) || recent || self.active.len() >= self.max_active {
            return None;
        }
        if self.last_start.len() >= self.max_tracked {
            self.last_start.retain(|_, t| now_ms < t.saturating_add(len));
        }
        self.last_start.insert(peer.clone(), now_ms);
        self.active.insert(peer.clone(), 0);
        Some(self.resume.remove(peer).unwrap_or_default())
    }

    /// Whether a round with `peer` runs.
    pub fn is_active(&self, peer: &K) -> bool {
        self.active.contains_key(peer)
    }

    /// Ends the round (an error, a busy answer, a disconnect).
    pub fn end(&mut self, peer: &K) {
        self.active.remove(peer);
    }

    /// A page of the round was merged: `more` when the peer has more,
    /// `over_quota` when the peer's quota refused part of it.
    pub fn page(&mut self, peer: &K, more: bool, over_quota: bool, resume: Resume) -> Next {
        let Some(pages) = self.active.get_mut(peer) else { return Next::Done };
        *pages += 1;
        if over_quota || !more {
            self.active.remove(peer);
            return Next::Done;
        }
        if *pages >= MAX_PAGES_PER_ROUND {
            self.active.remove(peer);
            if !resume.is_empty() && self.resume.len() < self.max_tracked {
                self.resume.insert(peer.clone(), resume);
            }
            return Next::Capped;
        }
        Next::Ask(resume)
    }

    /// Forgets a disconnected peer's round (its start time stays, so a
    /// reconnect within the interval starts none).
    pub fn forget(&mut self, peer: &K) {
        self.active.remove(peer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ns: &str, key: &str) -> Resume {
        vec![(ns.into(), key.into())]
    }

    #[test]
    fn a_round_starts_once_per_peer_per_interval() {
        let mut r = Rounds::new(1000, 8, 100);
        assert_eq!(r.start(&"a", 0), Some(vec![]));
        assert_eq!(r.start(&"a", 1), None, "one runs");
        r.end(&"a");
        assert_eq!(r.start(&"a", 500), None, "a reconnect within the interval starts none");
        r.forget(&"a");
        assert_eq!(r.start(&"a", 999), None);
        assert!(r.start(&"a", 1000).is_some());
    }

    #[test]
    fn rounds_at_once_are_capped() {
        let mut r = Rounds::new(1000, 2, 100);
        assert!(r.start(&"a", 0).is_some() && r.start(&"b", 0).is_some());
        assert_eq!(r.start(&"c", 0), None);
        r.end(&"a");
        assert!(r.start(&"c", 0).is_some());
    }

    #[test]
    fn a_round_follows_at_most_the_page_cap_and_resumes_next_round() {
        let mut r = Rounds::new(1000, 8, 100);
        r.start(&"a", 0).unwrap();
        for i in 1..MAX_PAGES_PER_ROUND {
            assert_eq!(r.page(&"a", true, false, at("api.jobs", &i.to_string())), Next::Ask(at("api.jobs", &i.to_string())));
        }
        assert_eq!(r.page(&"a", true, false, at("api.jobs", "k16")), Next::Capped);
        assert!(!r.is_active(&"a"));
        assert_eq!(r.page(&"a", true, false, vec![]), Next::Done, "no round: nothing to follow");
        assert_eq!(r.start(&"a", 1000), Some(at("api.jobs", "k16")), "resumes where it stopped");
    }

    #[test]
    fn a_round_ends_at_the_last_page_or_at_the_quota() {
        let mut r = Rounds::new(1000, 8, 100);
        r.start(&"a", 0).unwrap();
        assert_eq!(r.page(&"a", false, false, vec![]), Next::Done);
        r.start(&"b", 0).unwrap();
        assert_eq!(r.page(&"b", true, true, at("api.jobs", "k")), Next::Done, "over its quota");
        assert_eq!(r.start(&"b", 1000), Some(vec![]), "no resume kept for a peer over quota");
    }
}
