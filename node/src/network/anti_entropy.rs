//! Anti-entropy, kept off the swarm loop: the loop only forwards requests
//! and answers (request-response keeps its channels); building a request
//! (digests), answering one (a RocksDB iterator from `after`) and merging a
//! page run on blocking tasks, which report back over a bounded channel.
//!
//! Bounds (specs/network.md, "Anti-entropy limits"): a request's tenants
//! are deduplicated and capped; a peer gets at most
//! [`REQUESTS_PER_INTERVAL`] answers per interval and the node builds at
//! most [`MAX_ANSWERS_IN_FLIGHT`] at once (beyond either: "busy"); a round
//! follows at most [`MAX_PAGES_PER_ROUND`] pages and resumes where it
//! stopped next round; a round starts at most once per peer per interval
//! (a reconnecting peer does not trigger one per connection); an answer
//! is at most [`RESPONSE_MAX_BYTES`] on the wire; its deltas go through the
//! sender's quota like gossip.

use std::collections::HashMap;

use gcs_protocol::now_ms;
use libp2p::request_response::{self, OutboundRequestId, ResponseChannel};
use libp2p::PeerId;
use tokio::sync::{mpsc, oneshot};

use super::intake::NetStats;
use super::EventLoop;
use crate::error::NodeError;
use crate::replication::{self, DigestRequest, DigestResponse};

/// Tenants one request may name (after deduplication).
pub const MAX_TENANTS: usize = 64;
/// Digests and resume points one request may carry.
pub const MAX_DIGESTS: usize = 64;
pub use super::rounds::MAX_PAGES_PER_ROUND;
use super::cursors::Cursors;
use super::rounds::{Next, Rounds};
/// Answers one peer gets per anti-entropy interval: two rounds' pages.
pub const REQUESTS_PER_INTERVAL: u32 = 2 * (MAX_PAGES_PER_ROUND + 1);
/// Answers built at once, for all peers together.
pub const MAX_ANSWERS_IN_FLIGHT: usize = 4;
/// Rounds this node runs at once.
pub const MAX_ROUNDS_IN_FLIGHT: usize = 8;
/// A request on the wire at most (digests of every namespace and
/// [`MAX_TENANTS`] tenants fit many times over).
pub const REQUEST_MAX_BYTES: u64 = 256 << 10;
/// An answer on the wire at most: the answer budget plus one record.
pub const RESPONSE_MAX_BYTES: u64 = (replication::RESPONSE_BUDGET as u64) + (2 << 20);
// A full page and one record fit; the bound is below the codec's own 10 MiB.
const _: () = assert!(RESPONSE_MAX_BYTES as usize > replication::RESPONSE_BUDGET + (1 << 20));
const _: () = assert!(RESPONSE_MAX_BYTES < 10 << 20);

/// Per-peer cursors kept at most (a peer's cursor is its log position).
const MAX_CURSORS: usize = 4096;

/// What a blocking task reports back to the loop.
#[derive(Debug)]
pub(super) enum Done {
    /// An answer to send on the inbound request `id`.
    Answer { id: u64, response: DigestResponse },
    /// A request to send to `peer` (None: the digests could not be read),
    /// built under cursor generation `generation`.
    Built { peer: PeerId, request: Option<DigestRequest>, generation: u64 },
    /// A page from `peer` was merged.
    Merged {
        peer: PeerId,
        generation: u64,
        last_seq: Option<u64>,
        resume: Vec<(String, String)>,
        more: bool,
        over_quota: bool,
    },
}

/// The loop's anti-entropy state.
pub(super) struct AntiEntropy {
    pub(super) done_tx: mpsc::Sender<Done>,
    pub(super) done_rx: mpsc::Receiver<Done>,
    answering: usize,
    next_answer: u64,
    channels: HashMap<u64, ResponseChannel<DigestResponse>>,
    rounds: Rounds<PeerId>,
    /// Our rounds' requests in flight: the peer, and the cursor generation
    /// the request was built under.
    outbound: HashMap<OutboundRequestId, (PeerId, u64)>,
    /// Per peer: its delta-log position we have everything up to.
    cursors: Cursors<PeerId>,
    requests: crate::quota::RateLimit<PeerId>,
    round_robin: usize,
    /// Requests sent as given by [`super::Network::anti_entropy_request`].
    pub(super) raw: HashMap<OutboundRequestId, oneshot::Sender<Result<DigestResponse, NodeError>>>,
}

