//! The worker's admission: which announced jobs it starts now, which wait
//! in its backlog for a free slot, which it forgets — and how much of
//! either one gateway may take. Any peer can sign jobs as a gateway, so
//! while more than one gateway offers jobs, each may hold at most
//! [`Share::percent`] of the slots and of the backlog: a fake gateway that
//! floods announcements evicts only its own backlog entries and never holds
//! every slot. Gateway ids cost nothing, so the gateways that have not yet
//! had a job complete here (unproven) share one pool of that same share,
//! all together: a thousand fake ids take no more than one (specs/network.md,
//! "Worker shares"). Batch jobs never take the last free slot, so an
//! interactive job always finds one (specs/batch.md, "Priority on the
//! worker"). Sans-IO: time is passed in.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use gcs_protocol::{ApiRequestJob, NodeId};

use crate::jobs::executor::Priority;

/// Announced jobs a busy worker remembers; the oldest is forgotten first.
pub const BACKLOG: usize = 256;
/// A gateway counts as active this long after its last announcement.
pub const GATEWAY_SEEN_MS: u64 = 60_000;
/// Most gateways remembered (the least recently seen is forgotten).
pub const MAX_GATEWAYS: usize = 1024;
/// Most proven gateways remembered (the least recently proven is forgotten).
pub const MAX_PROVEN: usize = 1024;

/// How much one gateway may take while others are active.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    /// Percent of the slots and of the backlog, 1 to 100.
    pub percent: u8,
}

impl Default for Share {
    /// Half: two gateways can always both be served.
    fn default() -> Self {
        Self { percent: 50 }
    }
}

impl Share {
    /// Of `total`, what one gateway may take (at least one).
    fn of(&self, total: usize) -> usize {
        (total * usize::from(self.percent.clamp(1, 100)) / 100).max(1)
    }
}

/// What [`Slots::offer`] decided.
#[derive(Debug, PartialEq)]
pub enum Offer {
    /// A slot is reserved for the job: claim it now.
    Start(Box<ApiRequestJob>),
    /// Every slot is taken, or its gateway holds its share; the job waits
    /// in the backlog.
    Backlogged,
    /// The job already runs or waits here.
    Duplicate,
}

/// Slots and backlog of one worker.
#[derive(Debug)]
pub struct Slots {
    max: usize,
    backlog_cap: usize,
    share: Share,
    /// Running job → its gateway.
    running: BTreeMap<String, NodeId>,
    /// The running jobs of the batch class.
    batch: BTreeSet<String>,
    backlog: VecDeque<ApiRequestJob>,
    /// Gateway → when it last announced a job.
    seen: BTreeMap<NodeId, u64>,
    /// The most slots one gateway held at once while another was active.
    peak_shared: usize,
    /// Gateway → the start count when it last started a job here (the
    /// turn order: least recently served first).
    last_turn: BTreeMap<NodeId, u64>,
    starts: u64,
    /// Gateway → the completion count when a job of it last completed
    /// here; the others are unproven and share one pool.
    proven: BTreeMap<NodeId, u64>,
    completions: u64,
}

impl Slots {
    /// `max` concurrent jobs, the default [`BACKLOG`] and [`Share`].
    pub fn new(max: usize) -> Self {
        Self::with_backlog(max, BACKLOG)
    }

    /// `max` concurrent jobs and a backlog of `backlog_cap` jobs.
    pub fn with_backlog(max: usize, backlog_cap: usize) -> Self {
        Self {
            max,
            backlog_cap,
            share: Share::default(),
            running: BTreeMap::new(),
            batch: BTreeSet::new(),
            backlog: VecDeque::new(),
            seen: BTreeMap::new(),
            peak_shared: 0,
            last_turn: BTreeMap::new(),
            starts: 0,
            proven: BTreeMap::new(),
            completions: 0,
        }
    }

    /// The same with another gateway share.
    pub fn with_share(mut self, share: Share) -> Self {
        self.share = share;
        self
    }

