//! A discrete-event simulation of the job market at 10–1000 nodes in one
//! process. The gateway side is the real code: `JobTracker` (with
//! `validate_claim` inside it) gets signed claims, renewals, chunks and
//! results and its effects are carried out. The network is modelled: a
//! random gossip mesh of average degree 6 with seeded per-edge latency,
//! jitter and loss; direct request-response between worker and gateway
//! with per-worker latency. The worker side is the real code too: each
//! worker admits announced jobs with the node's `Slots` (claim while a slot
//! is free, else a bounded backlog, claimed when a slot frees) and runs
//! each job's `WorkerJob` machine; only the engine is modelled (a first
//! token after an exponential delay, the end after the service time). Time
//! is simulated, so the same seed gives the same figures.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use figures::Rng;
pub use figures::{table, ScaleRow, ScaleSpec};
use gcs_node::jobs::executor::ExecOutcome;
use gcs_node::lifecycle::tracker::{Effect, Input, JobTracker, TrackerConfig};
use gcs_node::lifecycle::worker_job::{self as wj, Answer, Offer, Policy, Slots, WorkerJob};
use gcs_protocol::ids::{self, id_from_parts};
use gcs_protocol::samples::{self, Params};
use gcs_protocol::{
    sign, ApiRequestJob, FinishReason, JobClaim, LeaseRenewal, Limits, Message, ModelInfo, NodeKey,
    NodeRegistration, StreamChunk,
};

mod figures;

const T0: u64 = 1_783_468_800_000;
/// A stopped engine returns within about one decode step.
const STOP_MS: u64 = 20;
/// Request-response timeout after which a worker gives up on a lost claim.
const RR_TIMEOUT_MS: u64 = 10_000;
/// A dead peer's connections close and gossipsub grafts replacements on its
/// next heartbeat (1 s); until then the dead node is a hole in the mesh.
const MESH_REPAIR_MS: u64 = 2_000;

#[derive(Debug)]
enum Ev {
    Arrival,
    Announce {
        w: usize,
        job: usize,
    },
    ClaimAtGw {
        job: usize,
        w: usize,
        claim: Box<JobClaim>,
    },
    RenewalAtGw {
        job: usize,
        r: Box<LeaseRenewal>,
    },
    ChunkAtGw {
        job: usize,
        w: usize,
        c: Box<StreamChunk>,
    },
    ResultAtGw {
        job: usize,
        w: usize,
        r: Box<gcs_protocol::FinalResult>,
    },
    /// Something reaches one worker's job machine.
    AtWorker {
        w: usize,
        job: usize,
        input: Box<wj::Input>,
    },
    Tick,
    Heartbeat {
        w: usize,
    },
    Kill,
    MeshRepair,
}

#[derive(Debug)]
struct Worker {
    key: NodeKey,
    reg: NodeRegistration,
    slots: Slots,
    /// The machine of each job this worker has a slot for.
    running: BTreeMap<usize, WorkerJob>,
    /// When a `Tick` is already scheduled for a job's machine.
    tick_at: BTreeMap<usize, u64>,
    alive: bool,
    died_at: u64,
    wins: u64,
    rtt_ms: u64,
}

impl Worker {
    /// Busy: running a job under a lease (not merely claiming one).
    fn holds_a_lease(&self) -> bool {
        self.running.values().any(|m| m.lease_id().is_some())
    }
}

#[derive(Debug)]
struct Job {
    tracker: JobTracker,
    announced: ApiRequestJob,
    published_at: u64,
    lease: Option<String>,
    done: bool,
}

struct Sim {
    spec: ScaleSpec,
    rng: Rng,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    events: BTreeMap<u64, Ev>,
    gw: NodeKey,
    limits: Limits,
    workers: Vec<Worker>,
    by_id: BTreeMap<String, usize>,
    job_by_id: BTreeMap<String, usize>,
    model: ModelInfo,
    /// Mesh: node `n` (index `workers.len()`) is the gateway.
    adj: Vec<Vec<(usize, u64)>>,
    jobs: Vec<Job>,
    active: BTreeSet<usize>,
    // Figures.
    claim_ms: Vec<u64>,
    gossip: u64,
    claims: u64,
    grants: u64,
    detect_ms: Vec<u64>,
    completed: u64,
    failed: u64,
    requeues: u64,
    fail_codes: BTreeMap<String, u64>,
    requeue_reasons: BTreeMap<String, u64>,
    reject_reasons: BTreeMap<String, u64>,
}

