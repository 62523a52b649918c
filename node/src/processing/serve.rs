//! The processing queue over the job protocol (specs/batch.md, "Processing
//! on the network"): a lock holder fetches its subtask's input chunks from
//! the task's gateway and hands in its signed outputs, each request
//! carrying the lock delta it runs under. The gateway's side ([`fetch`],
//! [`deliver`]) merges that lock through the authority rows first (gossip
//! may not have carried it yet), then serves or accepts only what the lock
//! allows (`chunks::serve_chunk`, `chunks::accept_output`). The worker's
//! side is a [`ChunkSource`]: [`NetSource`] over direct streams, or
//! [`LocalSource`] when the task's gateway is this node (`--role all`).

use gcs_keyspace::{CrdtValue, Delta, Keyspace};
use gcs_protocol::{now_ms, NodeId, TaskLock};
use libp2p::PeerId;

use super::chunks::{self, ProcessingError, MAX_OUTPUT_BYTES};
use super::records::{self, Record};
use super::worker::ChunkSource;
use crate::jobs::wire::{
    ChunkFetch, JobRequest, JobResponse, OutputDelivery, MAX_LOCK_DELTA_BYTES,
    PROCESSING_WIRE_VERSION,
};
use crate::network::Network;
use crate::tenants::TenantTrust;

/// The lock a request carries: a processing lock delta, signed by the
/// peer that sent it (a node cannot ask under another's lock).
fn presented(peer: Option<PeerId>, bytes: &[u8]) -> Result<(Delta, TaskLock), ProcessingError> {
    if bytes.len() > MAX_LOCK_DELTA_BYTES {
        return Err(ProcessingError::TooLarge("a lock delta"));
    }
    let d = Delta::decode(bytes)?;
    if !matches!(d.value, CrdtValue::Register(_)) {
        return Err(ProcessingError::Mismatch("not a lock record"));
    }
    let Record::Lock(l) = records::validate(&d)? else {
        return Err(ProcessingError::Mismatch("not a lock record"));
    };
    if peer.is_some() && crate::jobs::peer_of(&l.node_id) != peer {
        return Err(ProcessingError::NotHolder);
    }
    Ok((d, l))
}

/// The gateway's answer to a chunk fetch from `peer`.
pub fn fetch(
    ks: &Keyspace,
    trust: &TenantTrust,
    peer: Option<PeerId>,
    f: &ChunkFetch,
    now: u64,
) -> Result<Vec<u8>, ProcessingError> {
    if f.version != PROCESSING_WIRE_VERSION {
        return Err(ProcessingError::Mismatch("unsupported processing request version"));
    }
    let (d, l) = presented(peer, &f.lock)?;
    chunks::present_lock(ks, d, trust, now)?;
    chunks::serve_chunk(ks, &l.node_id, &f.task_id, &f.chunk_id, now)
}

/// The gateway's answer to an output delivery from `peer`: kept only if
/// its signer is the peer's lock's holder (and `accept_output` takes it).
pub fn deliver(
    ks: &Keyspace,
    trust: &TenantTrust,
    peer: Option<PeerId>,
    o: &OutputDelivery,
    now: u64,
) -> Result<(), ProcessingError> {
    if o.version != PROCESSING_WIRE_VERSION {
        return Err(ProcessingError::Mismatch("unsupported processing request version"));
    }
    if o.output.len() > MAX_OUTPUT_BYTES + 4096 {
        return Err(ProcessingError::TooLarge("an output chunk"));
    }
    let (d, l) = presented(peer, &o.lock)?;
    chunks::present_lock(ks, d, trust, now)?;
    let out = chunks::accept_output(ks, &o.output, now)?;
    if out.node_id != l.node_id {
        return Err(ProcessingError::NotHolder);
    }
    Ok(())
}

