//! Continuous batching: a [`BatchEngine`] owns the model on one dedicated
//! thread and serves many sequences at once. Each step it admits waiting
//! requests, runs one batched forward pass over every running sequence
//! (one decode token each, plus prefill chunks of newly admitted prompts)
//! with K/V in a shared paged pool, samples, and streams deltas back.
//!
//! The handle is cheap to clone and `Send + Sync`. Submissions beyond the
//! waiting-queue limit fail at once with [`EngineError::Busy`]. Results come
//! back over bounded channels; the engine thread never blocks on a slow
//! reader (undelivered deltas are merged and retried next step).
//!
//! [`BatchEngine::resume`] continues a request from tokens another engine
//! already generated, exactly (see [`resume`]).

mod measure;
mod resume;
mod step_loop;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::constraint::{Grammar, GrammarCompiler, SeqGrammar};
use crate::error::{EngineError, Result};
use crate::generate::{check_prompt_len, Engine, FinishReason};
use crate::paged::{blocks_for, BLOCK_SIZE};
use crate::sampling::{Logprobs, SamplingOptions, MAX_TOP_LOGPROBS};
use crate::tokenizer::{ChatMessage, GgufTokenizer};
use step_loop::StepLoop;

/// Scheduler limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchConfig {
    /// Sequences decoded together (the batch size).
    pub max_running: usize,
    /// Requests queued beyond that; more are refused with `Busy`.
    pub max_waiting: usize,
    /// KV blocks of 16 positions in the pool (~23 KB per position for SmolLM2-135M).
    pub kv_blocks: usize,
    /// Most prompt tokens prefilled per step, so decoding sequences keep
    /// streaming while a long prompt is processed.
    pub prefill_chunk: usize,
    /// Most batch prompt tokens per step (within `prefill_chunk`): the
    /// step an arriving interactive request waits for stays short (16: a
    /// 64-token chunk is ~100 ms of SmolLM2 on one CPU thread, and an
    /// interactive first token landing behind one set the p99;
    /// specs/figures.md, "TTFT beside a batch: the batch prompt chunk").
    pub batch_prefill_chunk: usize,
    /// Events buffered per stream before deltas are merged.
    pub stream_capacity: usize,
    /// How a GPU decoder runs: decode graphs, the CPU's arithmetic
    /// (`None`s: their defaults).
    pub gpu: crate::backend::GpuOptions,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            max_running: 16,
            max_waiting: 64,
            kv_blocks: 1024,
            prefill_chunk: 256,
            batch_prefill_chunk: 16,
            stream_capacity: 64,
            gpu: Default::default(),
        }
    }
}

/// Which sequences the scheduler serves first. Interactive sequences are
/// admitted before batch ones and take step slots and KV blocks from them
/// (a batch sequence is parked or preempted, then resumed exactly); batch
/// sequences run in whatever capacity interactive work leaves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Priority {
    /// A client waits on it.
    #[default]
    Interactive,
    /// Throughput work (an OpenAI batch, a processing subtask).
    Batch,
}

impl BatchConfig {
    /// Every limit at least 1.
    fn bounded(self) -> Self {
        BatchConfig {
            max_running: self.max_running.max(1),
            prefill_chunk: self.prefill_chunk.max(1),
            batch_prefill_chunk: self.batch_prefill_chunk.max(1),
            kv_blocks: self.kv_blocks.max(1),
            stream_capacity: self.stream_capacity.max(1),
            ..self
        }
    }
}

/// The prompt of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Already tokenized (BOS included if wanted).
    Tokens(Vec<u32>),
    /// Chat messages, rendered with the model's chat template.
    Chat(Vec<ChatMessage>),
}

/// One generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqRequest {
    pub prompt: Prompt,
    /// At least 1; clipped to the context length.
    pub max_tokens: usize,
    pub sampling: SamplingOptions,
    /// Stop strings, matched on the decoded text; never part of the output.
    pub stop: Vec<String>,
    /// Extra stop token ids on top of the model's EOS / end-of-turn tokens.
    pub stop_token_ids: Vec<u32>,
    /// Do not stop on the model's EOS / end-of-turn tokens.
    pub ignore_eos: bool,
    /// Prefix-cache salt: requests of different tenants never share K/V.
    pub tenant: String,
    /// `None`: no logprobs. `Some(n)`: the chosen token's logprob and the
    /// `n` (at most 20) most likely alternatives.
    pub logprobs: Option<usize>,
    /// Constrained decoding: the output must match this grammar (compiled
    /// at submission, on the caller's thread; each sample has its own state).
    pub grammar: Option<Grammar>,
    /// Scheduling class.
    pub priority: Priority,
}

