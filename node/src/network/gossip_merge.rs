//! Gossiped keyspace deltas are merged off the swarm loop: a merge reads
//! and writes RocksDB (and may fsync), so a flood of valid deltas merged on
//! the loop would delay every command and direct request behind it. The
//! loop hands each delta to one worker thread over a bounded queue and
//! never waits for it: when the queue is full the delta is dropped, counted
//! and reported `Ignore` (gossip is lossy by design; anti-entropy repairs
//! what was dropped, and the sender is not penalised for our backlog). The
//! worker reports each verdict back over a bounded channel the loop drains,
//! and the loop then tells gossipsub whether to forward the message.

use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};

use gcs_protocol::now_ms;
use libp2p::gossipsub::{MessageAcceptance, MessageId};
use libp2p::PeerId;
use tokio::sync::mpsc;

use super::intake::{Intake, NetStats, Refused};

/// Deltas waiting for the worker at most; beyond it they are dropped.
pub const MERGE_QUEUE: usize = 1024;

/// One gossiped delta to merge.
#[derive(Debug)]
pub(super) struct Job {
    /// The gossip message id (for the validation report).
    pub id: MessageId,
    /// The peer that forwarded it.
    pub source: PeerId,
    /// Its author (the quota is the author's).
    pub author: PeerId,
    /// The encoded delta.
    pub data: Vec<u8>,
    /// The tenant whose usage topic it came on (already checked to be one
    /// this node serves); empty for the global deltas topic.
    pub served: Vec<String>,
}

/// The worker's verdict on one delta.
#[derive(Debug)]
pub(super) struct Verdict {
    pub id: MessageId,
    pub source: PeerId,
    pub acceptance: MessageAcceptance,
}

/// The loop's end of the merge worker.
pub(super) struct GossipMerge {
    jobs: Option<SyncSender<Job>>,
    pub(super) verdicts: mpsc::Receiver<Verdict>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// How a merge result becomes a gossip verdict: penalised when the author
/// sent a refused delta itself; a relay of it (or a clock off by more than
/// the skew) is only dropped.
pub(super) fn acceptance(
    r: &Result<(), &Refused>,
    author: &PeerId,
    source: &PeerId,
) -> MessageAcceptance {
    match r {
        Ok(()) => MessageAcceptance::Accept,
        Err(Refused::Quota(_)) if author == source => MessageAcceptance::Reject,
        Err(Refused::Quota(_) | Refused::Clock(_)) => MessageAcceptance::Ignore,
        // Replicas race (a lock on a subtask finished a moment ago): not
        // forwarded, and no one's score pays for it.
        Err(Refused::Delta(crate::error::RefusedDelta::Stale(_))) => MessageAcceptance::Ignore,
        Err(Refused::Delta(_)) => MessageAcceptance::Reject,
    }
}

impl GossipMerge {
    /// Starts the worker thread merging through `intake`.
    pub(super) fn start(intake: Intake) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel::<Job>(MERGE_QUEUE);
        let (vtx, vrx) = mpsc::channel(MERGE_QUEUE);
        let thread =
            std::thread::Builder::new().name("gcs-gossip-merge".into()).spawn(move || {
                // Ends when the loop drops its sender (shutdown) or stops
                // reading verdicts.
                while let Ok(job) = rx.recv() {
                    let r = intake.merge(&job.author, &job.data, &job.served, now_ms());
                    if let Err(e) = &r {
                        tracing::debug!(source = %job.source, error = %e, "refused keyspace delta");
                    }
                    let acceptance = acceptance(&r.as_ref().map(drop), &job.author, &job.source);
                    let v = Verdict { id: job.id, source: job.source, acceptance };
                    if vtx.blocking_send(v).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Self { jobs: Some(tx), verdicts: vrx, thread: Some(thread) })
    }

    /// Queues a delta; false (counted as shed) when the queue is full or
    /// the worker is gone.
    pub(super) fn offer(&self, job: Job, stats: &NetStats) -> bool {
        let queued = self.jobs.as_ref().is_some_and(|tx| match tx.try_send(job) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
        });
        if queued {
            NetStats::bump(&stats.gossip_merges_queued);
        } else {
            let n = stats.gossip_merges_shed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if n.is_power_of_two() {
                tracing::warn!(shed = n + 1, "gossip merge queue full: deltas dropped");
            }
        }
        queued
    }

