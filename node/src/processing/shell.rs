//! A worker's processing slots, driven by the running node (specs/batch.md,
//! "Processing on the network"): up to `slots` subtasks at once, each one
//! [`Processor::step`] on a blocking thread (the executor blocks), its
//! lock, renewals and result published on the keyspace delta topic as soon
//! as they are stored. Separate from the interactive slots: a processing
//! subtask runs at batch priority in the engine, so interactive jobs keep
//! the worker. At shutdown the running steps are cancelled: each stops
//! between requests and releases its lock, so another worker takes the
//! subtask at once.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gcs_keyspace::{Delta, Keyspace};
use gcs_protocol::{now_ms, NodeKey};
use tokio::sync::{mpsc, Notify};

use super::serve::{LocalSource, NetSource};
use super::worker::Processor;
use crate::jobs::executor::Executor;
use crate::network::Network;
use crate::tenants::TrustHandle;
use crate::topics;

/// How often an idle worker looks for open subtasks.
pub const POLL: Duration = Duration::from_millis(500);
/// Deltas waiting to be gossiped (a step stores each before handing it on).
const PUBLISH_QUEUE: usize = 64;

/// What a worker's registration advertises of its processing slots.
#[derive(Clone, Debug, Default)]
pub struct Slots {
    max: usize,
    running: Arc<AtomicUsize>,
    done: Arc<AtomicU64>,
}

impl Slots {
    /// Slots configured (`max_concurrent_processing_jobs`).
    pub fn max(&self) -> usize {
        self.max
    }
    /// Subtasks running now (`current_processing_jobs`).
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }
    /// Subtasks finished here since start.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }
}

/// What the shell needs from the node.
#[allow(missing_debug_implementations)]
pub struct Parts {
    /// Slots (≥ 1; 0 starts no shell).
    pub slots: usize,
    /// Lease of each lock.
    pub lease_ms: u64,
    /// The node's store.
    pub ks: Arc<Keyspace>,
    /// The node's key.
    pub key: Arc<NodeKey>,
    /// Which gateways tenants admitted.
    pub trust: TrustHandle,
    /// The engine.
    pub executor: Arc<dyn Executor>,
    /// Model ids and aliases served here.
    pub models: Vec<String>,
    /// The network.
    pub network: Network,
    /// Subtasks the slots pass over for now (shared by the slots).
    pub avoid: super::worker::Avoid,
    /// Gateways that could not be reached, asked last for now.
    pub unreachable: super::worker::Avoid,
}

/// The running shell.
#[derive(Debug)]
pub struct Shell {
    /// What registrations advertise.
    pub slots: Slots,
    stop: Arc<AtomicBool>,
    wake: Arc<Notify>,
}

impl Shell {
    /// Stops taking subtasks and cancels the running ones (each releases
    /// its lock).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.wake.notify_one();
    }
}

/// Starts the shell on the current runtime.
pub fn start(p: Parts) -> Shell {
    let slots = Slots { max: p.slots, ..Default::default() };
    let stop = Arc::new(AtomicBool::new(false));
    let wake = Arc::new(Notify::new());
    let shell = Shell { slots: slots.clone(), stop: stop.clone(), wake: wake.clone() };
    let (tx, mut rx) = mpsc::channel::<Delta>(PUBLISH_QUEUE);
    let net = p.network.clone();
    tokio::spawn(async move {
        while let Some(d) = rx.recv().await {
            if let Err(e) = net.publish(topics::KEYSPACE_DELTAS, d.encode()).await {
                // No peer yet: anti-entropy carries the record later.
                tracing::debug!(error = %e, "processing record not gossiped");
            }
        }
    });
    let p = Arc::new(p);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(POLL);
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = wake.notified() => {}
            }
            if stop.load(Ordering::Relaxed) {
                break;
            }
            // One new step per wake-up: two grabs racing for the same
            // subtask on one node would only refuse each other.
            if slots.running() >= slots.max {
                continue;
            }
            slots.running.fetch_add(1, Ordering::Relaxed);
            let (p, slots, stop, wake, tx) =
                (p.clone(), slots.clone(), stop.clone(), wake.clone(), tx.clone());
            let handle = tokio::runtime::Handle::current();
            tokio::task::spawn_blocking(move || {
                let r = step(&p, handle, &stop, &tx);
                slots.running.fetch_sub(1, Ordering::Relaxed);
                match r {
                    Ok(Some(done)) => {
                        slots.done.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(subtask = %done.task_key, lines = done.lines, "processing subtask done");
                        // Look for the next at once.
                        wake.notify_one();
                    }
                    Ok(None) => {}
                    Err(e) => tracing::info!(error = %e, "processing step abandoned"),
                }
            });
        }
        tracing::debug!("processing shell stopped");
    });
    shell
}

fn step(
    p: &Parts,
    handle: tokio::runtime::Handle,
    stop: &AtomicBool,
    tx: &mpsc::Sender<Delta>,
) -> Result<Option<super::worker::Done>, super::chunks::ProcessingError> {
    let me = p.key.node_id();
    let src = NetSource {
        network: p.network.clone(),
        handle,
        local: LocalSource { ks: p.ks.clone(), trust: p.trust.clone(), me },
    };
    let proc = Processor {
        ks: &p.ks,
        key: &p.key,
        trust: &p.trust,
        executor: &*p.executor,
        models: &p.models,
        lease_ms: p.lease_ms,
        avoid: &p.avoid,
        unreachable: &p.unreachable,
    };
    let clock = now_ms;
    let mut publish = |d: Delta| {
        // Stored already: a stopped publisher only leaves it to anti-entropy.
        let _ = tx.blocking_send(d);
    };
    proc.step(&src, stop, &clock, &mut publish)
}
