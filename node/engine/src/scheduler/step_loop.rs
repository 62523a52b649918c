//! The engine thread's step loop: admission, batch building, sampling and
//! delivery.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use super::{BatchConfig, Pending, Priority, SeqEvent, SeqRequest, SeqResult, Shared};
use crate::backend::{Adjust, Interrupt, PagedDecoder, Pick};
use crate::constraint::SeqGrammar;
use crate::error::EngineError;
use crate::generate::FinishReason;
use crate::llama::PagedSeq;
use crate::paged::{prompt_decode_from, tenant_salt, BlockManager, BLOCK_SIZE};
use crate::sampling::{Logprobs, Sampler, TopCandidates};
use crate::stop::StopMatcher;
use crate::tokenizer::GgufTokenizer;

mod admission;
mod plan;
mod sample;

/// A sequence owned by the engine thread.
#[derive(Debug)]
struct Seq {
    id: u64,
    salt: u64,
    /// Prompt, then every generated token.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Positions from here on (the generated tokens) are computed in
    /// decode order, however they are batched: a recomputed (preempted)
    /// or resumed sequence gets bit-identical K/V.
    decode_from: usize,
    /// Generated tokens given to a resumed request, not streamed here.
    resumed: usize,
    /// Positions whose K/V are in the pool (0 while preempted; kept while
    /// parked: out of the step batch but holding its blocks).
    computed: usize,
    priority: Priority,
    /// [`Shared::steps`] when the request was queued.
    arrived: u64,
    /// Steps it waited before its first admission.
    wait_steps: Option<u64>,
    preemptions: u32,
    /// Prompt tokens reused from the prefix cache at first admission.
    cached_tokens: Option<usize>,
    max_tokens: usize,
    sampler: Sampler,
    stop: StopMatcher,
    stop_ids: Vec<u32>,
    logprobs: Option<usize>,
    /// Grammar state of a constrained sequence.
    grammar: Option<SeqGrammar>,
    /// Its grammar's mask for this step's pick, computed before the step
    /// for a device to apply (`TokenMask::words`; [`Seq::prepare_mask`]).
    mask: Option<Vec<u32>>,
    text: String,
    tx: SyncSender<SeqEvent>,
    cancel: Arc<AtomicBool>,
    /// Events not yet accepted by the channel (deltas merged).
    outbox: VecDeque<SeqEvent>,
    /// The other samples of an n > 1 request, forked off this sequence
    /// once its prompt is computed.
    samples: Vec<Seq>,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn emit(&mut self, text: String, token: Option<u32>, lp: Option<Logprobs>) {
        if text.is_empty() && token.is_none() {
            return;
        }
        self.text.push_str(&text);
        if let Some(SeqEvent::Delta { text: t, token_ids, logprobs }) = self.outbox.back_mut() {
            t.push_str(&text);
            token_ids.extend(token);
            logprobs.extend(lp);
            return;
        }
        self.outbox.push_back(SeqEvent::Delta {
            text,
            token_ids: token.into_iter().collect(),
            logprobs: lp.into_iter().collect(),
        });
    }

    /// Push queued events into the channel without blocking. Returns false
    /// when the receiver is gone.
    fn flush(&mut self) -> bool {
        while let Some(ev) = self.outbox.pop_front() {
            match self.tx.try_send(ev) {
                Ok(()) => {}
                Err(TrySendError::Full(ev)) => {
                    self.outbox.push_front(ev);
                    return true;
                }
                Err(TrySendError::Disconnected(_)) => {
                    self.outbox.clear();
                    return false;
                }
            }
        }
        true
    }
}

/// How a sequence ends this step: a finish reason, or a failure message.
type End = std::result::Result<FinishReason, String>;

