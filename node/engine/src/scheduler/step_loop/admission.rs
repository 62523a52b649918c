//! Admission into the step batch, by class (specs/batch.md, "Priority on
//! the worker"): interactive sequences before batch ones; an interactive
//! one takes a batch sequence's step slot (parked, K/V kept) or, when
//! blocks are short, its K/V (preempted, recomputed exactly later).

use std::sync::atomic::Ordering;

use super::{Seq, StepLoop};
use crate::generate::FinishReason;
use crate::paged::PagedError;
use crate::scheduler::Priority;

/// Where the next sequence to admit waits.
#[derive(Debug, Clone, Copy)]
enum From {
    Preempted(usize),
    Queue(usize),
}

impl StepLoop {
    /// Move sequences into the running batch while there is room and KV
    /// blocks: interactive ones first (preempted, then waiting), then batch
    /// ones. An interactive sequence takes the step slot of the newest batch
    /// sequence (parked: out of the batch, K/V kept) and, when blocks are
    /// short, batch sequences' K/V (preempted: recomputed exactly later).
    pub(super) fn admit(&mut self) {
        while let Some((from, priority)) = self.pick() {
            if self.running.len() >= self.cfg.max_running {
                if priority == Priority::Batch || !self.park_newest_batch() {
                    break;
                }
                // Picked again: parking moved the preempted list.
                continue;
            }
            let (seq, from_preempted) = match from {
                From::Preempted(i) => match self.preempted.remove(i) {
                    Some(s) => (s, true),
                    None => break,
                },
                From::Queue(i) => {
                    let p = self.shared.queue().remove(i);
                    match p {
                        Some(p) => (self.new_seq(p), false),
                        None => break,
                    }
                }
            };
            if seq.cancel.load(Ordering::Relaxed) {
                self.finish(seq, FinishReason::Cancelled);
                continue;
            }
            if self.blocks.contains(seq.id) {
                // Parked: its K/V are still in the pool.
                self.running.push(seq);
                continue;
            }
            if !self.admit_blocks(seq, from_preempted) {
                break;
            }
        }
        self.publish();
    }

    /// The next sequence to admit: where it is and its class.
    fn pick(&self) -> Option<(From, Priority)> {
        let q = self.shared.queue();
        for class in [Priority::Interactive, Priority::Batch] {
            if let Some(i) = self.preempted.iter().position(|s| s.priority == class) {
                return Some((From::Preempted(i), class));
            }
            if let Some(i) = q.iter().position(|p| p.req.priority == class) {
                return Some((From::Queue(i), class));
            }
        }
        None
    }

    /// Give `seq` its blocks and a place in the batch; false when it must
    /// wait for blocks (it goes back to the preempted list).
    fn admit_blocks(&mut self, mut seq: Seq, from_preempted: bool) -> bool {
        loop {
            match self.blocks.admit_at(seq.id, seq.salt, &seq.tokens, seq.decode_from) {
                Ok(cached) => {
                    seq.computed = cached;
                    seq.cached_tokens.get_or_insert(cached.min(seq.prompt_len));
                    let waited = self.shared.steps.load(Ordering::Relaxed).saturating_sub(seq.arrived);
                    seq.wait_steps.get_or_insert(waited);
                    self.running.push(seq);
                    return true;
                }
                Err(e @ PagedError::OutOfBlocks { .. }) => {
                    // Parked K/V go first, then (for interactive work) the
                    // newest batch sequence's.
                    if self.release_parked()
                        || (seq.priority == Priority::Interactive && self.preempt_newest_batch())
                    {
                        continue;
                    }
                    if self.running.is_empty() {
                        self.fail(seq, &format!("cannot admit: {e}"));
                        return true;
                    }
                    // Wait for running sequences to free blocks.
                    if from_preempted {
                        self.preempted.push_front(seq);
                    } else {
                        self.preempted.push_back(seq);
                    }
                    return false;
                }
                Err(e) => {
                    self.fail(seq, &format!("cannot admit: {e}"));
                    return true;
                }
            }
        }
    }

    /// Move the newest running batch sequence out of the step batch, its
    /// K/V kept; false when none runs.
    fn park_newest_batch(&mut self) -> bool {
        let Some(idx) = self.newest(Priority::Batch) else { return false };
        let mut seq = self.running.remove(idx);
        seq.preemptions += 1;
        tracing::debug!(id = seq.id, "parked for interactive work");
        self.preempted.push_front(seq);
        true
    }

    /// Free the K/V of the newest running batch sequence; false when none runs.
    fn preempt_newest_batch(&mut self) -> bool {
        let Some(idx) = self.newest(Priority::Batch) else { return false };
        self.preempt(idx);
        true
    }

    pub(super) fn newest(&self, class: Priority) -> Option<usize> {
        let it = self.running.iter().enumerate().filter(|(_, s)| s.priority == class);
        it.max_by_key(|(_, s)| s.id).map(|(i, _)| i)
    }

    /// Free the K/V of the newest parked sequence (it is recomputed when
    /// re-admitted); false when none holds blocks.
    pub(super) fn release_parked(&mut self) -> bool {
        let parked = self.preempted.iter_mut().filter(|s| self.blocks.contains(s.id));
        let Some(seq) = parked.max_by_key(|s| s.id) else { return false };
        let _ = self.blocks.free(seq.id);
        seq.computed = 0;
        true
    }
}