    /// Gateways active at `now` (and the memory of older ones dropped).
    fn active_gateways(&mut self, now: u64) -> usize {
        self.seen.retain(|_, t| now.saturating_sub(*t) <= GATEWAY_SEEN_MS);
        self.seen.len()
    }

    fn note_gateway(&mut self, gw: &NodeId, now: u64) {
        self.seen.insert(gw.clone(), now);
        if self.seen.len() > MAX_GATEWAYS {
            if let Some(oldest) = self.seen.iter().min_by_key(|(_, t)| **t).map(|(g, _)| g.clone())
            {
                self.seen.remove(&oldest);
            }
        }
    }

    /// Whether `gw` may take one more slot now: all of them while it is
    /// the only active gateway; otherwise its share, and for an unproven
    /// gateway also what the unproven pool has left.
    fn may_start(&mut self, gw: &NodeId, now: u64) -> bool {
        self.active_gateways(now);
        self.may_start_seen(gw)
    }

    /// [`Self::may_start`] against the gateways seen as of the last prune.
    fn may_start_seen(&self, gw: &NodeId) -> bool {
        let others = self.seen.keys().filter(|g| *g != gw).count();
        if others == 0 {
            return self.held(gw) < self.max;
        }
        let cap = self.share.of(self.max);
        self.held(gw) < cap && (self.is_proven(gw) || self.held_unproven() < cap)
    }

    /// Whether one more batch job may start: only while another slot
    /// stays free for interactive work (on a one-slot worker, only when it
    /// is idle, or batch work could never run there).
    fn batch_may_start(&self) -> bool {
        self.running.len() + 1 < self.max || (self.max == 1 && self.running.is_empty())
    }

    /// Whether `job` may take a slot as far as its class goes.
    fn class_may_start(&self, job: &ApiRequestJob) -> bool {
        Priority::of_job(job) == Priority::Interactive || self.batch_may_start()
    }

    fn is_proven(&self, gw: &NodeId) -> bool {
        self.proven.contains_key(gw)
    }

    fn held(&self, gw: &NodeId) -> usize {
        self.running.values().filter(|g| *g == gw).count()
    }

    fn held_unproven(&self) -> usize {
        self.running.values().filter(|g| !self.is_proven(g)).count()
    }

    fn waiting(&self, gw: &NodeId) -> usize {
        self.backlog.iter().filter(|j| &j.gateway_node_id == gw).count()
    }

    fn waiting_unproven(&self) -> usize {
        self.backlog.iter().filter(|j| !self.is_proven(&j.gateway_node_id)).count()
    }

    /// A job here completed (its gateway granted the lease and took the
    /// result): its gateway is proven and leaves the unproven pool. Call
    /// before [`Self::finished`].
    pub fn completed(&mut self, job_id: &str) {
        let Some(gw) = self.running.get(job_id).cloned() else { return };
        self.completions += 1;
        self.proven.insert(gw, self.completions);
        if self.proven.len() > MAX_PROVEN {
            if let Some(g) = self.proven.iter().min_by_key(|(_, n)| **n).map(|(g, _)| g.clone()) {
                self.proven.remove(&g);
            }
        }
    }

    /// Whether a job of `gw` has completed here (not in the unproven pool).
    pub fn proven(&self, gw: &NodeId) -> bool {
        self.is_proven(gw)
    }

    /// A job this worker can serve was announced at `now`.
    pub fn offer(&mut self, job: ApiRequestJob, now: u64) -> Offer {
        if self.running.contains_key(&job.job_id)
            || self.backlog.iter().any(|j| j.job_id == job.job_id)
        {
            return Offer::Duplicate;
        }
        let gw = job.gateway_node_id.clone();
        self.note_gateway(&gw, now);
        if self.running.len() >= self.max || !self.class_may_start(&job) || !self.may_start(&gw, now)
        {
            self.backlog_push(job, now);
            return Offer::Backlogged;
        }
        self.start(job, now)
    }

