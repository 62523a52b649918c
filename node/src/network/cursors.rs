//! Per peer, the delta-log position anti-entropy has everything up to
//! (sans-IO). A round's pages move a pending position; it becomes the
//! peer's cursor only when the round took everything it was sent. A
//! cursor that ran ahead of what was merged (a page cut short by the
//! quota, a round that failed mid-way) would make every later round a log
//! pull past the records that were dropped, and they would never come.

use std::collections::HashMap;
use std::hash::Hash;

/// The cursors of one node.
#[derive(Debug)]
pub struct Cursors<K> {
    max_tracked: usize,
    cursor: HashMap<K, u64>,
    /// Rounds under way: the position their pages reached.
    pending: HashMap<K, u64>,
    /// Bumped by [`Cursors::reset`]: a round built before then must not
    /// put its position back.
    generation: u64,
}

impl<K: Hash + Eq + Clone> Cursors<K> {
    /// Keeping the cursors of disconnected peers up to `max_tracked` peers.
    pub fn new(max_tracked: usize) -> Self {
        Self { max_tracked, cursor: HashMap::new(), pending: HashMap::new(), generation: 0 }
    }

    /// The generation a request built now belongs to.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Where the next request to `peer` starts: a round's next log page
    /// after its last one; a new round at the cursor (None: snapshots).
    pub fn since(&self, peer: &K) -> Option<u64> {
        self.pending.get(peer).or(self.cursor.get(peer)).copied()
    }

    /// Drops every position (the next round with each peer compares
    /// digests in full) and disowns the rounds under way.
    pub fn reset(&mut self) {
        self.cursor.clear();
        self.pending.clear();
        self.generation = self.generation.wrapping_add(1);
    }

    /// A page of the round with `peer`, requested under `generation`, was
    /// merged; `last_seq` is the position it reports, if any.
    pub fn page(&mut self, peer: &K, generation: u64, last_seq: Option<u64>) {
        if let Some(seq) = last_seq.filter(|_| generation == self.generation) {
            self.pending.insert(peer.clone(), seq);
        }
    }

    /// The round with `peer` ended; `complete` when it took everything it
    /// was sent (or stopped at the page cap with resume points kept).
    pub fn end(&mut self, peer: &K, complete: bool) {
        if let Some(seq) = self.pending.remove(peer).filter(|_| complete) {
            self.cursor.insert(peer.clone(), seq);
        }
    }

    /// `peer` disconnected: its round is void; its cursor stays (a
    /// reconnect pulls only what changed) while few peers are tracked.
    pub fn forget(&mut self, peer: &K) {
        self.pending.remove(peer);
        if self.cursor.len() > self.max_tracked {
            self.cursor.remove(peer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_complete_round_moves_the_cursor_and_its_log_pages_chain() {
        let mut c = Cursors::new(8);
        assert_eq!(c.since(&"a"), None, "first contact: snapshots");
        c.page(&"a", c.generation(), Some(10));
        assert_eq!(c.since(&"a"), Some(10), "the next log page starts after this one");
        c.page(&"a", c.generation(), Some(20));
        c.end(&"a", true);
        assert_eq!(c.since(&"a"), Some(20));
        // A later snapshot page reports no position: the first one stands.
        c.page(&"a", c.generation(), Some(30));
        c.page(&"a", c.generation(), None);
        c.end(&"a", true);
        assert_eq!(c.since(&"a"), Some(30));
    }

    #[test]
    fn a_round_cut_short_leaves_the_cursor_where_it_was() {
        let mut c = Cursors::new(8);
        c.page(&"a", c.generation(), Some(10));
        c.end(&"a", true);
        c.page(&"a", c.generation(), Some(50));
        c.end(&"a", false);
        assert_eq!(c.since(&"a"), Some(10), "the dropped records are asked for again");
        c.page(&"a", c.generation(), Some(50));
        c.forget(&"a");
        assert_eq!(c.since(&"a"), Some(10), "a peer gone mid-round keeps its old cursor");
    }

    #[test]
    fn a_reset_disowns_the_rounds_under_way() {
        let mut c = Cursors::new(8);
        c.page(&"a", c.generation(), Some(10));
        c.end(&"a", true);
        let before = c.generation();
        c.page(&"b", before, Some(5));
        c.reset();
        assert_eq!((c.since(&"a"), c.since(&"b")), (None, None));
        // Pages of requests built before the reset merge, but their
        // positions do not count: the next round compares digests.
        c.page(&"a", before, Some(12));
        c.end(&"a", true);
        assert_eq!(c.since(&"a"), None);
        c.page(&"a", c.generation(), Some(14));
        c.end(&"a", true);
        assert_eq!(c.since(&"a"), Some(14));
    }

    #[test]
    fn only_a_bounded_number_of_gone_peers_keep_their_cursors() {
        let mut c = Cursors::new(2);
        for (i, p) in ["a", "b", "c"].iter().enumerate() {
            c.page(p, 0, Some(i as u64));
            c.end(p, true);
        }
        c.forget(&"a");
        c.forget(&"b");
        assert_eq!((c.since(&"a"), c.since(&"b"), c.since(&"c")), (None, Some(1), Some(2)));
    }
}
