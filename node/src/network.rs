//! The libp2p side of a node: one event loop owns the swarm; the rest of the
//! node talks to it through a small cloneable handle (commands with one-shot
//! replies) and a bounded event stream — the shape of rust-libp2p's
//! file-sharing example.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gcs_keyspace::Keyspace;
use gcs_protocol::{Limits, Message};
use libp2p::request_response;
use libp2p::swarm::SwarmEvent;
use libp2p::{multiaddr::Protocol, Multiaddr, PeerId, Swarm};
use tokio::sync::{mpsc, oneshot};

use crate::error::NodeError;
use crate::identity::Identity;
use crate::jobs::wire::{JobRequest, JobResponse};
use crate::quota::{PeerQuotas, QuotaConfig};
use crate::replication::{DigestRequest, DigestResponse};

mod anti_entropy;
mod dispatch;
mod gossip_merge;
pub mod intake;
mod rounds;
mod cursors;
mod swarm;

use swarm::{build_swarm, check_port_free, Behaviour};

pub use anti_entropy::{MAX_PAGES_PER_ROUND, MAX_TENANTS, REQUESTS_PER_INTERVAL};
pub use gossip_merge::MERGE_QUEUE;
pub use crate::replication::{DigestRequest as AntiEntropyRequest, DigestResponse as AntiEntropyAnswer};
pub use intake::NetStats;

/// Identify / kad protocol name.
pub const PROTOCOL_NAME: &str = "/gcs/1.0.0";
/// Bound of the command and event channels.
const CHANNEL_BOUND: usize = 1024;

/// The answer to a direct request the runtime has no room for.
pub const BUSY: &str = "busy";

/// Network settings.
#[derive(Clone, Debug)]
pub struct NetworkConfig {
    /// Listen addresses.
    pub listen: Vec<Multiaddr>,
    /// Peers to dial at start (with or without `/p2p/<id>`).
    pub bootstrap: Vec<Multiaddr>,
    /// mDNS discovery on the LAN.
    pub mdns: bool,
    /// Envelope validation bounds.
    pub limits: Limits,
    /// Gossipsub heartbeat.
    pub gossip_heartbeat: Duration,
    /// How often to run anti-entropy with one connected peer.
    pub anti_entropy_interval: Duration,
    /// Tenants whose gateway this node is: it takes their usage records
    /// (tenant-gateway replication scope) and no one else's.
    pub served_tenants: Vec<String>,
    /// The tenant and swarm keys this node trusts (usage records from peers
    /// count only when signed by a gateway one of them admitted).
    pub tenant_trust: crate::tenants::TrustHandle,
    /// Bytes and keys a peer's deltas may add per window.
    pub quota: QuotaConfig,
    /// libp2p connection limits.
    pub connections: ConnectionCaps,
}

/// Connection limits (`libp2p::connection_limits`): a peer cannot hold
/// more than a few connections, nor the node more than it can serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionCaps {
    /// Established connections per peer.
    pub per_peer: u32,
    /// Established connections in all.
    pub established: u32,
    /// Incoming connections still handshaking.
    pub pending_incoming: u32,
    /// Outgoing connections still handshaking.
    pub pending_outgoing: u32,
}

impl Default for ConnectionCaps {
    fn default() -> Self {
        Self { per_peer: 4, established: 512, pending_incoming: 64, pending_outgoing: 64 }
    }
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            listen: vec!["/ip4/0.0.0.0/tcp/0".parse().unwrap_or_else(|_| Multiaddr::empty())],
            bootstrap: vec![],
            mdns: true,
            limits: Limits::default(),
            gossip_heartbeat: Duration::from_millis(700),
            anti_entropy_interval: Duration::from_secs(10),
            served_tenants: vec![],
            tenant_trust: Default::default(),
            quota: QuotaConfig::default(),
            connections: ConnectionCaps::default(),
        }
    }
}

/// What the network tells the node.
#[derive(Debug, Clone)]
pub enum NetEvent {
    /// A gossip message that passed validation.
    Message {
        /// Topic.
        topic: String,
        /// The verified envelope.
        message: Box<Message>,
        /// The peer that forwarded it.
        source: PeerId,
        /// The peer that published it (signed gossip names it; the relay
        /// cannot change it).
        author: PeerId,
    },
    /// A gossip message was refused.
    Refused {
        /// Topic.
        topic: String,
        /// Why.
        reason: String,
        /// Whether the sender is penalised (Reject) or not (Ignore).
        penalised: bool,
        /// The peer that forwarded it.
        source: PeerId,
    },
    /// Now listening on an address.
    Listening(Multiaddr),
    /// A request on the per-job direct protocol; answer with
    /// [`Network::respond`].
    JobRequest {
        /// Requesting peer.
        peer: PeerId,
        /// Id to answer.
        id: u64,
        /// The request.
        request: JobRequest,
    },
    /// A peer subscribed to a topic (a cue to announce ourselves there).
    PeerSubscribed {
        /// Peer.
        peer: PeerId,
        /// Topic.
        topic: String,
    },
    /// A connection to a peer opened.
    PeerConnected(PeerId),
    /// The last connection to a peer closed.
    PeerDisconnected(PeerId),
}