    fn start(&mut self, job: ApiRequestJob, now: u64) -> Offer {
        let gw = job.gateway_node_id.clone();
        self.running.insert(job.job_id.clone(), gw.clone());
        if Priority::of_job(&job) == Priority::Batch {
            self.batch.insert(job.job_id.clone());
        }
        self.starts += 1;
        self.last_turn.insert(gw.clone(), self.starts);
        self.last_turn.retain(|g, _| self.seen.contains_key(g));
        if self.active_gateways(now) > 1 {
            self.peak_shared = self.peak_shared.max(self.held(&gw));
        }
        Offer::Start(Box::new(job))
    }

    /// The gateway with the most waiting entries (of the unproven ones
    /// only, if `unproven`).
    fn most_waiting(&self, unproven: bool) -> Option<NodeId> {
        let mut count: BTreeMap<&NodeId, usize> = BTreeMap::new();
        for j in self.backlog.iter().filter(|j| !unproven || !self.is_proven(&j.gateway_node_id)) {
            *count.entry(&j.gateway_node_id).or_default() += 1;
        }
        count.into_iter().max_by_key(|(_, n)| *n).map(|(g, _)| g.clone())
    }

    /// Into the backlog; over its share a gateway loses its own oldest
    /// entry, over the unproven pool's share the unproven gateway waiting
    /// with the most loses its oldest, and a full backlog loses the oldest
    /// entry of the gateway that waits with the most.
    fn backlog_push(&mut self, job: ApiRequestJob, now: u64) {
        let gw = job.gateway_node_id.clone();
        let unproven = !self.is_proven(&gw);
        self.backlog.push_back(job);
        let shared = self.active_gateways(now) > 1;
        let cap = self.share.of(self.backlog_cap);
        let evict = if shared && self.waiting(&gw) > cap {
            Some(gw)
        } else if shared && unproven && self.waiting_unproven() > cap {
            self.most_waiting(true)
        } else if self.backlog.len() > self.backlog_cap {
            self.most_waiting(false)
        } else {
            None
        };
        if let Some(g) = evict {
            if let Some(i) = self.backlog.iter().position(|j| j.gateway_node_id == g) {
                self.backlog.remove(i);
            }
        }
    }

    /// A job ended here: its slot frees, and a backlog job that has not
    /// expired by `now_ms` leaves the backlog, to be offered again: of the
    /// gateways under their share, the one holding the fewest slots, then
    /// the one served least recently (gateways take turns: a flooder's
    /// older entries do not starve another gateway), then the oldest entry;
    /// interactive jobs before batch ones, which take the slot only if
    /// another stays free.
    pub fn finished(&mut self, job_id: &str, now_ms: u64) -> Option<ApiRequestJob> {
        self.running.remove(job_id)?;
        self.batch.remove(job_id);
        self.backlog.retain(|j| j.expires_at_ms > now_ms);
        self.active_gateways(now_ms);
        let mut best: Option<((bool, usize, u64, usize), usize)> = None;
        for (i, j) in self.backlog.iter().enumerate() {
            let gw = &j.gateway_node_id;
            if !self.may_start_seen(gw) || !self.class_may_start(j) {
                continue;
            }
            let batch = Priority::of_job(j) == Priority::Batch;
            let rank = (batch, self.held(gw), self.last_turn.get(gw).copied().unwrap_or(0), i);
            if best.is_none_or(|(b, _)| rank < b) {
                best = Some((rank, i));
            }
        }
        best.and_then(|(_, i)| self.backlog.remove(i))
    }

    /// Jobs running now.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Of them, batch jobs.
    pub fn running_batch(&self) -> usize {
        self.batch.len()
    }

    /// Jobs waiting.
    pub fn backlog_len(&self) -> usize {
        self.backlog.len()
    }

    /// Whether `job_id` runs here.
    pub fn is_running(&self, job_id: &str) -> bool {
        self.running.contains_key(job_id)
    }

    /// The most slots one gateway held at once while another gateway was
    /// active (what `--gateway-share` bounds).
    pub fn peak_shared(&self) -> usize {
        self.peak_shared
    }
}
