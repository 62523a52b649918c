//! The worker's async shell: admission of announced jobs into slots, and
//! one task per job that performs what its sans-IO machine
//! ([`crate::lifecycle::worker_job`]) asks for — requests to the gateway,
//! the engine on a blocking thread, records of what it signed — and feeds
//! back answers, deltas, cancellations and time.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use gcs_keyspace::keys;
use gcs_protocol::{
    now_ms, open, ApiRequestJob, Cancellation, Limits, ModelInfo, NodeId, NodeKey, TokenLogprob,
};
use libp2p::PeerId;
use tokio::sync::mpsc;

use super::executor::{ExecError, ExecOutcome, ExecRequest, Executor, Priority};
use super::peer_of;
use super::wire::{JobRequest, JobResponse, LeasedPayload};
use crate::lifecycle::worker_job::{
    Answer, Effect, Input, Offer, Policy, Request, Share, Slots, Termination, WorkerJob,
    IN_FLIGHT,
};
use crate::network::Network;

/// A cancellation for a job's machine: its signer and the lease it names.
type CancelNote = (NodeId, Option<String>);

/// How a running job's task is reached from outside it.
#[derive(Debug)]
struct Control {
    /// Cancellations, judged by the job's machine (bounded: one is enough,
    /// the rest of a burst is dropped).
    cancel: mpsc::Sender<CancelNote>,
    /// Whether the job holds a lease (what registrations count as load).
    leased: Arc<AtomicBool>,
}

/// Slots, backlog and the controls of the running jobs, under one lock.
#[derive(Debug)]
struct Book {
    slots: Slots,
    controls: HashMap<String, Control>,
    /// Jobs ended here, by [`Termination::kind`].
    ended: BTreeMap<&'static str, u64>,
}

/// Worker settings and state shared with job tasks.
#[derive(Clone)]
pub(crate) struct WorkerState {
    pub executor: Arc<dyn Executor>,
    pub key: Arc<NodeKey>,
    pub network: Network,
    pub models: Vec<ModelInfo>,
    book: Arc<Mutex<Book>>,
    pub registration_id: Arc<Mutex<String>>,
    pub limits: Limits,
    pub policy: Policy,
    /// Where the worker keeps its side of each job (job-participant scope).
    pub keyspace: Arc<gcs_keyspace::Keyspace>,
    /// Signalled when a leased job's slot frees: the node republishes its
    /// registration at once, since gateways refuse claims as `no_capacity`
    /// from the last one they heard (which may say "full" for a heartbeat).
    freed: Arc<tokio::sync::Notify>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl std::fmt::Debug for WorkerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerState").field("book", &self.book).finish_non_exhaustive()
    }
}

/// The engine as one job's task sees it: its deltas, then its outcome.
struct Engine {
    /// (text, tokens, their ids when reported, logprobs).
    deltas: mpsc::Receiver<(String, u32, Vec<u32>, Vec<TokenLogprob>)>,
    run: tokio::task::JoinHandle<Result<ExecOutcome, ExecError>>,
    cancel: Arc<AtomicBool>,
}