    /// Stops the worker and waits until it has finished its delta and
    /// released the keyspace (a restart in the same process reopens it).
    pub(super) fn stop(&mut self) -> Option<std::thread::JoinHandle<()>> {
        self.jobs = None;
        self.verdicts.close();
        // Verdicts already sent are dropped with the receiver; a worker
        // blocked on a full verdict channel sees it closed.
        while self.verdicts.try_recv().is_ok() {}
        self.thread.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::{PeerQuotas, QuotaConfig};
    use gcs_keyspace::Keyspace;
    use std::sync::{Arc, Mutex};

    fn intake(dir: &tempfile::TempDir) -> Intake {
        let ks = Keyspace::open(dir.path(), "me", Default::default()).unwrap();
        Intake {
            keyspace: Arc::new(ks),
            quotas: Arc::new(Mutex::new(PeerQuotas::new(QuotaConfig::default()))),
            stats: Arc::default(),
            trust: Arc::default(),
        }
    }

    fn job(data: Vec<u8>, peer: PeerId) -> Job {
        Job { id: MessageId::from(data.clone()), source: peer, author: peer, data, served: vec![] }
    }

    #[tokio::test]
    async fn the_worker_merges_and_reports_each_delta() {
        let dir = tempfile::tempdir().unwrap();
        let i = intake(&dir);
        let ks = i.keyspace.clone();
        let stats = i.stats.clone();
        let mut m = GossipMerge::start(i).unwrap();
        let peer_dir = tempfile::tempdir().unwrap();
        let peer = Keyspace::open(peer_dir.path(), "peer", Default::default()).unwrap();
        let d = peer.put(&gcs_keyspace::keys::lease("j1"), b"x".to_vec(), now_ms()).unwrap();
        let p = PeerId::random();
        assert!(m.offer(job(d.encode(), p), &stats));
        assert!(m.offer(job(vec![1, 2, 3], p), &stats));
        let first = m.verdicts.recv().await.unwrap();
        let second = m.verdicts.recv().await.unwrap();
        assert!(matches!(first.acceptance, MessageAcceptance::Reject), "not a signed lease");
        assert!(matches!(second.acceptance, MessageAcceptance::Reject), "undecodable");
        assert!(ks.get(&gcs_keyspace::keys::lease("j1")).unwrap().is_none());
        assert_eq!(stats.gossip_merges_queued.load(std::sync::atomic::Ordering::Relaxed), 2);
        let h = m.stop().unwrap();
        h.join().unwrap();
        drop(ks);
        // The worker released the keyspace: it opens again.
        drop(stats);
        assert!(Keyspace::open(dir.path(), "me", Default::default()).is_ok());
    }

    #[test]
    fn a_full_queue_drops_and_counts_without_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let i = intake(&dir);
        let stats = i.stats.clone();
        // A worker that never runs: the queue is all there is.
        let (tx, _rx) = sync_channel::<Job>(MERGE_QUEUE);
        let (_vtx, vrx) = mpsc::channel(1);
        let m = GossipMerge { jobs: Some(tx), verdicts: vrx, thread: None };
        let p = PeerId::random();
        let t = std::time::Instant::now();
        let shed = (0..MERGE_QUEUE + 100)
            .filter(|n| !m.offer(job(n.to_le_bytes().to_vec(), p), &stats))
            .count();
        assert_eq!(shed, 100);
        assert!(t.elapsed() < std::time::Duration::from_secs(1), "never blocks");
        assert_eq!(stats.gossip_merges_shed.load(std::sync::atomic::Ordering::Relaxed), 100);
        drop(i);
    }

    #[test]
    fn refusals_become_the_verdicts_gossipsub_needs() {
        use crate::quota::QuotaExceeded;
        let (a, b) = (PeerId::random(), PeerId::random());
        let quota = Refused::Quota(QuotaExceeded::Bytes(1));
        assert!(matches!(acceptance(&Ok(()), &a, &b), MessageAcceptance::Accept));
        assert!(
            matches!(acceptance(&Err(&quota), &a, &a), MessageAcceptance::Reject),
            "the author itself"
        );
        assert!(
            matches!(acceptance(&Err(&quota), &a, &b), MessageAcceptance::Ignore),
            "an honest relay"
        );
        let clock = Refused::Clock("ahead".into());
        assert!(matches!(acceptance(&Err(&clock), &a, &a), MessageAcceptance::Ignore));
        // A processing record the replica's queue state refuses: replicas
        // race, so neither its author nor a relay is penalised; a forged
        // or misfiled record still is.
        let why = gcs_protocol::ProtocolError::Field { field: "lock", reason: "done".into() };
        let stale = Refused::Delta(crate::error::RefusedDelta::Stale(why));
        assert!(matches!(acceptance(&Err(&stale), &a, &a), MessageAcceptance::Ignore));
        assert!(matches!(acceptance(&Err(&stale), &a, &b), MessageAcceptance::Ignore));
        let forged = Refused::Delta(crate::error::RefusedDelta::NotTheAuthor("processing.locks"));
        assert!(matches!(acceptance(&Err(&forged), &a, &b), MessageAcceptance::Reject));
    }
}