impl SeqRequest {
    /// A greedy request with no stop strings, for the default tenant.
    pub fn new(prompt: Prompt, max_tokens: usize) -> Self {
        Self {
            prompt,
            max_tokens,
            sampling: SamplingOptions::default(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            tenant: String::new(),
            logprobs: None,
            grammar: None,
            priority: Priority::Interactive,
        }
    }
}

/// Final accounting of a sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqResult {
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache.
    pub cached_tokens: usize,
    /// The whole generated text: the deltas concatenated, preceded for a
    /// resumed sequence by the text its given tokens had released.
    pub text: String,
    /// Of `completion_tokens`, those given to [`BatchEngine::resume`]
    /// (generated elsewhere, not streamed again); 0 for a fresh request.
    pub resumed_tokens: usize,
    /// Engine steps that completed between the request's arrival and its
    /// first admission (0 on an idle engine; at most 1 for an interactive
    /// request, whatever batch work runs).
    pub wait_steps: u64,
    /// Times the sequence gave up its step slot or KV blocks to another.
    pub preemptions: u32,
}

/// What a [`SeqStream`] yields.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// New text (may be empty while text is held back), the tokens
    /// generated since the last delta and, if asked for, their logprobs
    /// (token ids; [`GgufTokenizer::token_bytes`] gives their bytes).
    Delta { text: String, token_ids: Vec<u32>, logprobs: Vec<Logprobs> },
    /// The last event of a sequence.
    Done(SeqResult),
    /// The sequence failed; the last event.
    Error(String),
}

/// The receiving end of one request. Dropping it cancels the sequence.
#[derive(Debug)]
pub struct SeqStream {
    id: u64,
    prompt_tokens: usize,
    /// The text a resumed request's given tokens released (empty otherwise).
    resumed_text: String,
    rx: Receiver<SeqEvent>,
    cancel: Arc<AtomicBool>,
}

impl SeqStream {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Prompt length in tokens (after templating).
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// For [`BatchEngine::resume`]: the text the given tokens released
    /// (what the client already has; the stream yields what follows).
    /// Empty for a fresh request.
    pub fn resumed_text(&self) -> &str {
        &self.resumed_text
    }

    /// The next event; `None` once the stream has ended.
    pub fn recv(&self) -> Option<SeqEvent> {
        self.rx.recv().ok()
    }

    /// The next event, waiting at most `timeout`.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<SeqEvent, RecvTimeoutError> {
        self.rx.recv_timeout(timeout)
    }

    pub fn try_recv(&self) -> Result<SeqEvent, TryRecvError> {
        self.rx.try_recv()
    }

    /// Ask the engine to stop this sequence. Its blocks are freed at the
    /// next step and a `Done` with `Cancelled` and the counts so far follows.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Drop for SeqStream {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// A validated request waiting for admission.
#[derive(Debug)]
struct Pending {
    id: u64,
    tokens: Vec<u32>,
    req: SeqRequest,
    tx: SyncSender<SeqEvent>,
    cancel: Arc<AtomicBool>,
    /// The compiled grammar of a constrained request (forked per sample).
    grammar: Option<SeqGrammar>,
    /// Further samples of an n > 1 request: (id, sender, cancel flag).
    samples: Vec<(u64, SyncSender<SeqEvent>, Arc<AtomicBool>)>,
    /// A resumed request's state after its given tokens (`tokens` is then
    /// still the prompt alone).
    resumed: Option<resume::Resumed>,
    /// [`Shared::steps`] when it was queued.
    arrived: u64,
}

