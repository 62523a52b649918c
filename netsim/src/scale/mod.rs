//! A discrete-event simulation of the job market at 10–1000 nodes in one
//! process. The gateway side is the real code: `JobTracker` (with
//! `validate_claim` inside it) gets signed claims, renewals, chunks and
//! results and its effects are carried out. The network is modelled: a
//! random gossip mesh of average degree 6 with seeded per-edge latency,
//! jitter and loss; direct request-response between worker and gateway
//! with per-worker latency. Workers behave like `node/src/jobs/worker.rs`:
//! claim every announced job while a slot is free, else keep it in a
//! bounded backlog and claim it when a slot frees. Time is simulated, so
//! the same seed gives the same figures.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};

use figures::Rng;
pub use figures::{table, ScaleRow, ScaleSpec};
use gcs_node::lifecycle::tracker::{Effect, Input, JobTracker, TrackerConfig};
use gcs_protocol::ids::{self, id_from_parts};
use gcs_protocol::samples::{self, Params};
use gcs_protocol::{
    sign, ApiRequestJob, JobClaim, LeaseGrant, LeaseRenewal, Limits, NodeKey, NodeRegistration,
    ResultStatus, StreamChunk,
};

mod figures;

const T0: u64 = 1_783_468_800_000;
const BACKLOG: usize = 64;
/// Request-response timeout after which a worker gives up on a lost claim.
const RR_TIMEOUT_MS: u64 = 10_000;
/// A dead peer's connections close and gossipsub grafts replacements on its
/// next heartbeat (1 s); until then the dead node is a hole in the mesh.
const MESH_REPAIR_MS: u64 = 2_000;

#[derive(Debug)]
enum Ev {
    Arrival,
    Announce { w: usize, job: usize },
    ClaimAtGw { job: usize, w: usize, claim: Box<JobClaim> },
    LeaseAtW { job: usize, w: usize, lease: Box<LeaseGrant> },
    FreeSlot { job: usize, w: usize },
    FirstToken { job: usize, w: usize, lease: String },
    Renew { job: usize, w: usize, lease: String },
    RenewalAtGw { job: usize, r: Box<LeaseRenewal> },
    ChunkAtGw { job: usize, c: Box<StreamChunk> },
    Finish { job: usize, w: usize, lease: String },
    ResultAtGw { job: usize, r: Box<gcs_protocol::FinalResult> },
    Tick,
    Heartbeat { w: usize },
    Kill,
    MeshRepair,
}