impl Sim {
    fn new(n: usize, spec: &ScaleSpec) -> Sim {
        let mut rng = Rng(spec.seed ^ (n as u64).wrapping_mul(0x100_0000_01B3));
        let gw = NodeKey::from_seed([200; 32]);
        let workers: Vec<Worker> = (0..n)
            .map(|i| {
                let mut seed = [0u8; 32];
                seed[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
                let key = NodeKey::from_seed(seed);
                let reg = samples::registration(&key, &Params::default());
                Worker {
                    key,
                    reg,
                    slots: Slots::new(spec.slots as usize),
                    running: BTreeMap::new(),
                    tick_at: BTreeMap::new(),
                    alive: true,
                    died_at: 0,
                    wins: 0,
                    rtt_ms: rng.range(5, 60),
                }
            })
            .collect();
        let by_id =
            workers.iter().enumerate().map(|(i, w)| (w.key.node_id().to_string(), i)).collect();
        // A ring over a random permutation (connected) plus two random
        // chords per node: average degree about 6, like gossipsub's D.
        let total = n + 1;
        let mut adj = vec![vec![]; total];
        let mut perm: Vec<usize> = (0..total).collect();
        for i in (1..total).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        let edge = |a: usize, b: usize, rng: &mut Rng, adj: &mut Vec<Vec<(usize, u64)>>| {
            if a != b && !adj[a].iter().any(|(x, _)| *x == b) {
                let l = rng.range(2, 40);
                adj[a].push((b, l));
                adj[b].push((a, l));
            }
        };
        for i in 0..total {
            edge(perm[i], perm[(i + 1) % total], &mut rng, &mut adj);
        }
        for a in 0..total {
            for _ in 0..2 {
                let b = rng.below(total);
                edge(a, b, &mut rng, &mut adj);
            }
        }
        Sim {
            spec: spec.clone(),
            rng,
            now: T0,
            seq: 0,
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            gw,
            limits: Limits::default(),
            model: workers[0].reg.models[0].clone(),
            workers,
            by_id,
            job_by_id: BTreeMap::new(),
            adj,
            jobs: vec![],
            active: BTreeSet::new(),
            claim_ms: vec![],
            gossip: 0,
            claims: 0,
            grants: 0,
            detect_ms: vec![],
            completed: 0,
            failed: 0,
            requeues: 0,
            fail_codes: BTreeMap::new(),
            requeue_reasons: BTreeMap::new(),
            reject_reasons: BTreeMap::new(),
        }
    }

    fn at(&mut self, delay_ms: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((self.now + delay_ms, self.seq)));
        self.events.insert(self.seq, ev);
    }

    fn run(mut self) -> ScaleRow {
        let n = self.workers.len();
        for w in 0..n {
            let phase = self.rng.range(0, 10_000);
            self.heartbeat(w);
            self.at(phase, Ev::Heartbeat { w });
        }
        self.at(0, Ev::Arrival);
        self.at(250, Ev::Tick);
        self.at(self.spec.duration_s * 500, Ev::Kill);
        let end = T0 + self.spec.duration_s * 1000 + 150_000;
        while let Some(Reverse((t, seq))) = self.queue.pop() {
            if t > end {
                break;
            }
            self.now = t;
            let Some(ev) = self.events.remove(&seq) else { continue };
            self.step(ev);
            if self.now > T0 + self.spec.duration_s * 1000 && self.active.is_empty() {
                break;
            }
        }
        self.row()
    }

