//! The worker's admission: which announced jobs it starts now, which wait
//! in its backlog for a free slot, which it forgets.

use std::collections::{BTreeSet, VecDeque};

use gcs_protocol::ApiRequestJob;

/// Announced jobs a busy worker remembers; the oldest is forgotten first.
pub const BACKLOG: usize = 256;

/// What [`Slots::offer`] decided.
#[derive(Debug, PartialEq)]
pub enum Offer {
    /// A slot is reserved for the job: claim it now.
    Start(Box<ApiRequestJob>),
    /// Every slot is taken; the job waits in the backlog.
    Backlogged,
    /// The job already runs or waits here.
    Duplicate,
}

/// Slots and backlog of one worker. Sans-IO: time is passed in.
#[derive(Debug)]
pub struct Slots {
    max: usize,
    backlog_cap: usize,
    running: BTreeSet<String>,
    backlog: VecDeque<ApiRequestJob>,
}

impl Slots {
    /// `max` concurrent jobs and the default [`BACKLOG`].
    pub fn new(max: usize) -> Self {
        Self::with_backlog(max, BACKLOG)
    }

    /// `max` concurrent jobs and a backlog of `backlog_cap` jobs.
    pub fn with_backlog(max: usize, backlog_cap: usize) -> Self {
        Self { max, backlog_cap, running: BTreeSet::new(), backlog: VecDeque::new() }
    }

    /// A job this worker can serve was announced.
    pub fn offer(&mut self, job: ApiRequestJob) -> Offer {
        if self.running.contains(&job.job_id) || self.backlog.iter().any(|j| j.job_id == job.job_id)
        {
            return Offer::Duplicate;
        }
        if self.running.len() >= self.max {
            self.backlog.push_back(job);
            if self.backlog.len() > self.backlog_cap {
                self.backlog.pop_front();
            }
            return Offer::Backlogged;
        }
        self.running.insert(job.job_id.clone());
        Offer::Start(Box::new(job))
    }

    /// A job ended here: its slot frees, and the oldest backlog job that
    /// has not expired by `now_ms` leaves the backlog, to be offered again.
    pub fn finished(&mut self, job_id: &str, now_ms: u64) -> Option<ApiRequestJob> {
        if !self.running.remove(job_id) {
            return None;
        }
        std::iter::from_fn(|| self.backlog.pop_front()).find(|j| j.expires_at_ms > now_ms)
    }

    /// Jobs running now.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Jobs waiting.
    pub fn backlog_len(&self) -> usize {
        self.backlog.len()
    }

    /// Whether `job_id` runs here.
    pub fn is_running(&self, job_id: &str) -> bool {
        self.running.contains(job_id)
    }
}