enum Command {
    Subscribe(String, oneshot::Sender<Result<(), NodeError>>),
    ServeTenants(Vec<String>, oneshot::Sender<Result<(), NodeError>>),
    Publish(String, Vec<u8>, oneshot::Sender<Result<(), NodeError>>),
    Dial(Multiaddr, oneshot::Sender<Result<(), NodeError>>),
    ListenAddrs(oneshot::Sender<Vec<Multiaddr>>),
    Peers(oneshot::Sender<Vec<PeerId>>),
    Shutdown(oneshot::Sender<()>),
    Request(PeerId, JobRequest, oneshot::Sender<Result<JobResponse, NodeError>>),
    Respond(u64, JobResponse),
    AntiEntropy(PeerId, DigestRequest, oneshot::Sender<Result<DigestResponse, NodeError>>),
}

/// Handle to the network event loop.
#[derive(Clone, Debug)]
pub struct Network {
    tx: mpsc::Sender<Command>,
    peer_id: PeerId,
    dropped: Arc<std::sync::atomic::AtomicU64>,
    stats: Arc<NetStats>,
}

impl Network {
    /// Builds the swarm, starts listening and dialling, and spawns the event
    /// loop. Returns the handle and the event stream.
    pub async fn start(
        identity: &Identity,
        config: NetworkConfig,
        keyspace: Arc<Keyspace>,
    ) -> Result<(Network, mpsc::Receiver<NetEvent>), NodeError> {
        let mut swarm = build_swarm(identity, &config)?;
        let mut pending = HashMap::new();
        for addr in &config.listen {
            check_port_free(addr)?;
            let id = swarm
                .listen_on(addr.clone())
                .map_err(|e| NodeError::Listen { addr: addr.to_string(), reason: e.to_string() })?;
            pending.insert(id, addr.clone());
        }
        // Binding happens asynchronously: wait until every listener is up or
        // has failed, so a port in use is a startup error, not a silent log.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !pending.is_empty() {
            let ev = tokio::time::timeout_at(deadline, swarm.select_next_some())
                .await
                .map_err(|_| NodeError::Listen {
                    addr: pending.values().map(|a| a.to_string()).collect::<Vec<_>>().join(", "),
                    reason: "not up within 5 s".into(),
                })?;
            match ev {
                SwarmEvent::NewListenAddr { listener_id, address } => {
                    tracing::info!(%address, "listening");
                    pending.remove(&listener_id);
                }
                SwarmEvent::ListenerClosed { listener_id, reason: Err(e), .. }
                | SwarmEvent::ListenerError { listener_id, error: e } => {
                    let addr =
                        pending.remove(&listener_id).map(|a| a.to_string()).unwrap_or_default();
                    return Err(NodeError::Listen { addr, reason: e.to_string() });
                }
                _ => {}
            }
        }
        for addr in &config.bootstrap {
            if let Some(Protocol::P2p(peer)) = addr.iter().last() {
                swarm.behaviour_mut().kad.add_address(&peer, addr.clone());
            }
            swarm
                .dial(addr.clone())
                .map_err(|e| NodeError::Dial { addr: addr.to_string(), reason: e.to_string() })?;
        }
        let (tx, rx) = mpsc::channel(CHANNEL_BOUND);
        let (ev_tx, ev_rx) = mpsc::channel(CHANNEL_BOUND);
        let dropped = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let stats = Arc::new(NetStats::default());
        let peer_id = *swarm.local_peer_id();
        let intake = intake::Intake {
            keyspace: keyspace.clone(),
            quotas: Arc::new(std::sync::Mutex::new(PeerQuotas::new(config.quota))),
            stats: stats.clone(),
            trust: config.tenant_trust.clone(),
        };
        let merges = gossip_merge::GossipMerge::start(intake.clone())
            .map_err(|e| NodeError::Transport(format!("cannot start the gossip merge worker: {e}")))?;
        let lp = EventLoop {
            swarm,
            merges,
            rx,
            events: Events { tx: ev_tx, dropped: dropped.clone() },
            limits: config.limits,
            keyspace,
            intake,
            stats: stats.clone(),
            anti_entropy_interval: config.anti_entropy_interval,
            served_tenants: config.served_tenants.clone(),
            ae: anti_entropy::AntiEntropy::new(config.anti_entropy_interval),
            outbound: HashMap::new(),
            inbound: HashMap::new(),
            local: HashMap::new(),
            next_inbound: 0,
            bootstrap_peers: config
                .bootstrap
                .iter()
                .filter_map(|a| match a.iter().last() {
                    Some(Protocol::P2p(p)) => Some((a.clone(), p)),
                    _ => None,
                })
                .collect(),
            redial_round: 0,
            bootstrap: config.bootstrap.clone(),
        };
        tokio::spawn(lp.run());
        Ok((Network { tx, peer_id, dropped, stats }, ev_rx))
    }

    /// This node's peer id.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// Events the loop dropped because the runtime was not keeping up.
    pub fn events_dropped(&self) -> u64 {
        self.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// What the network layer refused or shed.
    pub fn stats(&self) -> &NetStats {
        &self.stats
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(make(tx)).await.map_err(|_| NodeError::NetworkStopped)?;
        rx.await.map_err(|_| NodeError::NetworkStopped)
    }

    /// Subscribes to a gossip topic.
    pub async fn subscribe(&self, topic: &str) -> Result<(), NodeError> {
        self.call(|r| Command::Subscribe(topic.into(), r)).await?
    }

    /// Replaces the tenants whose usage records this gateway keeps (its
    /// `api_keys.json` changed): joins and leaves their usage topics.
    pub async fn serve_tenants(&self, tenants: Vec<String>) -> Result<(), NodeError> {
        self.call(|r| Command::ServeTenants(tenants, r)).await?
    }

    /// Publishes bytes on a topic. `InsufficientPeers` is not an error here:
    /// with nobody subscribed yet there is nobody to tell.
    pub async fn publish(&self, topic: &str, data: Vec<u8>) -> Result<(), NodeError> {
        self.call(|r| Command::Publish(topic.into(), data, r)).await?
    }

    /// Dials an address.
    pub async fn dial(&self, addr: Multiaddr) -> Result<(), NodeError> {
        self.call(|r| Command::Dial(addr, r)).await?
    }

    /// Addresses being listened on.
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>, NodeError> {
        self.call(Command::ListenAddrs).await
    }

    /// Connected peers.
    pub async fn peers(&self) -> Result<Vec<PeerId>, NodeError> {
        self.call(Command::Peers).await
    }

    /// Sends a request on the per-job protocol and waits for the answer.
    pub async fn request(&self, peer: PeerId, req: JobRequest) -> Result<JobResponse, NodeError> {
        self.call(|r| Command::Request(peer, req, r)).await?
    }

    /// Sends one anti-entropy request as given and returns the answer,
    /// merging nothing (diagnostics, and the adversary tests that flood a
    /// node with requests of their own making).
    pub async fn anti_entropy_request(
        &self,
        peer: PeerId,
        req: AntiEntropyRequest,
    ) -> Result<AntiEntropyAnswer, NodeError> {
        self.call(|r| Command::AntiEntropy(peer, req, r)).await?
    }

    /// Answers an inbound [`NetEvent::JobRequest`].
    pub async fn respond(&self, id: u64, resp: JobResponse) -> Result<(), NodeError> {
        self.tx.send(Command::Respond(id, resp)).await.map_err(|_| NodeError::NetworkStopped)
    }

    /// Stops the event loop and waits until it has released the swarm (its
    /// ports) and the keyspace.
    pub async fn shutdown(&self) {
        let _ = self.call(Command::Shutdown).await;
    }
}