/// A sequence's row of a step's output: its index among the step's
/// sequences (`at`), what the step was asked for (`pick`), its logits
/// where they came back, the token the backend picked and the top
/// candidates it selected where it did.
#[derive(Debug, Clone, Copy)]
struct Row<'a> {
    at: usize,
    pick: Pick,
    logits: Option<&'a [f32]>,
    picked: Option<u32>,
    /// The candidates of the row the pick saw (adjusted).
    top: Option<&'a TopCandidates>,
    /// The candidates its logprobs come from: `top`, or those of its row
    /// before its additions ([`Pick::Scored`]).
    lp: Option<&'a TopCandidates>,
    /// The backend masked the row by the sequence's grammar and added its
    /// bias and penalties before it picked (not `logits`, which come back
    /// raw).
    adjusted: bool,
}

/// The state of the engine thread: the decoder (the model and its K/V
/// storage, on its compute backend) and every sequence it owns.
/// [`StepLoop::run`] steps until shutdown.
#[derive(Debug)]
pub(super) struct StepLoop {
    dec: Box<dyn PagedDecoder>,
    tok: Arc<GgufTokenizer>,
    shared: Arc<Shared>,
    cfg: BatchConfig,
    blocks: BlockManager,
    running: Vec<Seq>,
    /// Preempted sequences (K/V freed) and parked ones (K/V kept),
    /// re-admitted before new requests of their class.
    preempted: VecDeque<Seq>,
    /// Finished sequences whose last events are still being delivered.
    closing: Vec<Seq>,
    /// `Shared::interactive_arrivals` when this round's admission began.
    arrivals_seen: u64,
}

impl StepLoop {
    /// `dec`: the model on its compute backend, with `cfg.kv_blocks` blocks
    /// (`BatchEngine::start`, `start_on`).
    pub(super) fn new(
        dec: Box<dyn PagedDecoder>,
        tok: Arc<GgufTokenizer>,
        shared: Arc<Shared>,
        cfg: BatchConfig,
    ) -> Self {
        tracing::info!(
            backend = dec.kind().name(),
            blocks = cfg.kv_blocks,
            mib = (cfg.kv_blocks * BLOCK_SIZE * dec.kv_bytes_per_token()) >> 20,
            "paged KV pool"
        );
        Self {
            dec,
            tok,
            shared,
            blocks: BlockManager::new(cfg.kv_blocks),
            cfg,
            running: Vec::new(),
            preempted: VecDeque::new(),
            closing: Vec::new(),
            arrivals_seen: 0,
        }
    }

    pub(super) fn run(mut self) {
        loop {
            if self.shared.shutdown.load(Ordering::Relaxed) {
                self.fail_all("engine stopped");
                return;
            }
            self.reap_cancelled();
            // Before admission: an interactive request queued after this
            // read stops the next batch-only step.
            self.arrivals_seen = self.shared.interactive_arrivals.load(Ordering::Relaxed);
            self.admit();
            if self.running.is_empty() {
                self.deliver();
                let q = self.shared.queue();
                if q.is_empty() && !self.shared.shutdown.load(Ordering::Relaxed) {
                    let wait = if self.closing.is_empty() { 100 } else { 5 };
                    let _ = self.shared.wake.wait_timeout(q, Duration::from_millis(wait));
                }
                continue;
            }
            self.step();
            self.deliver();
        }
    }

    fn new_seq(&self, p: Pending) -> Seq {
        let Pending { id, mut tokens, req, tx, cancel, grammar, samples, resumed, arrived } = p;
        let children: Vec<Seq> = samples
            .into_iter()
            .enumerate()
            .map(|(i, (cid, ctx, ccancel))| {
                let mut r = req.clone();
                r.sampling.seed = r.sampling.seed.wrapping_add(i as u64 + 1);
                let p = Pending {
                    id: cid,
                    tokens: tokens.clone(),
                    req: r,
                    tx: ctx,
                    cancel: ccancel,
                    grammar: grammar.as_ref().map(SeqGrammar::fork),
                    samples: vec![],
                    // `resume` takes one sample only.
                    resumed: None,
                    arrived,
                };
                self.new_seq(p)
            })
            .collect();
        let SeqRequest {
            max_tokens,
            sampling,
            stop,
            mut stop_token_ids,
            ignore_eos,
            tenant,
            logprobs,
            priority,
            ..
        } = req;
        if !ignore_eos {
            stop_token_ids.extend(self.tok.stop_ids.iter().copied());
        }
        let context = self.dec.config().context_length;
        let prompt_len = tokens.len();
        let (sampler, stop, text, resumed) = match resumed {
            None => (Sampler::new(sampling), StopMatcher::new(&stop), String::new(), 0),
            Some(r) => {
                tokens.extend_from_slice(&r.generated);
                (r.sampler, r.stop, r.text, r.generated.len())
            }
        };
        Seq {
            id,
            salt: tenant_salt(&tenant),
            prompt_len,
            decode_from: prompt_decode_from(prompt_len),
            resumed,
            max_tokens: max_tokens.min(context.saturating_sub(prompt_len)).max(1),
            tokens,
            computed: 0,
            priority,
            arrived,
            wait_steps: None,
            preemptions: 0,
            cached_tokens: None,
            sampler,
            stop,
            stop_ids: stop_token_ids,
            logprobs,
            grammar,
            mask: None,
            text,
            tx,
            cancel,
            outbox: VecDeque::new(),
            samples: children,
        }
    }