impl WorkerState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        executor: Arc<dyn Executor>,
        key: NodeKey,
        network: Network,
        models: Vec<ModelInfo>,
        max_jobs: usize,
        registration_id: Arc<Mutex<String>>,
        limits: Limits,
        policy: Policy,
        share: Share,
        keyspace: Arc<gcs_keyspace::Keyspace>,
    ) -> Self {
        let slots = Slots::new(max_jobs).with_share(share);
        let book = Book { slots, controls: HashMap::new(), ended: BTreeMap::new() };
        Self {
            executor,
            key: Arc::new(key),
            network,
            models,
            book: Arc::new(Mutex::new(book)),
            registration_id,
            limits,
            policy,
            keyspace,
            freed: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// Resolves after a leased job's slot freed (one wake-up for a burst).
    pub async fn slot_freed(&self) {
        self.freed.notified().await
    }

    /// Jobs running here under a lease (what registrations advertise: a
    /// claim still in flight is no load, and counting it would make the
    /// gateway refuse this worker's claims as `no_capacity`).
    pub fn load(&self) -> usize {
        lock(&self.book).controls.values().filter(|c| c.leased.load(Ordering::Relaxed)).count()
    }

    /// Jobs waiting in the backlog.
    pub fn backlog_len(&self) -> usize {
        lock(&self.book).slots.backlog_len()
    }

    /// The most slots one gateway held at once while another was active.
    pub fn peak_shared(&self) -> usize {
        lock(&self.book).slots.peak_shared()
    }

    /// Jobs ended here so far, by how they ended.
    pub fn ended(&self) -> BTreeMap<&'static str, u64> {
        lock(&self.book).ended.clone()
    }

    /// A job appeared on gossip: claim it if this worker can serve it, or
    /// keep it for when a slot frees.
    pub fn consider(&self, job: ApiRequestJob) {
        let Some(model) = self.policy.admit(&job, &self.key.node_id(), &self.models).cloned()
        else {
            return;
        };
        // The slot is reserved under the lock, so a burst of announcements
        // cannot start more than the slots allow.
        let mut book = lock(&self.book);
        let job = match book.slots.offer(job, now_ms()) {
            Offer::Start(job) => *job,
            Offer::Backlogged | Offer::Duplicate => return,
        };
        let (cancel_tx, cancel) = mpsc::channel(4);
        let leased = Arc::new(AtomicBool::new(false));
        let control = Control { cancel: cancel_tx, leased: leased.clone() };
        book.controls.insert(job.job_id.clone(), control);
        drop(book);
        let w = self.clone();
        tokio::spawn(async move {
            let job_id = job.job_id.clone();
            let t = w.run(job, model, cancel, leased).await;
            match &t {
                // Losing a claim race is the common case, not news.
                Termination::Completed | Termination::Cancelled | Termination::ClaimLost(_) => {
                    tracing::debug!(job_id, termination = t.kind(), "job ended here")
                }
                other => tracing::info!(job_id, termination = ?other, "job not completed here"),
            }
            let next = {
                let mut book = lock(&w.book);
                if book.controls.remove(&job_id).is_some_and(|c| c.leased.load(Ordering::Relaxed)) {
                    w.freed.notify_one();
                }
                *book.ended.entry(t.kind()).or_default() += 1;
                if matches!(t, Termination::Completed) {
                    // Its gateway leaves the unproven pool (slots.rs).
                    book.slots.completed(&job_id);
                }
                book.slots.finished(&job_id, now_ms())
            };
            tracing::debug!(job_id, "job slot freed");
            if let Some(next) = next {
                w.consider(next);
            }
        });
    }

    /// A cancellation that came from its signer, for the job's machine to
    /// judge (only the job's gateway, only this run's lease). False when
    /// the job does not run here.
    pub fn on_cancel(&self, c: &Cancellation) -> bool {
        let book = lock(&self.book);
        let Some(ctl) = book.controls.get(&c.job_id) else { return false };
        tracing::info!(job_id = %c.job_id, reason = %c.reason, issued_by = %c.issued_by, "cancellation");
        let _ = ctl.cancel.try_send((c.issued_by.clone(), c.lease_id.clone()));
        true
    }

    /// Runs one job's machine to its end.
    async fn run(
        &self,
        job: ApiRequestJob,
        model: ModelInfo,
        mut cancel: mpsc::Receiver<CancelNote>,
        leased: Arc<AtomicBool>,
    ) -> Termination {
        let Some(gateway) = peer_of(&job.gateway_node_id) else {
            return Termination::Gateway(format!("bad gateway id {}", job.gateway_node_id));
        };
        let registration_id = lock(&self.registration_id).clone();
        let (mut m, mut effects) =
            match WorkerJob::new(job, &model, &self.key, registration_id, now_ms()) {
                Ok(x) => x,
                Err(e) => return Termination::Internal(e.to_string()),
            };
        let (answers_tx, mut answers) = mpsc::channel::<(Request, Answer)>(IN_FLIGHT + 8);
        let mut engine: Option<Engine> = None;
        loop {
            for e in effects.drain(..) {
                if let Some(t) = self.perform(e, &m, &model, gateway, &answers_tx, &mut engine) {
                    return t;
                }
            }
            let deadline = m.poll_timeout().map(|t| {
                tokio::time::Instant::now()
                    + std::time::Duration::from_millis(t.saturating_sub(now_ms()))
            });
            let take_delta = m.wants_delta() && engine.is_some();
            let input = tokio::select! {
                Some((req, a)) = answers.recv() => Input::Answer(req, a),
                d = next_delta(&mut engine), if take_delta => d,
                Some((issued_by, lease_id)) = cancel.recv() => Input::Cancel { issued_by, lease_id },
                _ = sleep_until(deadline), if deadline.is_some() => Input::Tick,
            };
            effects = m.handle(input, now_ms(), &self.key);
            leased.store(m.lease_id().is_some(), Ordering::Relaxed);
        }
    }

    /// Carries out one effect; `Some` when the job is over.
    fn perform(
        &self,
        effect: Effect,
        m: &WorkerJob,
        model: &ModelInfo,
        gateway: PeerId,
        answers: &mpsc::Sender<(Request, Answer)>,
        engine: &mut Option<Engine>,
    ) -> Option<Termination> {
        let encoded = |r: Result<Vec<u8>, gcs_protocol::ProtocolError>| {
            r.map_err(|e| Termination::Internal(e.to_string()))
        };
        match effect {
            Effect::SendClaim(c) => match encoded(gcs_protocol::encode(&*c)) {
                Ok(b) => self.request(gateway, Request::Claim, JobRequest::Envelope(b), answers),
                Err(t) => return Some(t),
            },
            Effect::FetchPayload { job_id, lease_id } => self.request(
                gateway,
                Request::Payload,
                JobRequest::FetchPayload { job_id, lease_id },
                answers,
            ),
            Effect::StartEngine(p) => *engine = Some(self.start_engine(m.job(), model, *p)),
            Effect::StopEngine => {
                if let Some(e) = engine {
                    e.cancel.store(true, Ordering::SeqCst);
                }
            }
            Effect::SendChunk(c) => match encoded(gcs_protocol::encode(&*c)) {
                Ok(b) => {
                    self.record(m.job(), &keys::stream_chunk(&c.job_id, c.sequence), &b);
                    let req = Request::Chunk(c.sequence);
                    self.request(gateway, req, JobRequest::Envelope(b), answers);
                }
                Err(t) => return Some(t),
            },
            Effect::SendRenewal(r) => match encoded(gcs_protocol::encode(&r)) {
                Ok(b) => self.request(gateway, Request::Renewal, JobRequest::Envelope(b), answers),
                Err(t) => return Some(t),
            },
            Effect::SendResult(r) => match encoded(gcs_protocol::encode(&*r)) {
                Ok(b) => {
                    self.record(m.job(), &keys::result(&r.job_id), &b);
                    self.request(gateway, Request::Result, JobRequest::Envelope(b), answers);
                }
                Err(t) => return Some(t),
            },
            Effect::Done(t) => return Some(t),
        }
        None
    }

    /// Sends `req` to the gateway on its own task; the answer comes back
    /// on `answers`, opened and signature-checked.
    fn request(
        &self,
        gateway: PeerId,
        what: Request,
        req: JobRequest,
        answers: &mpsc::Sender<(Request, Answer)>,
    ) {
        let (network, limits, answers) =
            (self.network.clone(), self.limits.clone(), answers.clone());
        tokio::spawn(async move {
            let a = match network.request(gateway, req).await {
                Ok(JobResponse::Ack) => Answer::Ack,
                Ok(JobResponse::Envelope(b)) => match open(&b, now_ms(), &limits) {
                    Ok(m) => Answer::Envelope(Box::new(m)),
                    Err(e) => Answer::Failed(format!("invalid answer: {e}")),
                },
                Ok(JobResponse::Payload(p)) => Answer::Payload(p),
                Ok(JobResponse::Refused(r)) => Answer::Refused(r),
                Ok(JobResponse::Chunk(_) | JobResponse::Mirror(_)) => {
                    Answer::Failed("a processing answer to a job request".into())
                }
                Err(e) => Answer::Failed(e.to_string()),
            };
            // The job may be over already; then nobody waits for it.
            let _ = answers.send((what, a)).await;
        });
    }

    /// Runs the engine on a blocking thread; its deltas arrive on a bounded
    /// channel that the task reads only while the stream's window has room.
    fn start_engine(&self, job: &ApiRequestJob, model: &ModelInfo, p: LeasedPayload) -> Engine {
        let (tx, deltas) = mpsc::channel(64);
        let exec = self.executor.clone();
        let cache_salt = p.salt_hex();
        let req = ExecRequest {
            api_type: job.request.api_type,
            model: model.model_id.clone(),
            body: p.body,
            cache_salt,
            priority: Priority::of_job(job),
        };
        let cancel = Arc::new(AtomicBool::new(false));
        let flag = cancel.clone();
        // The machine accepted a continuation only as the signed job
        // announces it; the engine refuses (`ExecError::Invalid`, reported
        // as `gnus_continuation_refused`) a replay that does not release
        // the delivered text.
        let from = p.continuation;
        let run = tokio::task::spawn_blocking(move || {
            let mut emit = |text: &str, tokens: u32, ids: &[u32], logprobs: Vec<TokenLogprob>| {
                tx.blocking_send((text.to_string(), tokens, ids.to_vec(), logprobs)).is_ok()
            };
            match &from {
                None => exec.run_with_ids(&req, &flag, &mut emit),
                Some(c) => exec.resume_with_ids(&req, c, &flag, &mut emit),
            }
        });
        Engine { deltas, run, cancel }
    }

    /// Job-participant scope (specs/network.md): the worker keeps the signed
    /// chunks and result it sent, so the job's stream lives on exactly its
    /// two participants. Not on a `--role all` node's own jobs: its gateway
    /// records the fenced stream under the same keys.
    fn record(&self, job: &ApiRequestJob, key: &str, bytes: &[u8]) {
        if job.gateway_node_id == self.key.node_id() {
            return;
        }
        if let Err(e) = self.keyspace.put(key, bytes.to_vec(), now_ms()) {
            tracing::warn!(job_id = %job.job_id, error = %e, "worker record not stored");
        }
    }
}

/// The engine's next delta, or its outcome once it returned.
async fn next_delta(engine: &mut Option<Engine>) -> Input {
    let Some(e) = engine.as_mut() else { return std::future::pending().await };
    match e.deltas.recv().await {
        Some((text, tokens, token_ids, logprobs)) => {
            Input::Delta { text, tokens, token_ids, logprobs }
        }
        None => {
            let outcome = (&mut e.run)
                .await
                .unwrap_or_else(|e| Err(ExecError::Engine(format!("engine task: {e}"))));
            *engine = None;
            Input::EngineDone(outcome)
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