#[derive(Debug)]
struct Worker {
    key: NodeKey,
    reg: NodeRegistration,
    reserved: BTreeSet<usize>,
    running: BTreeMap<usize, String>,
    backlog: VecDeque<usize>,
    alive: bool,
    died_at: u64,
    wins: u64,
    rtt_ms: u64,
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
                    reserved: BTreeSet::new(),
                    running: BTreeMap::new(),
                    backlog: VecDeque::new(),
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
            workers,
            by_id,
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
            Ev::LeaseAtW { job, w, lease } => self.leased(w, job, &lease),
            Ev::FreeSlot { job, w } => self.free(w, job),
            Ev::FirstToken { job, w, lease } => {
                if self.holds(w, job, &lease) {
                    let c = self.chunk(w, job, &lease);
                    let d = self.workers[w].rtt_ms / 2;
                    self.at(d, Ev::ChunkAtGw { job, c: Box::new(c) });
                }
            }
            Ev::Renew { job, w, lease } => {
                if self.holds(w, job, &lease) {
                    let r = self.renewal(w, job, &lease);
                    let d = self.workers[w].rtt_ms / 2;
                    self.at(d, Ev::RenewalAtGw { job, r: Box::new(r) });
                    self.at(2_000, Ev::Renew { job, w, lease });
                }
            }
            Ev::RenewalAtGw { job, r } => self.feed(job, Input::Renewal(*r)),
            Ev::ChunkAtGw { job, c } => self.feed(job, Input::Chunk(c)),
            Ev::Finish { job, w, lease } => {
                if self.holds(w, job, &lease) {
                    let r = self.result(w, job, &lease);
                    let d = self.workers[w].rtt_ms / 2;
                    self.at(d, Ev::ResultAtGw { job, r: Box::new(r) });
                    self.workers[w].running.remove(&job);
                    self.free(w, job);
                }
            }
            Ev::ResultAtGw { job, r } => self.feed(job, Input::Result(r)),
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
                // A claim on a finished job is still answered (rejected).
                let w = self.by_id.get(c.node_id.as_str()).copied();
                if let Some(w) = w {
                    let d = self.workers[w].rtt_ms / 2;
                    self.at(d, Ev::FreeSlot { job, w });
                }
            }
            return;
        }
        let holder = self.jobs[job].tracker.lease().map(|l| l.node_id.to_string());
        let effects = self.jobs[job].tracker.handle(input, self.now, &self.gw, &self.limits);
        self.apply(job, effects, holder);
    }

    fn apply(&mut self, job: usize, effects: Vec<Effect>, holder: Option<String>) {
        let dead_holder =
            holder.and_then(|h| self.by_id.get(&h).copied()).filter(|w| !self.workers[*w].alive);
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
                        self.reply(w, job, Ev::LeaseAtW { job, w, lease: Box::new(l) });
                    }
                }
                Effect::RejectClaim(r) => {
                    *self.reject_reasons.entry(format!("{:?}", r.reason)).or_default() += 1;
                    if let Some(&w) = self.by_id.get(r.node_id.as_str()) {
                        self.reply(w, job, Ev::FreeSlot { job, w });
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
                Effect::Complete(_) => self.completed += 1,
                Effect::Usage(_) => {
                    self.jobs[job].done = true;
                    self.active.remove(&job);
                }
                Effect::Forward(_) | Effect::Cancel(_) => {}
            }
        }
    }

    /// A claim exchange's answer reaches the worker after its round trip,
    /// or is lost and the worker's request times out.
    fn reply(&mut self, w: usize, job: usize, ev: Ev) {
        if self.rng.lost(self.spec.loss) {
            self.at(RR_TIMEOUT_MS, Ev::FreeSlot { job, w });
        } else {
            let d = self.workers[w].rtt_ms / 2 + self.rng.exp(2.0);
            self.at(d, ev);
        }
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

    /// `WorkerState::consider`: claim while a slot is free, else backlog.
    fn consider(&mut self, w: usize, job: usize) {
        let wk = &mut self.workers[w];
        let me = wk.key.node_id();
        if !wk.alive || self.jobs[job].announced.routing.excluded_nodes.contains(&me) {
            return;
        }
        if wk.reserved.contains(&job) {
            return;
        }
        if wk.reserved.len() >= self.spec.slots as usize {
            if !wk.backlog.contains(&job) {
                wk.backlog.push_back(job);
                if wk.backlog.len() > BACKLOG {
                    wk.backlog.pop_front();
                }
            }
            return;
        }
        wk.reserved.insert(job);
        let mut c = samples::claim(&wk.key, &Params { now_ms: self.now, ..Params::default() });
        c.job_id = self.jobs[job].announced.job_id.clone();
        c.claim_id = id_from_parts(ids::CLAIM, self.now, (w as u128) << 32 | job as u128);
        c.registration_id = wk.reg.registration_id.clone();
        let _ = sign(&mut c, &wk.key);
        if self.rng.lost(self.spec.loss) {
            self.at(RR_TIMEOUT_MS, Ev::FreeSlot { job, w });
        } else {
            let d = self.workers[w].rtt_ms / 2 + self.rng.exp(2.0);
            self.at(d, Ev::ClaimAtGw { job, w, claim: Box::new(c) });
        }
    }

    fn free(&mut self, w: usize, job: usize) {
        let wk = &mut self.workers[w];
        if wk.running.contains_key(&job) || !wk.reserved.remove(&job) || !wk.alive {
            return;
        }
        while let Some(next) = self.workers[w].backlog.pop_front() {
            if self.now < self.jobs[next].announced.expires_at_ms && !self.jobs[next].done {
                self.consider(w, next);
                break;
            }
        }
    }

    fn leased(&mut self, w: usize, job: usize, lease: &LeaseGrant) {
        if !self.workers[w].alive || !self.workers[w].reserved.contains(&job) {
            return;
        }
        let id = lease.lease_id.clone();
        self.workers[w].running.insert(job, id.clone());
        let ttft = 100 + self.rng.exp(300.0);
        let service = ttft + self.rng.exp(self.spec.service_ms);
        self.at(ttft, Ev::FirstToken { job, w, lease: id.clone() });
        self.at(2_000, Ev::Renew { job, w, lease: id.clone() });
        self.at(service, Ev::Finish { job, w, lease: id });
    }

    fn holds(&self, w: usize, job: usize, lease: &str) -> bool {
        let wk = &self.workers[w];
        wk.alive && wk.running.get(&job).is_some_and(|l| l == lease)
    }

    fn chunk(&self, w: usize, job: usize, lease: &str) -> StreamChunk {
        let key = &self.workers[w].key;
        let mut c = samples::chunk(key, &Params { n: 0, now_ms: self.now, ..Params::default() });
        c.job_id = self.jobs[job].announced.job_id.clone();
        c.lease_id = lease.into();
        let _ = sign(&mut c, key);
        c
    }

    fn renewal(&self, w: usize, job: usize, lease: &str) -> LeaseRenewal {
        let key = &self.workers[w].key;
        let mut r = samples::renewal(key, &Params { now_ms: self.now, ..Params::default() });
        r.job_id = self.jobs[job].announced.job_id.clone();
        r.lease_id = lease.into();
        let _ = sign(&mut r, key);
        r
    }

    fn result(&self, w: usize, job: usize, lease: &str) -> gcs_protocol::FinalResult {
        let key = &self.workers[w].key;
        let mut r =
            samples::final_result(key, &Params { n: 1, now_ms: self.now, ..Params::default() });
        r.job_id = self.jobs[job].announced.job_id.clone();
        r.lease_id = Some(lease.into());
        r.status = ResultStatus::Completed;
        let _ = sign(&mut r, key);
        r
    }

    fn heartbeat(&mut self, w: usize) {
        let now = self.now;
        let wk = &mut self.workers[w];
        if !wk.alive {
            return;
        }
        let mut reg = samples::registration(&wk.key, &Params { now_ms: now, ..Params::default() });
        reg.queue.max_concurrent_api_jobs = self.spec.slots;
        reg.queue.current_api_jobs = wk.running.len() as u32;
        let _ = sign(&mut reg, &wk.key);
        wk.reg = reg;
    }

    /// Kills a fraction of the busy workers (at least one) at once.
    fn kill(&mut self) {
        let busy: Vec<usize> =
            (0..self.workers.len()).filter(|&w| !self.workers[w].running.is_empty()).collect();
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

/// Runs the simulation at one size.
pub fn simulate(nodes: usize, spec: &ScaleSpec) -> ScaleRow {
    Sim::new(nodes, spec).run()
}
