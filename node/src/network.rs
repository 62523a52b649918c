//! The libp2p side of a node: one event loop owns the swarm; the rest of the
//! node talks to it through a small cloneable handle (commands with one-shot
//! replies) and a bounded event stream — the shape of rust-libp2p's
//! file-sharing example.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gcs_keyspace::Keyspace;
use gcs_protocol::{now_ms, Limits, Message};
use libp2p::gossipsub::{self, IdentTopic, MessageAcceptance, MessageAuthenticity};
use libp2p::request_response::{self, ProtocolSupport};
use libp2p::swarm::{behaviour::toggle::Toggle, NetworkBehaviour, SwarmEvent};
use libp2p::{
    identify, kad, mdns, multiaddr::Protocol, noise, ping, tcp, yamux, Multiaddr, PeerId,
    StreamProtocol, Swarm,
};
use tokio::sync::{mpsc, oneshot};

use crate::error::NodeError;
use crate::identity::Identity;
use crate::jobs::wire::{JobRequest, JobResponse};
use crate::quota::{PeerQuotas, QuotaConfig};
use crate::replication::{DigestRequest, DigestResponse};
use std::collections::HashMap;

mod anti_entropy;
mod gossip_merge;
pub mod intake;
mod rounds;

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

#[derive(NetworkBehaviour)]
struct Behaviour {
    limits: libp2p::connection_limits::Behaviour,
    gossipsub: gossipsub::Behaviour,
    identify: identify::Behaviour,
    kad: kad::Behaviour<kad::store::MemoryStore>,
    mdns: Toggle<mdns::tokio::Behaviour>,
    ping: ping::Behaviour,
    anti_entropy: request_response::cbor::Behaviour<DigestRequest, DigestResponse>,
    jobs: request_response::cbor::Behaviour<JobRequest, JobResponse>,
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

/// libp2p binds listeners with SO_REUSEPORT, so a second process on the same
/// port would silently share it. Probe-bind without it first: a port in use
/// is a clear startup error.
fn check_port_free(addr: &Multiaddr) -> Result<(), NodeError> {
    let mut ip = None;
    let mut port = None;
    for p in addr.iter() {
        match p {
            Protocol::Ip4(a) => ip = Some(std::net::IpAddr::V4(a)),
            Protocol::Ip6(a) => ip = Some(std::net::IpAddr::V6(a)),
            Protocol::Tcp(n) => port = Some((n, true)),
            Protocol::Udp(n) => port = Some((n, false)),
            _ => {}
        }
    }
    let (Some(ip), Some((port, tcp))) = (ip, port) else { return Ok(()) };
    if port == 0 {
        return Ok(());
    }
    let r = if tcp {
        std::net::TcpListener::bind((ip, port)).map(drop)
    } else {
        std::net::UdpSocket::bind((ip, port)).map(drop)
    };
    r.map_err(|e| NodeError::Listen { addr: addr.to_string(), reason: e.to_string() })
}

fn gossip_message_id(m: &gossipsub::Message) -> gossipsub::MessageId {
    // Content-addressed per topic: the same envelope forwarded by different
    // peers is one message, but a copy on another topic is judged on its own.
    let mut h = blake3::Hasher::new();
    h.update(m.topic.as_str().as_bytes()).update(&[0]).update(&m.data);
    gossipsub::MessageId::from(h.finalize().as_bytes()[..20].to_vec())
}

fn build_swarm(identity: &Identity, config: &NetworkConfig) -> Result<Swarm<Behaviour>, NodeError> {
    let net = |e: &dyn std::fmt::Display| NodeError::Transport(e.to_string());
    let gossip_config = gossipsub::ConfigBuilder::default()
        .heartbeat_interval(config.gossip_heartbeat)
        .validation_mode(gossipsub::ValidationMode::Strict)
        .validate_messages()
        .max_transmit_size(config.limits.max_message_bytes)
        .message_id_fn(gossip_message_id)
        .build()
        .map_err(|e| net(&e))?;
    let mdns_on = config.mdns;
    let c = config.connections;
    let caps = libp2p::connection_limits::ConnectionLimits::default()
        .with_max_established_per_peer(Some(c.per_peer))
        .with_max_established(Some(c.established))
        .with_max_pending_incoming(Some(c.pending_incoming))
        .with_max_pending_outgoing(Some(c.pending_outgoing));
    let swarm = libp2p::SwarmBuilder::with_existing_identity(identity.keypair.clone())
        .with_tokio()
        .with_tcp(tcp::Config::default().nodelay(true), noise::Config::new, yamux::Config::default)
        .map_err(|e| net(&e))?
        .with_quic()
        .with_behaviour(|key| {
            let peer = key.public().to_peer_id();
            let mut gossipsub =
                gossipsub::Behaviour::new(MessageAuthenticity::Signed(key.clone()), gossip_config)?;
            let (params, thresholds) = crate::scoring::peer_score();
            gossipsub.with_peer_score(params, thresholds)?;
            let mut kad_cfg = kad::Config::new(libp2p::StreamProtocol::new("/gcs/kad/1.0.0"));
            kad_cfg.set_query_timeout(Duration::from_secs(30));
            let kad =
                kad::Behaviour::with_config(peer, kad::store::MemoryStore::new(peer), kad_cfg);
            let mdns = if mdns_on {
                Some(mdns::tokio::Behaviour::new(mdns::Config::default(), peer)?)
            } else {
                None
            };
            Ok(Behaviour {
                gossipsub,
                identify: identify::Behaviour::new(identify::Config::new(
                    PROTOCOL_NAME.into(),
                    key.public(),
                )),
                kad,
                mdns: Toggle::from(mdns),
                ping: ping::Behaviour::default(),
                jobs: request_response::cbor::Behaviour::new(
                    [(StreamProtocol::new(crate::jobs::wire::PROTOCOL), ProtocolSupport::Full)],
                    request_response::Config::default()
                        .with_request_timeout(Duration::from_secs(30)),
                ),
                anti_entropy: request_response::cbor::Behaviour::with_codec(
                    request_response::cbor::codec::Codec::default()
                        .set_request_size_maximum(anti_entropy::REQUEST_MAX_BYTES)
                        .set_response_size_maximum(anti_entropy::RESPONSE_MAX_BYTES),
                    [(StreamProtocol::new("/gcs/anti-entropy/1.0.0"), ProtocolSupport::Full)],
                    request_response::Config::default()
                        .with_request_timeout(Duration::from_secs(30)),
                ),
                limits: libp2p::connection_limits::Behaviour::new(caps),
            })
        })
        .map_err(|e| net(&e))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(120)))
        .build();
    Ok(swarm)
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

    fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Subscribe(topic, reply) => {
                let t = IdentTopic::new(topic);
                let gs = &mut self.swarm.behaviour_mut().gossipsub;
                let r = gs.subscribe(&t).map(|_| ());
                if r.is_ok() {
                    let _ = gs.set_topic_params(t, crate::scoring::topic_params());
                }
                let _ = reply.send(
                    r.map_err(|e| NodeError::Gossip { op: "subscribe", reason: format!("{e:?}") }),
                );
            }
            Command::ServeTenants(tenants, reply) => {
                let gs = &mut self.swarm.behaviour_mut().gossipsub;
                let mut r = Ok(());
                for gone in self.served_tenants.iter().filter(|t| !tenants.contains(t)) {
                    gs.unsubscribe(&IdentTopic::new(crate::topics::tenant_usage(gone)));
                }
                for new in tenants.iter().filter(|t| !self.served_tenants.contains(t)) {
                    let t = IdentTopic::new(crate::topics::tenant_usage(new));
                    let _ = gs.set_topic_params(t.clone(), crate::scoring::topic_params());
                    if let Err(e) = gs.subscribe(&t) {
                        r = Err(NodeError::Gossip { op: "subscribe", reason: format!("{e:?}") });
                    }
                }
                if tenants.iter().any(|t| !self.served_tenants.contains(t)) {
                    // The log pulls so far skipped the new tenants' records:
                    // compare digests with every peer again.
                    self.ae.cursor.clear();
                }
                tracing::info!(?tenants, "usage records kept for these tenants");
                self.served_tenants = tenants;
                let _ = reply.send(r);
            }
            Command::Publish(topic, data, reply) => {
                let r = match self
                    .swarm
                    .behaviour_mut()
                    .gossipsub
                    .publish(IdentTopic::new(topic), data)
                {
                    Ok(_) | Err(gossipsub::PublishError::NoPeersSubscribedToTopic) => Ok(()),
                    Err(gossipsub::PublishError::Duplicate) => Ok(()),
                    Err(e) => Err(NodeError::Gossip { op: "publish", reason: format!("{e:?}") }),
                };
                let _ = reply.send(r);
            }
            Command::Dial(addr, reply) => {
                let _ = reply
                    .send(self.swarm.dial(addr.clone()).map_err(|e| NodeError::Dial {
                        addr: addr.to_string(),
                        reason: e.to_string(),
                    }));
            }
            Command::ListenAddrs(reply) => {
                let _ = reply.send(self.swarm.listeners().cloned().collect());
            }
            Command::Peers(reply) => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
            // `run` intercepts Shutdown before dispatching; acknowledging here
            // keeps the arm total without a panic.
            Command::Shutdown(ack) => {
                let _ = ack.send(());
            }
            Command::Request(peer, req, reply) if peer == *self.swarm.local_peer_id() => {
                let id = self.next_inbound;
                self.next_inbound += 1;
                self.local.insert(id, reply);
                // The runtime asking itself (`--role all`): refused at once
                // when it is saturated, like a remote request.
                if self.events.emit(NetEvent::JobRequest { peer, id, request: req }).is_err() {
                    if let Some(r) = self.local.remove(&id) {
                        let _ = r.send(Ok(JobResponse::Refused(BUSY.into())));
                    }
                }
            }
            Command::Request(peer, req, reply) => {
                let id = self.swarm.behaviour_mut().jobs.send_request(&peer, req);
                self.outbound.insert(id, reply);
            }
            Command::AntiEntropy(peer, req, reply) => {
                let id = self.swarm.behaviour_mut().anti_entropy.send_request(&peer, req);
                self.ae.raw.insert(id, reply);
            }
            Command::Respond(id, resp) => {
                if let Some(r) = self.local.remove(&id) {
                    let _ = r.send(Ok(resp));
                } else if let Some(ch) = self.inbound.remove(&id) {
                    let _ = self.swarm.behaviour_mut().jobs.send_response(ch, resp);
                }
            }
        }
    }

    fn on_swarm(&mut self, ev: SwarmEvent<BehaviourEvent>) {
        match ev {
            SwarmEvent::NewListenAddr { address, .. } => {
                tracing::info!(%address, "listening");
                let _ = self.events.emit(NetEvent::Listening(address));
            }
            SwarmEvent::ConnectionEstablished { peer_id, num_established, endpoint, .. }
                if num_established.get() == 1 =>
            {
                if let libp2p::core::ConnectedPoint::Dialer { address, .. } = &endpoint {
                    if self.bootstrap.contains(address) {
                        self.bootstrap_peers.insert(address.clone(), peer_id);
                    }
                }
                tracing::debug!(%peer_id, addr = %endpoint.get_remote_address(), "peer connected");
                // A new peer may hold what we missed (late join, healed
                // partition); at most one round per peer per interval.
                self.start_round(peer_id);
                let _ = self.events.emit(NetEvent::PeerConnected(peer_id));
            }
            SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Subscribed {
                peer_id,
                topic,
            })) => {
                let ev = NetEvent::PeerSubscribed { peer: peer_id, topic: topic.to_string() };
                let _ = self.events.emit(ev);
            }
            SwarmEvent::ConnectionClosed { peer_id, num_established: 0, .. } => {
                self.ae.forget(&peer_id);
                let _ = self.events.emit(NetEvent::PeerDisconnected(peer_id));
            }
            SwarmEvent::IncomingConnectionError {
                error: libp2p::swarm::ListenError::Denied { .. }, ..
            }
            | SwarmEvent::OutgoingConnectionError {
                error: libp2p::swarm::DialError::Denied { .. }, ..
            } => NetStats::bump(&self.stats.connections_denied),
            SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Message {
                propagation_source,
                message_id,
                message,
            })) => self.on_gossip(propagation_source, message_id, message),
            SwarmEvent::Behaviour(BehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                ..
            })) => {
                for addr in info.listen_addrs {
                    self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Mdns(mdns::Event::Discovered(list))) => {
                for (peer, addr) in list {
                    self.swarm.behaviour_mut().kad.add_address(&peer, addr.clone());
                    let _ = self.swarm.dial(addr);
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::AntiEntropy(ev)) => self.on_anti_entropy(ev),
            SwarmEvent::Behaviour(BehaviourEvent::Jobs(ev)) => self.on_job_protocol(ev),
            _ => {}
        }
    }

    fn on_job_protocol(&mut self, ev: request_response::Event<JobRequest, JobResponse>) {
        use request_response::{Event, Message as RrMessage};
        match ev {
            Event::Message {
                peer, message: RrMessage::Request { request, channel, .. }, ..
            } => {
                let id = self.next_inbound;
                self.next_inbound += 1;
                if self.events.emit(NetEvent::JobRequest { peer, id, request }).is_ok() {
                    self.inbound.insert(id, channel);
                } else {
                    let busy = JobResponse::Refused(BUSY.into());
                    let _ = self.swarm.behaviour_mut().jobs.send_response(channel, busy);
                }
            }
            Event::Message { message: RrMessage::Response { request_id, response }, .. } => {
                if let Some(r) = self.outbound.remove(&request_id) {
                    let _ = r.send(Ok(response));
                }
            }
            Event::OutboundFailure { request_id, error, peer, .. } => {
                if let Some(r) = self.outbound.remove(&request_id) {
                    let _ = r.send(Err(NodeError::Request {
                        peer: peer.to_string(),
                        reason: error.to_string(),
                    }));
                }
            }
            Event::InboundFailure { .. } | Event::ResponseSent { .. } => {}
        }
    }

    /// Dials bootstrap addresses again: all of them every tick while no
    /// peer is connected; otherwise, every `REJOIN_EVERY` ticks, those whose
    /// node is not connected. A bootstrap node that restarted, or the other
    /// side of a long partition whose connections closed, is found again
    /// even though this node still has other peers.
    fn redial_bootstrap(&mut self) {
        self.redial_round = self.redial_round.wrapping_add(1);
        let alone = self.swarm.connected_peers().next().is_none();
        if !alone && !self.redial_round.is_multiple_of(REJOIN_EVERY) {
            return;
        }
        for a in &self.bootstrap {
            let connected = self.bootstrap_peers.get(a).is_some_and(|p| self.swarm.is_connected(p));
            if alone || !connected {
                let _ = self.swarm.dial(a.clone());
            }
        }
    }

    /// Application-level gossip validation: decode, version, size, fields,
    /// signature and clock, then topic fit. Invalid → Reject (penalised by
    /// peer scoring); stale or from a newer version → Ignore. Only accepted
    /// messages are forwarded.
    fn on_gossip(
        &mut self,
        source: PeerId,
        id: gossipsub::MessageId,
        msg: gossipsub::Message,
    ) {
        let topic = msg.topic.to_string();
        use crate::topics::{Carries, TopicSpec};
        let family = crate::topics::spec(&topic);
        if let Some((TopicSpec { carries: Carries::KeyspaceDeltas, .. }, tenant)) = family {
            // The quota is the author's (signed gossip names it), not the
            // relay's: an honest relay of a flood is not refused for it.
            let author = msg.source.unwrap_or(source);
            let served = match tenant {
                // Only the topic's own tenant, and only one this node serves.
                Some(t) if self.served_tenants.iter().any(|s| s == t) => vec![t.to_string()],
                Some(t) => {
                    tracing::debug!(%source, tenant = t, "refused keyspace delta: tenant not served");
                    self.swarm.behaviour_mut().gossipsub.report_message_validation_result(
                        &id,
                        &source,
                        MessageAcceptance::Reject,
                    );
                    return;
                }
                None => vec![],
            };
            // The merge (RocksDB, maybe an fsync) runs on the merge worker;
            // its verdict comes back through `merges.verdicts`.
            let job = gossip_merge::Job { id: id.clone(), source, author, data: msg.data, served };
            if !self.merges.offer(job, &self.stats) {
                self.swarm.behaviour_mut().gossipsub.report_message_validation_result(
                    &id,
                    &source,
                    MessageAcceptance::Ignore,
                );
            }
            return;
        }
        let verdict = gcs_protocol::open(&msg.data, now_ms(), &self.limits).and_then(|m| {
            if crate::topics::allows(&topic, m.message_type()) {
                Ok(m)
            } else {
                Err(gcs_protocol::ProtocolError::Malformed(format!(
                    "{} not allowed on {topic}",
                    m.message_type()
                )))
            }
        });
        let gs = &mut self.swarm.behaviour_mut().gossipsub;
        match verdict {
            Ok(m) => {
                gs.report_message_validation_result(&id, &source, MessageAcceptance::Accept);
                self.events.emit_gossip(NetEvent::Message { topic, message: Box::new(m), source });
            }
            Err(e) => {
                let penalised = e.is_penalisable();
                let acceptance =
                    if penalised { MessageAcceptance::Reject } else { MessageAcceptance::Ignore };
                gs.report_message_validation_result(&id, &source, acceptance);
                tracing::debug!(%source, %topic, error = %e, penalised, "refused gossip message");
                let ev = NetEvent::Refused { topic, reason: e.to_string(), penalised, source };
                self.events.emit_gossip(ev);
            }
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