    fn reap_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancel.load(Ordering::Relaxed) {
                let seq = self.running.remove(i);
                self.finish(seq, FinishReason::Cancelled);
            } else {
                i += 1;
            }
        }
        let (cancelled, kept): (Vec<Seq>, Vec<Seq>) =
            self.preempted.drain(..).partition(|s| s.cancel.load(Ordering::Relaxed));
        self.preempted = kept.into();
        for s in cancelled {
            self.finish(s, FinishReason::Cancelled);
        }
        // Cancelled requests still waiting give their queue slot back now.
        let gone: Vec<Pending> = {
            let mut q = self.shared.queue();
            if !q.iter().any(|p| p.cancel.load(Ordering::Relaxed)) {
                return;
            }
            let (gone, kept): (Vec<Pending>, Vec<Pending>) =
                q.drain(..).partition(|p| p.cancel.load(Ordering::Relaxed));
            *q = kept.into();
            gone
        };
        for p in gone {
            let seq = self.new_seq(p);
            self.finish(seq, FinishReason::Cancelled);
        }
    }

    /// End a sequence (and its unforked samples) with an error event.
    fn fail(&mut self, mut seq: Seq, msg: &str) {
        let _ = self.blocks.free(seq.id);
        for c in std::mem::take(&mut seq.samples) {
            self.fail(c, msg);
        }
        seq.outbox.push_back(SeqEvent::Error(msg.into()));
        self.closing.push(seq);
    }

    /// End a sequence: release its blocks and queue the final event.
    /// Samples not forked yet end the same way.
    fn finish(&mut self, mut seq: Seq, reason: FinishReason) {
        let _ = self.blocks.free(seq.id);
        for c in std::mem::take(&mut seq.samples) {
            self.finish(c, reason);
        }
        if reason != FinishReason::Stop {
            let tail = seq.stop.finish();
            seq.emit(tail, None, None);
        }
        let result = SeqResult {
            finish_reason: reason,
            prompt_tokens: seq.prompt_len,
            completion_tokens: seq.generated(),
            cached_tokens: seq.cached_tokens.unwrap_or(0),
            text: seq.text.clone(),
            resumed_tokens: seq.resumed,
            wait_steps: seq.wait_steps.unwrap_or(0),
            preemptions: seq.preemptions,
        };
        seq.outbox.push_back(SeqEvent::Done(result));
        self.closing.push(seq);
        self.publish();
    }

    fn publish(&self) {
        let free = self.blocks.available_blocks() * BLOCK_SIZE;
        self.shared.free_kv_tokens.store(free, Ordering::Relaxed);
        self.shared.running.store(self.running.len(), Ordering::Relaxed);
    }

    /// One forward pass over every running sequence.
    fn step(&mut self) {
        let states: Vec<plan::State> = self
            .running
            .iter()
            .map(|s| plan::State {
                priority: s.priority,
                computed: s.computed,
                len: s.tokens.len(),
            })
            .collect();
        let work = plan::plan(&states, self.cfg.prefill_chunk, self.cfg.batch_prefill_chunk);
        if work.is_empty() {
            return;
        }
        // A step without an interactive sequence runs on the decoder's
        // low-priority threads (batch work fills idle capacity).
        let batch_only = work.iter().all(|w| self.running[w.idx].priority == Priority::Batch);
        self.dec.set_background(
            batch_only.then(|| {
                Interrupt::new(self.shared.interactive_arrivals.clone(), self.arrivals_seen)
            }),
        );
        let (vocab, eos) = (self.dec.vocab(), self.tok.eos_id);
        // A decoder that returns every row's logits (the CPU's) gets no
        // picks, additions or masks: the host samples each row after the
        // step, its grammar's mask computed then.
        let device = self.dec.picks_on_device();
        // The sequences that sample this step (their prompt done): a
        // grammar's mask for the device.
        let samples = |w: &plan::Work, s: &Seq| w.start + w.n == s.tokens.len();
        for w in &work {
            let s = &mut self.running[w.idx];
            match device && samples(w, s) {
                true => s.prepare_mask(eos),
                false => s.mask = None,
            }
        }
        // A sequence that samples greedily needs only its row's argmax,
        // one that draws at a temperature alone only its draw: a GPU
        // computes either without copying the logits back, after adding
        // the bias and penalties and masking the grammar's tokens. A row
        // that n > 1 samples share needs its logits unless all are plain
        // greedy (each sample draws with its own RNG and penalties); a
        // prompt chunk before the last picks nothing.
        let (picks, adds): (Vec<Pick>, Vec<Vec<(u32, f32)>>) = work
            .iter()
            .map(|w| {
                let s = &self.running[w.idx];
                let greedy =
                    |q: &Seq| q.grammar.is_none() && q.pick(vocab) == (Pick::Argmax, vec![]);
                if !device {
                    return (Pick::Logits, vec![]);
                }
                if !samples(w, s) {
                    return (Pick::Argmax, vec![]);
                }
                match s.pick(vocab) {
                    p if s.samples.is_empty() => p,
                    p if greedy(s) && s.samples.iter().all(greedy) => p,
                    _ => (Pick::Logits, vec![]),
                }
            })
            .unzip();
        // A row whose logits come back is masked on the host.
        let masks = work
            .iter()
            .zip(&picks)
            .map(|(w, p)| self.running[w.idx].mask.as_deref().filter(|_| *p != Pick::Logits));
        let adjust = Adjust::new(adds.iter().map(Vec::as_slice)).with_masks(masks);
        let out = {
            let seqs: Vec<PagedSeq<'_>> = work
                .iter()
                .filter_map(|w| {
                    let s = &self.running[w.idx];
                    Some(PagedSeq {
                        tokens: &s.tokens[w.start..w.start + w.n],
                        past: w.start,
                        table: self.blocks.block_table(s.id)?,
                        decode_from: s.decode_from,
                    })
                })
                .collect();
            self.dec.forward_select(&seqs, &picks, &adjust)
        };
        let out = match out {
            Ok(l) => l,
            // Nothing of the step was committed: the interactive request
            // is admitted next, and this work runs again after it.
            Err(EngineError::Yielded) => {
                self.shared.yielded.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, "batched forward failed");
                let msg = format!("forward pass failed: {e}");
                let mut failed: Vec<usize> = work.iter().map(|w| w.idx).collect();
                failed.sort_unstable();
                for idx in failed.into_iter().rev() {
                    let seq = self.running.remove(idx);
                    self.fail(seq, &msg);
                }
                return;
            }
        };
        self.shared.steps.fetch_add(1, Ordering::Relaxed);
        let mut done: Vec<(usize, End)> = Vec::new();
        let mut need_slot: Vec<u64> = Vec::new();
        let mut deferred = Vec::new();
        for (wi, w) in work.iter().enumerate() {
            let seq = &mut self.running[w.idx];
            seq.computed = w.start + w.n;
            let _ = self.blocks.commit(seq.id, seq.computed);
            if seq.computed < seq.tokens.len() {
                continue; // more prompt to prefill
            }
            // A pick or candidates of a row its backend did not adjust
            // as asked are not this sequence's.
            let adjusted = adjust.touches(wi);
            let valid = out.adjusted || !adjusted;
            let row = Row {
                at: wi,
                pick: picks[wi],
                logits: out.row(wi, vocab),
                picked: out.picked.as_ref().and_then(|a| a.get(wi).copied()).filter(|_| valid),
                top: out.top(wi).filter(|_| valid),
                lp: match picks[wi] {
                    Pick::Scored { .. } => out.scored(wi),
                    _ => out.top(wi),
                }
                .filter(|_| valid),
                adjusted: adjusted && out.adjusted,
            };
            // n > 1: the other samples share the prompt's blocks from now on.
            for mut child in std::mem::take(&mut self.running[w.idx].samples) {
                let parent = &self.running[w.idx];
                if child.cancel.load(Ordering::Relaxed)
                    || self.blocks.fork(parent.id, child.id).is_err()
                {
                    self.finish(child, FinishReason::Cancelled);
                    continue;
                }
                child.computed = parent.computed;
                child.cached_tokens = parent.cached_tokens;
                child.wait_steps = parent.wait_steps;
                self.running.push(child);
                let idx = self.running.len() - 1;
                self.sample_into(idx, &row, &mut done, &mut need_slot, &mut deferred);
            }
            self.sample_into(w.idx, &row, &mut done, &mut need_slot, &mut deferred);
        }
        // Rows read after the step (candidates that missed): one read.
        self.sample_read(&deferred, &out, &mut done, &mut need_slot);
        done.sort_unstable_by_key(|d| d.0);
        for (idx, end) in done.into_iter().rev() {
            let seq = self.running.remove(idx);
            match end {
                Ok(reason) => self.finish(seq, reason),
                Err(msg) => self.fail(seq, &msg),
            }
        }
        for id in need_slot {
            self.reserve_slot(id);
        }
        self.publish();
    }

    /// Give the newest token of `id` a KV slot while blocks are short:
    /// freeing parked K/V first, then preempting the newest batch sequence,
    /// then the newest interactive one (possibly `id` itself; a batch
    /// sequence never takes an interactive one's blocks).
    fn reserve_slot(&mut self, id: u64) {
        loop {
            let Some(pos) = self.running.iter().position(|s| s.id == id) else { return };
            let tok = self.running[pos].tokens[self.running[pos].tokens.len() - 1];
            // The manager's copy of the tokens lags by this one token.
            match self.blocks.append(id, tok) {
                Ok(Some(cp)) => {
                    self.dec.copy_block(cp.src, cp.dst);
                    return;
                }
                Ok(None) => return,
                Err(_) => {
                    if self.release_parked() {
                        continue;
                    }
                    let Some(victim) =
                        self.newest(Priority::Batch).or_else(|| self.newest(Priority::Interactive))
                    else {
                        return;
                    };
                    self.preempt(victim);
                }
            }
        }
    }

    /// Free a running sequence's blocks; it is recomputed (prompt plus what
    /// it generated) when blocks are available again.
    fn preempt(&mut self, idx: usize) {
        let mut seq = self.running.remove(idx);
        let _ = self.blocks.free(seq.id);
        seq.computed = 0;
        seq.preemptions += 1;
        tracing::debug!(id = seq.id, tokens = seq.tokens.len(), "preempted");
        self.preempted.push_front(seq);
    }

    /// Push events to the streams; a vanished reader cancels its sequence.
    fn deliver(&mut self) {
        for s in self.running.iter_mut() {
            if !s.flush() {
                s.cancel.store(true, Ordering::Relaxed);
            }
        }
        self.closing.retain_mut(|s| s.flush() && !s.outbox.is_empty());
    }

    fn fail_all(&mut self, msg: &str) {
        let mut all: Vec<Seq> = self.running.drain(..).collect();
        all.extend(self.preempted.drain(..));
        let queued: Vec<Pending> = self.shared.queue().drain(..).collect();
        all.extend(queued.into_iter().map(|p| self.new_seq(p)));
        for s in all {
            self.fail(s, msg);
        }
        for s in self.closing.iter_mut() {
            let _ = s.flush();
        }
        self.publish();
    }
}