    fn step(&mut self, ev: Ev) {
        match ev {
            Ev::Arrival => self.arrival(),
            Ev::Announce { w, job } => self.consider(w, job),
            Ev::ClaimAtGw { job, w, claim } => {
                self.claims += 1;
                let reg = Box::new(self.workers[w].reg.clone());
                self.feed(job, Input::Claim(claim, Some(reg)));
            }
            Ev::RenewalAtGw { job, r } => self.feed(job, Input::Renewal(*r)),
            Ev::ChunkAtGw { job, w, c } => {
                // The gateway acknowledges a chunk of the current lease of a
                // job still open, and refuses any other.
                let current = !self.jobs[job].done
                    && self.jobs[job].tracker.lease().is_some_and(|l| l.lease_id == c.lease_id);
                let seq = c.sequence;
                self.feed(job, Input::Chunk(c));
                let a =
                    if current { Answer::Ack } else { Answer::Refused("not this lease".into()) };
                self.answer(w, job, wj::Request::Chunk(seq), a);
            }
            Ev::ResultAtGw { job, w, r } => {
                self.feed(job, Input::Result(r));
                self.answer(w, job, wj::Request::Result, Answer::Ack);
            }
            Ev::AtWorker { w, job, input } => self.at_worker(w, job, *input),
            Ev::Tick => {
                for job in self.active.clone() {
                    self.feed(job, Input::Tick);
                }
                self.at(250, Ev::Tick);
            }
            Ev::Heartbeat { w } => {
                self.heartbeat(w);
                self.at(10_000, Ev::Heartbeat { w });
            }
            Ev::Kill => {
                self.kill();
                self.at(MESH_REPAIR_MS, Ev::MeshRepair);
            }
            Ev::MeshRepair => self.repair_mesh(),
        }
    }

    fn arrival(&mut self) {
        if self.now >= T0 + self.spec.duration_s * 1000 {
            return;
        }
        let idx = self.jobs.len();
        let mut job = samples::api_job(&self.gw, &Params { now_ms: self.now, ..Params::default() });
        job.job_id = id_from_parts(ids::JOB, self.now, idx as u128);
        self.job_by_id.insert(job.job_id.clone(), idx);
        job.signature = None;
        let _ = sign(&mut job, &self.gw);
        let config = TrackerConfig { queue_timeout_ms: 30_000, ..TrackerConfig::default() };
        let (tracker, effects) = JobTracker::new(job.clone(), config, self.now);
        self.jobs.push(Job {
            tracker,
            announced: job,
            published_at: self.now,
            lease: None,
            done: false,
        });
        self.active.insert(idx);
        self.apply(idx, effects, None);
        let gap = self.rng.exp(1000.0 / self.spec.rate_per_s);
        self.at(gap, Ev::Arrival);
    }

    fn feed(&mut self, job: usize, input: Input) {
        if self.jobs[job].done {
            if let Input::Claim(c, _) = &input {
                // A claim on a finished job is still answered (refused).
                if let Some(&w) = self.by_id.get(c.node_id.as_str()) {
                    let a = Answer::Refused("job ended".into());
                    self.answer(w, job, wj::Request::Claim, a);
                }
            }
            return;
        }
        let holder = self.jobs[job].tracker.lease().map(|l| l.node_id.to_string());
        let effects = self.jobs[job].tracker.handle(input, self.now, &self.gw, &self.limits);
        self.apply(job, effects, holder);
    }