impl AntiEntropy {
    pub(super) fn new(interval: std::time::Duration) -> Self {
        let interval_ms = (interval.as_millis() as u64).max(1);
        let (done_tx, done_rx) = mpsc::channel(MAX_ANSWERS_IN_FLIGHT + MAX_ROUNDS_IN_FLIGHT + 4);
        Self {
            done_tx,
            done_rx,
            answering: 0,
            next_answer: 0,
            channels: HashMap::new(),
            rounds: Rounds::new(interval_ms, MAX_ROUNDS_IN_FLIGHT, MAX_CURSORS),
            outbound: HashMap::new(),
            cursors: Cursors::new(MAX_CURSORS),
            requests: crate::quota::RateLimit::new(REQUESTS_PER_INTERVAL, interval_ms),
            round_robin: 0,
            raw: HashMap::new(),
        }
    }

    /// Drops every peer's cursor: the next round with each compares
    /// digests in full. Rounds already under way keep their pages but not
    /// their cursors.
    pub(super) fn reset_cursors(&mut self) {
        self.cursors.reset();
    }

    /// Forgets a disconnected peer's rounds and rate (its cursor stays, so
    /// a reconnect pulls only what changed, up to [`MAX_CURSORS`] peers).
    pub(super) fn forget(&mut self, peer: &PeerId) {
        self.rounds.forget(peer);
        self.requests.forget(peer);
        self.cursors.forget(peer);
    }
}

/// A peer's request, bounded: tenants deduplicated (first kept) and capped,
/// digests and resume points deduplicated by namespace and capped.
pub fn sanitize(mut req: DigestRequest) -> DigestRequest {
    fn dedupe<T>(v: &mut Vec<T>, cap: usize, name: impl Fn(&T) -> &str) {
        let mut seen = std::collections::HashSet::new();
        v.retain(|t| seen.len() < cap && seen.insert(name(t).to_string()));
    }
    dedupe(&mut req.tenants, MAX_TENANTS, |t| t.0.as_str());
    dedupe(&mut req.digests, MAX_DIGESTS, |d| d.0.as_str());
    dedupe(&mut req.after, MAX_DIGESTS, |a| a.0.as_str());
    req
}

impl EventLoop {
    /// A round with `peer`, unless one runs, one ran within the interval,
    /// or [`MAX_ROUNDS_IN_FLIGHT`] run.
    pub(super) fn start_round(&mut self, peer: PeerId) {
        let Some(after) = self.ae.rounds.start(&peer, now_ms()) else { return };
        NetStats::bump(&self.stats.ae_rounds);
        self.build_request(peer, after);
    }

    /// One interval tick: a round with the next connected peer.
    pub(super) fn anti_entropy_round(&mut self) {
        let peers: Vec<PeerId> = self.swarm.connected_peers().copied().collect();
        if peers.is_empty() {
            return;
        }
        self.ae.round_robin = self.ae.round_robin.wrapping_add(1);
        self.start_round(peers[self.ae.round_robin % peers.len()]);
    }

    /// The round failed (an error, a busy answer): the cursor stays.
    fn end_round(&mut self, peer: &PeerId) {
        self.ae.rounds.end(peer);
        self.ae.cursors.end(peer, false);
    }

    /// Builds the digests on a blocking task; the loop sends the request.
    fn build_request(&mut self, peer: PeerId, after: Vec<(String, String)>) {
        let ks = self.keyspace.clone();
        let served = self.served_tenants.clone();
        let since = self.ae.cursors.since(&peer);
        let (tx, generation) = (self.ae.done_tx.clone(), self.ae.cursors.generation());
        tokio::task::spawn_blocking(move || {
            let request = match replication::digest_request(&ks, &served) {
                Ok(mut r) => {
                    r.since = since;
                    r.after = after;
                    Some(r)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot compute keyspace digests");
                    None
                }
            };
            let _ = tx.blocking_send(Done::Built { peer, request, generation });
        });
    }

