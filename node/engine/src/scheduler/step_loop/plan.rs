//! Which running sequences a forward step computes, and how much of each.
//!
//! An interactive request's first token waits on its prompt, so a step
//! that prefills an interactive prompt carries interactive work only:
//! batch sequences (decoding or prefilling) sit that step out, holding
//! their K/V, and the prompt costs what it costs on an idle engine. Every
//! other step decodes every running sequence and prefills prompt chunks,
//! interactive first; batch prompt chunks take at most
//! `batch_prefill_chunk` tokens a step, which bounds the step an arriving
//! interactive request can find in flight.

use super::super::Priority;

/// One sequence's share of a forward step: `n` tokens of `running[idx]`
/// from position `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Work {
    pub idx: usize,
    pub start: usize,
    pub n: usize,
}

/// What the plan reads of a running sequence.
#[derive(Debug, Clone, Copy)]
pub(super) struct State {
    pub priority: Priority,
    /// Positions whose K/V are computed.
    pub computed: usize,
    /// Prompt plus generated tokens.
    pub len: usize,
}

impl State {
    fn need(&self) -> usize {
        self.len.saturating_sub(self.computed)
    }
}

/// The step's work: decode rows first (in `seqs` order), then prompt
/// chunks, at most `prefill_chunk` prompt tokens in all.
pub(super) fn plan(seqs: &[State], prefill_chunk: usize, batch_prefill_chunk: usize) -> Vec<Work> {
    let interactive_prompt =
        seqs.iter().any(|s| s.priority == Priority::Interactive && s.need() > 1);
    let takes_part = |s: &State| !interactive_prompt || s.priority == Priority::Interactive;
    let mut work: Vec<Work> = seqs
        .iter()
        .enumerate()
        .filter(|(_, s)| s.need() == 1 && takes_part(s))
        .map(|(idx, s)| Work { idx, start: s.computed, n: 1 })
        .collect();
    let mut budget = prefill_chunk;
    for class in [Priority::Interactive, Priority::Batch] {
        let mut class_budget = match class {
            Priority::Interactive => budget,
            Priority::Batch if interactive_prompt => 0,
            Priority::Batch => budget.min(batch_prefill_chunk),
        };
        for (idx, s) in seqs.iter().enumerate() {
            if s.priority == class && s.need() > 1 && class_budget > 0 {
                let n = s.need().min(class_budget);
                class_budget -= n;
                budget -= n;
                work.push(Work { idx, start: s.computed, n });
            }
        }
    }
    work
}

#[cfg(test)]
mod tests {
    use super::*;
    use Priority::{Batch, Interactive};

    fn st(priority: Priority, computed: usize, len: usize) -> State {
        State { priority, computed, len }
    }

    #[test]
    fn an_interactive_prompt_has_the_step_to_itself() {
        let seqs = [
            st(Batch, 40, 41),        // decoding
            st(Interactive, 30, 31),  // decoding
            st(Batch, 0, 50),         // prompt
            st(Interactive, 0, 300),  // prompt, over the chunk
            st(Interactive, 10, 20),  // prompt
        ];
        let w = plan(&seqs, 256, 64);
        assert_eq!(
            w,
            vec![
                Work { idx: 1, start: 30, n: 1 },
                Work { idx: 3, start: 0, n: 256 },
            ],
            "interactive decode rows and prompt chunks only, up to the chunk"
        );
        // The next step finishes the long prompt and starts the next one.
        let seqs = [seqs[0], seqs[1], seqs[2], st(Interactive, 256, 300), seqs[4]];
        let w = plan(&seqs, 256, 64);
        assert_eq!(w, vec![
            Work { idx: 1, start: 30, n: 1 },
            Work { idx: 3, start: 256, n: 44 },
            Work { idx: 4, start: 10, n: 10 },
        ]);
    }

    #[test]
    fn without_an_interactive_prompt_every_sequence_decodes_and_batch_prompts_are_capped() {
        let seqs = [
            st(Batch, 40, 41),
            st(Interactive, 30, 31),
            st(Batch, 0, 50),
            st(Batch, 0, 50),
            st(Batch, 5, 6),
        ];
        let w = plan(&seqs, 256, 64);
        assert_eq!(
            w,
            vec![
                Work { idx: 0, start: 40, n: 1 },
                Work { idx: 1, start: 30, n: 1 },
                Work { idx: 4, start: 5, n: 1 },
                Work { idx: 2, start: 0, n: 50 },
                Work { idx: 3, start: 0, n: 14 },
            ]
        );
        // The whole chunk when it is smaller than the batch cap.
        let w = plan(&seqs, 20, 64);
        assert_eq!(w[3..], [Work { idx: 2, start: 0, n: 20 }]);
    }

    #[test]
    fn batch_work_alone_runs_as_before() {
        let seqs = [st(Batch, 0, 10), st(Batch, 9, 10)];
        let w = plan(&seqs, 256, 64);
        assert_eq!(w, vec![Work { idx: 1, start: 9, n: 1 }, Work { idx: 0, start: 0, n: 10 }]);
        assert!(plan(&[], 256, 64).is_empty());
    }
}