    fn apply(&mut self, job: usize, effects: Vec<Effect>, holder: Option<String>) {
        let holder = holder.and_then(|h| self.by_id.get(&h).copied());
        let dead_holder = holder.filter(|w| !self.workers[*w].alive);
        for e in effects {
            match e {
                Effect::Publish(j) => {
                    self.jobs[job].announced = *j;
                    self.jobs[job].published_at = self.now;
                    self.gossip_job(job);
                }
                Effect::Lease(l) => {
                    if self.jobs[job].lease.as_deref() == Some(l.lease_id.as_str()) {
                        continue; // a renewal answer
                    }
                    self.jobs[job].lease = Some(l.lease_id.clone());
                    self.grants += 1;
                    self.claim_ms.push(self.now - self.jobs[job].published_at);
                    if let Some(&w) = self.by_id.get(l.node_id.as_str()) {
                        self.workers[w].wins += 1;
                        let a = Answer::Envelope(Box::new(Message::LeaseGrant(l)));
                        self.reply(w, job, a);
                    }
                }
                Effect::RejectClaim(r) => {
                    *self.reject_reasons.entry(format!("{:?}", r.reason)).or_default() += 1;
                    if let Some(&w) = self.by_id.get(r.node_id.as_str()) {
                        self.reply(w, job, Answer::Envelope(Box::new(Message::ClaimRejection(r))));
                    }
                }
                Effect::Requeue(_) | Effect::Fail { .. } => {
                    if let Effect::Requeue(rq) = &e {
                        self.requeues += 1;
                        self.jobs[job].lease = None;
                        *self.requeue_reasons.entry(format!("{:?}", rq.reason)).or_default() += 1;
                    } else if let Effect::Fail { error, .. } = &e {
                        self.failed += 1;
                        *self.fail_codes.entry(error.code.clone()).or_default() += 1;
                    }
                    if let Some(w) = dead_holder {
                        self.detect_ms.push(self.now - self.workers[w].died_at);
                    }
                }
                Effect::Continue { .. } => {
                    // Simulated workers advertise no engine build, so no
                    // continuation is offered here; counted as a requeue.
                    self.requeues += 1;
                    self.jobs[job].lease = None;
                }
                Effect::Complete(_) => self.completed += 1,
                Effect::Usage(_) => {
                    self.jobs[job].done = true;
                    self.active.remove(&job);
                }
                Effect::Cancel(c) => {
                    if let Some(w) = holder {
                        let d = self.workers[w].rtt_ms / 2;
                        let input = Box::new(wj::Input::Cancel {
                            issued_by: c.issued_by,
                            lease_id: c.lease_id,
                        });
                        self.at(d, Ev::AtWorker { w, job, input });
                    }
                }
                // No continuation is offered here (see `Continue`).
                Effect::Forward(_) | Effect::Strike(_) | Effect::Revoke { .. } | Effect::Seam(_) => {}
            }
        }
    }

    /// A claim exchange's answer reaches the worker after its round trip,
    /// or is lost and the worker's request times out.
    fn reply(&mut self, w: usize, job: usize, a: Answer) {
        let claim = wj::Request::Claim;
        if self.rng.lost(self.spec.loss) {
            let input = Box::new(wj::Input::Answer(claim, Answer::Failed("timeout".into())));
            self.at(RR_TIMEOUT_MS, Ev::AtWorker { w, job, input });
        } else {
            let d = self.workers[w].rtt_ms / 2 + self.rng.exp(2.0);
            self.at(d, Ev::AtWorker { w, job, input: Box::new(wj::Input::Answer(claim, a)) });
        }
    }

    /// A direct answer reaches the worker after half its round trip.
    fn answer(&mut self, w: usize, job: usize, to: wj::Request, a: Answer) {
        let d = self.workers[w].rtt_ms / 2;
        self.at(d, Ev::AtWorker { w, job, input: Box::new(wj::Input::Answer(to, a)) });
    }

    /// Floods the announcement over the mesh from the gateway: each node
    /// forwards once to every mesh peer but the sender; dead nodes drop it.
    fn gossip_job(&mut self, job: usize) {
        let n = self.workers.len();
        let mut best = vec![u64::MAX; n + 1];
        let mut from = vec![usize::MAX; n + 1];
        let mut heap = BinaryHeap::new();
        best[n] = 0;
        heap.push(Reverse((0u64, n)));
        while let Some(Reverse((d, v))) = heap.pop() {
            if d > best[v] {
                continue;
            }
            if v < n && !self.workers[v].alive {
                continue;
            }
            for i in 0..self.adj[v].len() {
                let (u, l) = self.adj[v][i];
                if u == from[v] {
                    continue;
                }
                self.gossip += 1;
                if self.rng.lost(self.spec.loss) {
                    continue;
                }
                let nd = d + l + self.rng.exp(2.0);
                if nd < best[u] {
                    best[u] = nd;
                    from[u] = v;
                    heap.push(Reverse((nd, u)));
                }
            }
        }
        for (w, &d) in best.iter().enumerate().take(n) {
            if d != u64::MAX {
                self.at(d, Ev::Announce { w, job });
            }
        }
    }