/// State shared by the handles and the engine thread.
#[derive(Debug, Default)]
struct Shared {
    queue: Mutex<VecDeque<Pending>>,
    wake: Condvar,
    shutdown: AtomicBool,
    free_kv_tokens: AtomicUsize,
    running: AtomicUsize,
    /// Forward steps completed.
    steps: AtomicU64,
    /// Interactive requests queued so far: a batch-only step in flight
    /// gives way when it moves (`backend::Interrupt`).
    interactive_arrivals: Arc<AtomicU64>,
    /// Batch-only steps that gave way to an interactive arrival.
    yielded: AtomicU64,
    /// Rows read back after their step (`PagedDecoder::last_logits`).
    rows_read_after: AtomicU64,
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, VecDeque<Pending>> {
        // A poisoned lock only means a thread panicked while holding it; the
        // queue itself is still consistent.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Dropped when the engine thread ends, normally or by a panic: refuse new
/// work and fail what is still queued, so no caller waits forever.
#[derive(Debug)]
struct ExitGuard(Arc<Shared>);

impl Drop for ExitGuard {
    fn drop(&mut self) {
        self.0.shutdown.store(true, Ordering::Relaxed);
        self.0.running.store(0, Ordering::Relaxed);
        for p in self.0.queue().drain(..) {
            let _ = p.tx.try_send(SeqEvent::Error("engine stopped".into()));
            for (_, tx, _) in p.samples {
                let _ = tx.try_send(SeqEvent::Error("engine stopped".into()));
            }
        }
        if std::thread::panicking() {
            tracing::error!("batch engine thread panicked");
        }
    }
}

#[derive(Debug)]
struct Inner {
    shared: Arc<Shared>,
    tokenizer: Arc<GgufTokenizer>,
    /// `None` when the vocabulary cannot be turned into a token trie:
    /// constrained requests are then refused.
    grammars: Option<GrammarCompiler>,
    cfg: BatchConfig,
    vocab: usize,
    context: usize,
    next_id: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Relaxed);
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// Handle to the continuous-batching engine. Clone it freely; the engine
/// thread stops when the last handle is dropped (or on [`BatchEngine::shutdown`]).
#[derive(Debug, Clone)]
pub struct BatchEngine {
    inner: Arc<Inner>,
}

impl BatchEngine {
    /// Move `engine` onto its own thread and start scheduling, on the CPU.
    pub fn start(engine: Engine, cfg: BatchConfig) -> BatchEngine {
        Self::start_with(engine, cfg, |model, kv_blocks| {
            Box::new(crate::backend::CpuDecoder::new(model, kv_blocks))
        })
    }

    /// [`BatchEngine::start`] over the decoder `make` builds from the model
    /// and the K/V blocks the configuration allows (a backend of the
    /// caller's, or a test's wrapper around the CPU's).
    pub fn start_with(
        engine: Engine,
        cfg: BatchConfig,
        make: impl FnOnce(crate::llama::Llama, usize) -> Box<dyn crate::backend::PagedDecoder>,
    ) -> BatchEngine {
        let cfg = cfg.bounded();
        let Engine { model, tokenizer, .. } = engine;
        let dec = make(model, cfg.kv_blocks);
        Self::launch(tokenizer, dec, cfg)
    }

    /// [`BatchEngine::start`] with the forward step on `device`
    /// ([`crate::backend::paged_decoder`]: a GPU is probed and the model
    /// checked and uploaded here, on the caller's thread, so a refusal is
    /// an error and not a dead engine). The scheduler, prefix cache,
    /// preemption and sampling are the same on every device.
    pub fn start_on(
        engine: Engine,
        cfg: BatchConfig,
        device: crate::backend::ComputeDevice,
    ) -> std::result::Result<BatchEngine, crate::backend::BackendError> {
        let cfg = cfg.bounded();
        let Engine { model, tokenizer, .. } = engine;
        let dec = crate::backend::paged_decoder(device, model, cfg.kv_blocks, cfg.gpu)?;
        Ok(Self::launch(tokenizer, dec, cfg))
    }

    fn launch(
        tokenizer: GgufTokenizer,
        dec: Box<dyn crate::backend::PagedDecoder>,
        cfg: BatchConfig,
    ) -> BatchEngine {
        let grammars = GrammarCompiler::new(&tokenizer)
            .map_err(|e| tracing::warn!(error = %e, "no constrained decoding on this model"))
            .ok();
        let tokenizer = Arc::new(tokenizer);
        let shared = Arc::new(Shared::default());
        shared.free_kv_tokens.store(cfg.kv_blocks * BLOCK_SIZE, Ordering::Relaxed);
        let (vocab, context) = (dec.config().vocab, dec.config().context_length);
        let engine_loop = StepLoop::new(dec, tokenizer.clone(), shared.clone(), cfg.clone());
        let guard = ExitGuard(shared.clone());
        let thread = std::thread::Builder::new().name("gcs-batch-engine".into()).spawn(move || {
            let _guard = guard;
            engine_loop.run()
        });
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::error!(error = %e, "cannot spawn the batch engine thread");
                shared.shutdown.store(true, Ordering::Relaxed);
                None
            }
        };
        let inner = Inner {
            shared,
            tokenizer,
            grammars,
            cfg,
            vocab,
            context,
            next_id: AtomicU64::new(1),
            thread: Mutex::new(thread),
        };
        BatchEngine { inner: Arc::new(inner) }
    }