/// How often a node with no peers dials its bootstrap addresses again.
const REDIAL_EVERY: Duration = Duration::from_secs(2);
/// Every this many redial ticks (~16 s), a node with peers dials the
/// bootstrap nodes it is not connected to.
const REJOIN_EVERY: u64 = 8;

struct EventLoop {
    swarm: Swarm<Behaviour>,
    /// Merges gossiped deltas off the loop.
    merges: gossip_merge::GossipMerge,
    rx: mpsc::Receiver<Command>,
    events: Events,
    limits: Limits,
    keyspace: Arc<Keyspace>,
    /// The merge path of peer deltas (clock bounds, quotas).
    intake: intake::Intake,
    stats: Arc<NetStats>,
    anti_entropy_interval: Duration,
    served_tenants: Vec<String>,
    ae: anti_entropy::AntiEntropy,
    outbound: HashMap<
        request_response::OutboundRequestId,
        oneshot::Sender<Result<JobResponse, NodeError>>,
    >,
    inbound: HashMap<u64, request_response::ResponseChannel<JobResponse>>,
    /// Requests this node sends to itself (`--role all`: its worker and its
    /// gateway), answered without a connection.
    local: HashMap<u64, oneshot::Sender<Result<JobResponse, NodeError>>>,
    next_inbound: u64,
    /// Dialled again while no peer is connected: a bootstrap node that was
    /// not up yet (or restarted) is found without restarting this one.
    bootstrap: Vec<Multiaddr>,
    /// The node behind each bootstrap address, once known.
    bootstrap_peers: HashMap<Multiaddr, PeerId>,
    redial_round: u64,
}