/// [`fetch`] or [`deliver`] as a job-protocol answer.
pub fn answer(ks: &Keyspace, trust: &TenantTrust, peer: PeerId, req: &JobRequest) -> JobResponse {
    let now = now_ms();
    let r = match req {
        JobRequest::FetchChunk(f) => fetch(ks, trust, Some(peer), f, now).map(JobResponse::Chunk),
        JobRequest::DeliverOutput(o) => deliver(ks, trust, Some(peer), o, now).map(|_| JobResponse::Ack),
        JobRequest::MirrorPull(p) => {
            super::mirror::answer(ks, trust, Some(peer), p, now).map(|p| JobResponse::Mirror(Box::new(p)))
        }
        _ => return JobResponse::Refused("not a processing request".into()),
    };
    r.unwrap_or_else(|e| {
        tracing::debug!(%peer, error = %e, "processing request refused");
        JobResponse::Refused(e.to_string())
    })
}

/// A worker's way to its tasks' gateways over direct streams. Used from a
/// blocking thread (the processor is blocking): each request waits on the
/// runtime through `handle`.
#[allow(missing_debug_implementations)]
pub struct NetSource {
    /// The node's network.
    pub network: Network,
    /// The runtime the network lives on.
    pub handle: tokio::runtime::Handle,
    /// This node's keyspace, for a task whose gateway is this node.
    pub local: LocalSource,
}

fn ask(src: &NetSource, gateway: &NodeId, req: JobRequest) -> Result<JobResponse, ProcessingError> {
    let peer = crate::jobs::peer_of(gateway).ok_or(ProcessingError::Unknown)?;
    match src.handle.block_on(src.network.request(peer, req)) {
        Ok(JobResponse::Refused(r)) => Err(ProcessingError::GatewayRefused(r)),
        Ok(r) => Ok(r),
        Err(e) => Err(ProcessingError::Gateway(e.to_string())),
    }
}

impl ChunkSource for NetSource {
    fn fetch(
        &self,
        me: &NodeId,
        gateway: &NodeId,
        lock: &Delta,
        task_id: &str,
        chunk_id: &str,
    ) -> Result<Vec<u8>, ProcessingError> {
        if gateway == me {
            return self.local.fetch(me, gateway, lock, task_id, chunk_id);
        }
        let req = JobRequest::FetchChunk(Box::new(ChunkFetch {
            version: PROCESSING_WIRE_VERSION,
            lock: lock.encode(),
            task_id: task_id.into(),
            chunk_id: chunk_id.into(),
        }));
        match ask(self, gateway, req)? {
            JobResponse::Chunk(b) => Ok(b),
            _ => Err(ProcessingError::Gateway("an unexpected answer to a chunk fetch".into())),
        }
    }

    fn deliver(&self, gateway: &NodeId, lock: &Delta, output: Vec<u8>) -> Result<(), ProcessingError> {
        if gateway == &self.local.me {
            return self.local.deliver(gateway, lock, output);
        }
        let req = JobRequest::DeliverOutput(Box::new(OutputDelivery {
            version: PROCESSING_WIRE_VERSION,
            lock: lock.encode(),
            output,
        }));
        match ask(self, gateway, req)? {
            JobResponse::Ack => Ok(()),
            _ => Err(ProcessingError::Gateway("an unexpected answer to a delivery".into())),
        }
    }
}

/// The task's gateway is this node: the same checks, on the shared store.
#[allow(missing_debug_implementations)]
pub struct LocalSource {
    /// The node's store.
    pub ks: std::sync::Arc<Keyspace>,
    /// Its trust.
    pub trust: crate::tenants::TrustHandle,
    /// This node.
    pub me: NodeId,
}

impl ChunkSource for LocalSource {
    fn fetch(
        &self,
        _: &NodeId,
        _: &NodeId,
        lock: &Delta,
        task_id: &str,
        chunk_id: &str,
    ) -> Result<Vec<u8>, ProcessingError> {
        let f = ChunkFetch {
            version: PROCESSING_WIRE_VERSION,
            lock: lock.encode(),
            task_id: task_id.into(),
            chunk_id: chunk_id.into(),
        };
        fetch(&self.ks, &self.trust, None, &f, now_ms())
    }

    fn deliver(&self, _: &NodeId, lock: &Delta, output: Vec<u8>) -> Result<(), ProcessingError> {
        let o = OutputDelivery { version: PROCESSING_WIRE_VERSION, lock: lock.encode(), output };
        deliver(&self.ks, &self.trust, None, &o, now_ms())
    }
}