    /// `WorkerState::consider`: the node's policy and slots decide.
    fn consider(&mut self, w: usize, job: usize) {
        let now = self.now;
        let wk = &mut self.workers[w];
        let announced = self.jobs[job].announced.clone();
        if !wk.alive || !Policy::default().allows(&announced, &wk.key.node_id()) {
            return;
        }
        let Offer::Start(announced) = wk.slots.offer(announced, now) else { return };
        let reg = wk.reg.registration_id.clone();
        let Ok((m, effects)) = WorkerJob::new(*announced, &self.model, &wk.key, reg, now) else {
            return;
        };
        wk.running.insert(job, m);
        self.perform(w, job, effects);
    }

    fn at_worker(&mut self, w: usize, job: usize, input: wj::Input) {
        let now = self.now;
        let wk = &mut self.workers[w];
        if !wk.alive {
            return;
        }
        if matches!(input, wj::Input::Tick) {
            wk.tick_at.remove(&job);
        }
        let Some(m) = wk.running.get_mut(&job) else { return };
        let effects = m.handle(input, now, &wk.key);
        self.perform(w, job, effects);
    }

    /// Carries out a worker machine's effects; the engine is modelled.
    fn perform(&mut self, w: usize, job: usize, effects: Vec<wj::Effect>) {
        let d = self.workers[w].rtt_ms / 2;
        for e in effects {
            match e {
                wj::Effect::SendClaim(claim) => {
                    if self.rng.lost(self.spec.loss) {
                        let a = Answer::Failed("timeout".into());
                        let input = Box::new(wj::Input::Answer(wj::Request::Claim, a));
                        self.at(RR_TIMEOUT_MS, Ev::AtWorker { w, job, input });
                    } else {
                        let d = d + self.rng.exp(2.0);
                        self.at(d, Ev::ClaimAtGw { job, w, claim });
                    }
                }
                wj::Effect::FetchPayload { .. } => {
                    let p = self.jobs[job].announced.request.payload_ref.inline.clone();
                    let p = wj::LeasedPayload::new(p.unwrap_or_default(), "t".into(), [0; 32]);
                    let a = Answer::Payload(Box::new(p));
                    self.answer(w, job, wj::Request::Payload, a);
                }
                wj::Effect::StartEngine(_) => {
                    let ttft = 100 + self.rng.exp(300.0);
                    let service = ttft + self.rng.exp(self.spec.service_ms);
                    let delta = wj::Input::Delta {
                        text: "x".into(),
                        tokens: 1,
                        token_ids: vec![],
                        logprobs: vec![],
                    };
                    self.at(ttft, Ev::AtWorker { w, job, input: Box::new(delta) });
                    let done = wj::Input::EngineDone(Ok(outcome()));
                    self.at(service, Ev::AtWorker { w, job, input: Box::new(done) });
                }
                wj::Effect::StopEngine => {
                    let done = wj::Input::EngineDone(Ok(outcome()));
                    self.at(STOP_MS, Ev::AtWorker { w, job, input: Box::new(done) });
                }
                wj::Effect::SendChunk(c) => self.at(d, Ev::ChunkAtGw { job, w, c }),
                wj::Effect::SendRenewal(r) => self.at(d, Ev::RenewalAtGw { job, r: Box::new(r) }),
                wj::Effect::SendResult(r) => self.at(d, Ev::ResultAtGw { job, w, r }),
                wj::Effect::Done(_) => {
                    let wk = &mut self.workers[w];
                    wk.running.remove(&job);
                    let id = &self.jobs[job].announced.job_id;
                    if let Some(next) = wk.slots.finished(id, self.now) {
                        if let Some(&n) = self.job_by_id.get(&next.job_id) {
                            self.consider(w, n);
                        }
                    }
                    return;
                }
            }
        }
        // The machine asks for time when a renewal is due.
        let wk = &mut self.workers[w];
        let due = wk.running.get(&job).and_then(|m| m.poll_timeout());
        if let Some(t) = due {
            if wk.tick_at.get(&job) != Some(&t) {
                wk.tick_at.insert(job, t);
                let delay = t.saturating_sub(self.now);
                self.at(delay, Ev::AtWorker { w, job, input: Box::new(wj::Input::Tick) });
            }
        }
    }