    pub(super) fn on_done(&mut self, done: Done) {
        match done {
            Done::Answer { id, response } => {
                self.ae.answering = self.ae.answering.saturating_sub(1);
                if let Some(ch) = self.ae.channels.remove(&id) {
                    let _ = self.swarm.behaviour_mut().anti_entropy.send_response(ch, response);
                }
            }
            Done::Built { peer, request: Some(req), generation }
                if self.ae.rounds.is_active(&peer) =>
            {
                let id = self.swarm.behaviour_mut().anti_entropy.send_request(&peer, req);
                self.ae.outbound.insert(id, (peer, generation));
            }
            Done::Built { peer, .. } => self.end_round(&peer),
            Done::Merged { peer, generation, last_seq, resume, more, over_quota } => {
                self.ae.cursors.page(&peer, generation, last_seq);
                match self.ae.rounds.page(&peer, more, over_quota, resume) {
                    Next::Ask(resume) => self.build_request(peer, resume),
                    // The next round resumes the snapshot pages where this
                    // one stopped (a log round has none: it asks from here).
                    Next::Capped => {
                        NetStats::bump(&self.stats.ae_rounds_capped);
                        self.ae.cursors.end(&peer, true);
                    }
                    // Cut short by the quota, or more was left when the
                    // round ended (the peer went away): not all was taken.
                    Next::Done => self.ae.cursors.end(&peer, !over_quota && !more),
                }
            }
        }
    }

    pub(super) fn on_anti_entropy(
        &mut self,
        ev: request_response::Event<DigestRequest, DigestResponse>,
    ) {
        use request_response::{Event, Message as RrMessage};
        match ev {
            Event::Message { peer, message: RrMessage::Request { request, channel, .. }, .. } => {
                let ae = &mut self.ae;
                if !ae.requests.allow(&peer, now_ms()) || ae.answering >= MAX_ANSWERS_IN_FLIGHT {
                    NetStats::bump(&self.stats.ae_busy);
                    let busy = DigestResponse::busy();
                    let _ = self.swarm.behaviour_mut().anti_entropy.send_response(channel, busy);
                    return;
                }
                NetStats::bump(&self.stats.ae_answered);
                let id = ae.next_answer;
                ae.next_answer = ae.next_answer.wrapping_add(1);
                ae.channels.insert(id, channel);
                ae.answering += 1;
                let (ks, served, tx) =
                    (self.keyspace.clone(), self.served_tenants.clone(), ae.done_tx.clone());
                let request = sanitize(request);
                tokio::task::spawn_blocking(move || {
                    let response = replication::answer(&ks, &request, &served).unwrap_or_else(|e| {
                        tracing::warn!(%peer, error = %e, "cannot answer anti-entropy");
                        DigestResponse::busy()
                    });
                    let _ = tx.blocking_send(Done::Answer { id, response });
                });
            }
            Event::Message { peer, message: RrMessage::Response { request_id, response }, .. } => {
                if let Some(reply) = self.ae.raw.remove(&request_id) {
                    let _ = reply.send(Ok(response));
                    return;
                }
                let generation = match self.ae.outbound.remove(&request_id) {
                    Some((_, generation)) if !response.busy => generation,
                    _ => {
                        self.end_round(&peer);
                        return;
                    }
                };
                self.merge_page(peer, generation, response);
            }
            Event::OutboundFailure { peer, request_id, error, .. } => {
                tracing::debug!(%peer, %error, "anti-entropy request failed");
                if let Some(reply) = self.ae.raw.remove(&request_id) {
                    let reason = error.to_string();
                    let _ = reply.send(Err(NodeError::Request { peer: peer.to_string(), reason }));
                    return;
                }
                self.ae.outbound.remove(&request_id);
                self.end_round(&peer);
            }
            Event::InboundFailure { .. } | Event::ResponseSent { .. } => {}
        }
    }