    /// The grammar compiler over this model's vocabulary, if it has one.
    pub fn grammars(&self) -> Option<&GrammarCompiler> {
        self.inner.grammars.as_ref()
    }

    pub fn tokenizer(&self) -> &GgufTokenizer {
        &self.inner.tokenizer
    }

    pub fn config(&self) -> &BatchConfig {
        &self.inner.cfg
    }

    /// The model's vocabulary size (valid token ids are below it).
    pub fn vocab(&self) -> usize {
        self.inner.vocab
    }

    /// The model's context length in tokens.
    pub fn context(&self) -> usize {
        self.inner.context
    }

    /// Render the chat template and tokenize.
    pub fn prompt_tokens(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        self.inner.tokenizer.encode_chat(messages)
    }

    /// KV positions free for new work (free plus evictable cached blocks).
    pub fn free_kv_tokens(&self) -> usize {
        self.inner.shared.free_kv_tokens.load(Ordering::Relaxed)
    }

    /// Requests waiting for admission.
    pub fn waiting(&self) -> usize {
        self.inner.shared.queue().len()
    }

    /// Sequences being processed.
    pub fn running(&self) -> usize {
        self.inner.shared.running.load(Ordering::Relaxed)
    }

    /// Forward steps completed since start.
    pub fn steps(&self) -> u64 {
        self.inner.shared.steps.load(Ordering::Relaxed)
    }

    /// Steps of batch work only that gave way, part done, to an
    /// interactive request that arrived while they ran (their work is
    /// done again at a later step).
    pub fn yielded_steps(&self) -> u64 {
        self.inner.shared.yielded.load(Ordering::Relaxed)
    }

    /// Rows whose logits were read back after their step: a draw whose
    /// cut, or a drawn token whose logprobs, lay past the best candidates
    /// the decoder returned (`backend::Pick::Top`). 0 on the CPU, which
    /// returns every row.
    pub fn rows_read_after_step(&self) -> u64 {
        self.inner.shared.rows_read_after.load(Ordering::Relaxed)
    }

    /// Validate and queue a request. Fails at once with
    /// [`EngineError::Busy`] when the waiting queue is full, and with
    /// `InvalidRequest` for requests that could never run.
    pub fn submit(&self, req: SeqRequest) -> Result<SeqStream> {
        let mut v = self.submit_n(req, 1)?;
        v.pop().ok_or(EngineError::Stopped)
    }

    /// Like [`BatchEngine::submit`] for `n` samples of one prompt (OpenAI's
    /// `n`): the prompt is prefilled once and its KV blocks are shared
    /// (copy-on-write). Sample `i` uses seed `seed + i`; one stream each.
    pub fn submit_n(&self, req: SeqRequest, n: usize) -> Result<Vec<SeqStream>> {
        self.enqueue(req, n, None)
    }

    /// Continue `req` after `generated`, the tokens an engine of the same
    /// build with the same model file already produced for it (delivered
    /// to the client by a worker that was lost). The stream yields only
    /// what follows: for greedy and seeded sampling exactly the tokens and
    /// text the uninterrupted sequence would have produced after
    /// `generated`, with the same logprobs. The prompt is prefilled and
    /// `generated` recomputed in their original float orders, so the K/V
    /// are bit-identical; the sampler, stop-string hold-back and grammar
    /// are replayed through `generated`. Refused (`InvalidRequest`) when
    /// `generated` cannot be a prefix of this request's output (it holds a
    /// stop token, completes a stop string or the grammar, or reaches
    /// `max_tokens`).
    pub fn resume(&self, req: SeqRequest, generated: &[u32]) -> Result<SeqStream> {
        let mut v = self.enqueue(req, 1, Some(generated))?;
        v.pop().ok_or(EngineError::Stopped)
    }