    fn heartbeat(&mut self, w: usize) {
        let now = self.now;
        let wk = &mut self.workers[w];
        if !wk.alive {
            return;
        }
        let mut reg = samples::registration(&wk.key, &Params { now_ms: now, ..Params::default() });
        reg.queue.max_concurrent_api_jobs = self.spec.slots;
        // As the node advertises: jobs under a lease, not claims in flight.
        reg.queue.current_api_jobs =
            wk.running.values().filter(|m| m.lease_id().is_some()).count() as u32;
        let _ = sign(&mut reg, &wk.key);
        wk.reg = reg;
    }

    /// Kills a fraction of the busy workers (at least one) at once.
    fn kill(&mut self) {
        let busy: Vec<usize> =
            (0..self.workers.len()).filter(|&w| self.workers[w].holds_a_lease()).collect();
        let k = ((self.workers.len() as f64 * self.spec.kill_fraction) as usize).max(1);
        let mut pool = busy;
        for _ in 0..k.min(pool.len()) {
            let w = pool.swap_remove(self.rng.below(pool.len()));
            self.workers[w].alive = false;
            self.workers[w].died_at = self.now;
        }
    }

    /// Drops dead nodes from the mesh; each peer that lost one grafts a
    /// random live node instead.
    fn repair_mesh(&mut self) {
        let n = self.workers.len();
        for w in 0..n {
            if self.workers[w].alive || self.adj[w].is_empty() {
                continue;
            }
            let peers: Vec<usize> = self.adj[w].drain(..).map(|(u, _)| u).collect();
            for u in peers {
                self.adj[u].retain(|(x, _)| *x != w);
                loop {
                    let v = self.rng.below(n + 1);
                    let live = v == n || self.workers[v].alive;
                    if v != u && live && !self.adj[u].iter().any(|(x, _)| *x == v) {
                        let l = self.rng.range(2, 40);
                        self.adj[u].push((v, l));
                        self.adj[v].push((u, l));
                        break;
                    }
                }
            }
        }
    }

    fn row(&self) -> ScaleRow {
        let mut c = self.claim_ms.clone();
        c.sort_unstable();
        let pct = |v: &[u64], p: f64| {
            v.get(((v.len().max(1) - 1) as f64 * p).round() as usize).copied().unwrap_or(0)
        };
        let wins: Vec<f64> = self.workers.iter().map(|w| w.wins as f64).collect();
        let sum: f64 = wins.iter().sum();
        let sq: f64 = wins.iter().map(|x| x * x).sum();
        let mean = sum / wins.len().max(1) as f64;
        let max = wins.iter().copied().fold(0.0, f64::max);
        let jobs = self.jobs.len() as u64;
        ScaleRow {
            nodes: self.workers.len(),
            jobs,
            completed: self.completed,
            failed: self.failed,
            claim_p50_ms: pct(&c, 0.5),
            claim_p99_ms: pct(&c, 0.99),
            gossip_per_job: self.gossip as f64 / jobs.max(1) as f64,
            claims_per_win: self.claims as f64 / self.grants.max(1) as f64,
            fairness: if sq > 0.0 { sum * sum / (wins.len() as f64 * sq) } else { 0.0 },
            max_over_mean: if mean > 0.0 { max / mean } else { 0.0 },
            detect_mean_ms: self.detect_ms.iter().sum::<u64>() / self.detect_ms.len().max(1) as u64,
            detect_max_ms: self.detect_ms.iter().copied().max().unwrap_or(0),
            requeues: self.requeues,
            fail_codes: self.fail_codes.clone(),
            requeue_reasons: self.requeue_reasons.clone(),
            reject_reasons: self.reject_reasons.clone(),
        }
    }
}

/// What the modelled engine returns.
fn outcome() -> ExecOutcome {
    ExecOutcome {
        finish_reason: FinishReason::Stop,
        input_tokens: 10,
        output_tokens: 1,
        cached_tokens: 0,
        body: serde_json::Value::Null,
    }
}

/// Runs the simulation at one size.
pub fn simulate(nodes: usize, spec: &ScaleSpec) -> ScaleRow {
    Sim::new(nodes, spec).run()
}