    /// Merges a page on a blocking task, through the peer's quota.
    fn merge_page(&mut self, peer: PeerId, generation: u64, response: DigestResponse) {
        let intake = self.intake.clone();
        let served = self.served_tenants.clone();
        let tx = self.ae.done_tx.clone();
        tokio::task::spawn_blocking(move || {
            let (mut changed, mut refused, mut over_quota) = (0usize, 0usize, false);
            // Which namespaces a round had to repair (the log says where
            // gossip falls short).
            let mut by_ns: std::collections::BTreeMap<&'static str, usize> = Default::default();
            for d in &response.deltas {
                match intake.merge(&peer, d, &served, now_ms()) {
                    Ok(gcs_keyspace::MergeOutcome::Changed(_)) => {
                        changed += 1;
                        let ns = gcs_keyspace::Delta::decode(d)
                            .ok()
                            .and_then(|x| gcs_keyspace::Namespace::of_key(&x.key).ok())
                            .map_or("?", |n| n.cf());
                        *by_ns.entry(ns).or_default() += 1;
                    }
                    Ok(_) => {}
                    Err(super::intake::Refused::Quota(e)) => {
                        // The rest of the page would be refused too.
                        tracing::info!(%peer, error = %e, "anti-entropy page over the peer's quota");
                        over_quota = true;
                        break;
                    }
                    Err(_) => refused += 1,
                }
            }
            if changed > 0 || refused > 0 {
                tracing::info!(%peer, changed, refused, namespaces = ?by_ns, "anti-entropy merged");
            }
            let more = !response.resume.is_empty() || !response.truncated.is_empty();
            let done = Done::Merged {
                peer,
                generation,
                last_seq: response.last_seq,
                resume: response.resume,
                more,
                over_quota,
            };
            let _ = tx.blocking_send(done);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_deduplicated_and_capped() {
        let mut req = DigestRequest {
            version: 1,
            digests: vec![("api.jobs".into(), vec![1], 1); 500],
            tenants: (0..5000).map(|i| (format!("t{}", i % 3), vec![], 0)).collect(),
            since: None,
            after: vec![("api.jobs".into(), "k".into()); 100],
        };
        req.tenants.extend((0..1000).map(|i| (format!("u{i}"), vec![], 0)));
        let req = sanitize(req);
        assert_eq!(req.digests.len(), 1);
        assert_eq!(req.after.len(), 1);
        assert_eq!(req.tenants.len(), MAX_TENANTS);
        assert_eq!(&req.tenants[..3].iter().map(|t| t.0.as_str()).collect::<Vec<_>>(), &["t0", "t1", "t2"]);
    }

    /// The page bytes accepted from a responder: an answer over the bound
    /// is refused by the codec as it is read, whatever the responder sends.
    #[tokio::test]
    async fn an_answer_over_the_wire_bound_is_refused_as_it_is_read() {
        use libp2p::request_response::{cbor::codec::Codec, Codec as _};
        let proto = libp2p::StreamProtocol::new("/gcs/anti-entropy/1.0.0");
        let ours = || {
            Codec::<DigestRequest, DigestResponse>::default()
                .set_request_size_maximum(REQUEST_MAX_BYTES)
                .set_response_size_maximum(RESPONSE_MAX_BYTES)
        };
        let encode = |resp: DigestResponse| async move {
            let mut buf = vec![];
            let mut w = Codec::<DigestRequest, DigestResponse>::default();
            let proto = libp2p::StreamProtocol::new("/gcs/anti-entropy/1.0.0");
            w.write_response(&proto, &mut futures::io::Cursor::new(&mut buf), resp).await.unwrap();
            buf
        };
        let huge = DigestResponse { deltas: vec![vec![7u8; 1 << 20]; 7], ..DigestResponse::busy() };
        let buf = encode(huge).await;
        assert!(buf.len() as u64 > RESPONSE_MAX_BYTES);
        let read = ours().read_response(&proto, &mut futures::io::Cursor::new(&buf)).await;
        assert!(read.is_err(), "a 7 MiB answer is refused");
        let page = DigestResponse { deltas: vec![vec![7u8; 1 << 20]; 4], ..DigestResponse::busy() };
        let buf = encode(page).await;
        let read = ours().read_response(&proto, &mut futures::io::Cursor::new(&buf)).await;
        assert_eq!(read.unwrap().deltas.len(), 4, "a full page fits");
    }
}