    fn enqueue(
        &self,
        req: SeqRequest,
        n: usize,
        generated: Option<&[u32]>,
    ) -> Result<Vec<SeqStream>> {
        let inner = &self.inner;
        if n == 0 || n > inner.cfg.max_running {
            return Err(EngineError::InvalidRequest(format!(
                "n must be in 1..={}",
                inner.cfg.max_running
            )));
        }
        if inner.shared.shutdown.load(Ordering::Relaxed) {
            return Err(EngineError::Stopped);
        }
        let tokens = match &req.prompt {
            Prompt::Tokens(t) => t.clone(),
            Prompt::Chat(m) => self.prompt_tokens(m)?,
        };
        self.validate(&req, &tokens, generated.map_or(0, <[u32]>::len))?;
        let mut grammar = match &req.grammar {
            None => None,
            Some(g) => {
                let c = inner.grammars.as_ref().ok_or_else(|| {
                    EngineError::InvalidRequest("this model has no constrained decoding".into())
                })?;
                Some(c.compile(g)?)
            }
        };
        let limits = resume::Limits { vocab: inner.vocab, context: inner.context };
        let resumed = generated
            .map(|g| {
                let (tok, n) = (&*inner.tokenizer, tokens.len());
                resume::replay(tok, &req, n, limits, grammar.as_mut(), g)
            })
            .transpose()?;
        let prompt_tokens = tokens.len();
        let mut streams = Vec::with_capacity(n);
        let mut ends = Vec::with_capacity(n);
        for _ in 0..n {
            let (tx, rx) = std::sync::mpsc::sync_channel(inner.cfg.stream_capacity);
            let cancel = Arc::new(AtomicBool::new(false));
            let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
            ends.push((id, tx, cancel.clone()));
            let resumed_text = resumed.as_ref().map(|r| r.text.clone()).unwrap_or_default();
            streams.push(SeqStream { id, prompt_tokens, resumed_text, rx, cancel });
        }
        let (id, tx, cancel) = ends.remove(0);
        {
            let mut q = inner.shared.queue();
            // Checked under the lock: the engine thread sets the flag
            // before it drains the queue for the last time.
            if inner.shared.shutdown.load(Ordering::Relaxed) {
                return Err(EngineError::Stopped);
            }
            if q.len() >= inner.cfg.max_waiting {
                return Err(EngineError::Busy { waiting: q.len() });
            }
            let arrived = inner.shared.steps.load(Ordering::Relaxed);
            let samples = ends;
            let interactive = req.priority == Priority::Interactive;
            q.push_back(Pending { id, tokens, req, tx, cancel, grammar, samples, resumed, arrived });
            // After the push: the step that gives way finds it queued.
            if interactive {
                inner.shared.interactive_arrivals.fetch_add(1, Ordering::Relaxed);
            }
        }
        inner.shared.wake.notify_all();
        Ok(streams)
    }

    /// `generated`: tokens a resumed request already has after the prompt.
    fn validate(&self, req: &SeqRequest, tokens: &[u32], generated: usize) -> Result<()> {
        let inner = &self.inner;
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        check_prompt_len(tokens, inner.context)?;
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= inner.vocab) {
            return bad(format!("token id {t} out of range"));
        }
        let len = tokens.len() + generated;
        if blocks_for(len + 1) > inner.cfg.kv_blocks {
            return bad(format!("sequence of {len} tokens does not fit the KV pool"));
        }
        if req.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        if req.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return bad(format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}"));
        }
        req.sampling.validate(inner.vocab)
    }

    /// Stop the engine thread: running and waiting sequences end with an
    /// error event. Later submissions fail with [`EngineError::Stopped`].
    pub fn shutdown(&self) {
        self.inner.shared.shutdown.store(true, Ordering::Relaxed);
        self.inner.shared.wake.notify_all();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn handle_is_send_sync_and_clone() {
        fn check<T: Send + Sync + Clone>() {}
        check::<super::BatchEngine>();
        fn send<T: Send>() {}
        send::<super::SeqStream>();
    }
}