/// The loop's events to the runtime. Bounded, and never awaited: the
/// runtime awaits the loop (publish, respond), so a loop that waited for
/// the runtime could deadlock under a flood. When the queue is full an
/// event is dropped and counted — gossip is lossy by design (announcements
/// repeat, anti-entropy repairs), and a dropped direct request is answered
/// "busy" by the caller of [`Events::emit`]. Gossip gets only the first
/// three quarters of the queue, so a flood of it never crowds out the
/// direct requests of running jobs.
#[derive(Clone)]
struct Events {
    tx: mpsc::Sender<NetEvent>,
    dropped: Arc<std::sync::atomic::AtomicU64>,
}

impl Events {
    /// Queues `ev`; gives it back when the queue is full (or closed).
    fn emit(&self, ev: NetEvent) -> Result<(), NetEvent> {
        self.tx.try_send(ev).map_err(|e| {
            self.count_drop();
            e.into_inner()
        })
    }

    /// Queues a gossip event while a quarter of the queue is still free.
    fn emit_gossip(&self, ev: NetEvent) {
        if self.tx.capacity() <= CHANNEL_BOUND / 4 {
            self.count_drop();
        } else {
            let _ = self.emit(ev);
        }
    }

    fn count_drop(&self) {
        let n = self.dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n.is_power_of_two() {
            tracing::warn!(dropped = n + 1, "runtime not keeping up: network events dropped");
        }
    }
}

impl EventLoop {
    async fn run(mut self) {
        let mut ae = tokio::time::interval(self.anti_entropy_interval);
        let mut redial = tokio::time::interval(REDIAL_EVERY);
        let ack = loop {
            tokio::select! {
                _ = ae.tick() => self.anti_entropy_round(),
                _ = redial.tick() => self.redial_bootstrap(),
                ev = self.swarm.select_next_some() => self.on_swarm(ev),
                Some(done) = self.ae.done_rx.recv() => self.on_done(done),
                Some(v) = self.merges.verdicts.recv() => {
                    self.swarm.behaviour_mut().gossipsub.report_message_validation_result(
                        &v.id, &v.source, v.acceptance,
                    );
                }
                cmd = self.rx.recv() => match cmd {
                    Some(Command::Shutdown(ack)) => break Some(ack),
                    Some(c) => self.on_command(c),
                    // Every handle dropped: the node is shutting down.
                    None => break None,
                },
            }
        };
        let worker = self.merges.stop();
        drop(self);
        if let Some(h) = worker {
            // Its current merge is short; the keyspace is released after it.
            let _ = tokio::task::spawn_blocking(move || h.join()).await;
        }
        tracing::debug!("network event loop stopped");
        if let Some(ack) = ack {
            let _ = ack.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_event_queue_drops_gossip_first_and_never_blocks() {
        let (tx, mut rx) = mpsc::channel(CHANNEL_BOUND);
        let events = Events { tx, dropped: Arc::default() };
        let peer = PeerId::random();
        let gossip = || NetEvent::PeerSubscribed { peer, topic: "t".into() };
        let direct = || NetEvent::PeerConnected(peer);
        for _ in 0..CHANNEL_BOUND {
            events.emit_gossip(gossip());
        }
        let gossip_kept = CHANNEL_BOUND - CHANNEL_BOUND / 4;
        assert_eq!(events.dropped.load(std::sync::atomic::Ordering::Relaxed), (CHANNEL_BOUND / 4) as u64);
        for _ in gossip_kept..CHANNEL_BOUND {
            assert!(events.emit(direct()).is_ok(), "the last quarter is for direct events");
        }
        assert!(events.emit(direct()).is_err(), "full: given back at once, not awaited");
        let mut n = 0;
        while rx.try_recv().is_ok() {
            n += 1;
        }
        assert_eq!(n, CHANNEL_BOUND);
    }
}
