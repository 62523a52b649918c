//! The libp2p behaviour a node runs and how its swarm is built (transports,
//! gossipsub with application-level validation and peer scoring, Kademlia,
//! mDNS, identify, ping, connection caps, the direct protocols).

use std::time::Duration;

use libp2p::gossipsub::{self, MessageAuthenticity};
use libp2p::request_response::{self, ProtocolSupport};
use libp2p::swarm::{behaviour::toggle::Toggle, NetworkBehaviour};
use libp2p::{
    identify, kad, mdns, multiaddr::Protocol, noise, ping, tcp, yamux, Multiaddr, StreamProtocol,
    Swarm,
};

use super::{NetworkConfig, PROTOCOL_NAME};
use crate::error::NodeError;
use crate::identity::Identity;
use crate::jobs::wire::{JobRequest, JobResponse};
use crate::replication::{DigestRequest, DigestResponse};

#[derive(NetworkBehaviour)]
pub(super) struct Behaviour {
    pub(super) limits: libp2p::connection_limits::Behaviour,
    pub(super) gossipsub: gossipsub::Behaviour,
    pub(super) identify: identify::Behaviour,
    pub(super) kad: kad::Behaviour<kad::store::MemoryStore>,
    pub(super) mdns: Toggle<mdns::tokio::Behaviour>,
    pub(super) ping: ping::Behaviour,
    pub(super) anti_entropy: request_response::cbor::Behaviour<DigestRequest, DigestResponse>,
    pub(super) jobs: request_response::cbor::Behaviour<JobRequest, JobResponse>,
}

/// libp2p binds listeners with SO_REUSEPORT, so a second process on the same
/// port would silently share it. Probe-bind without it first: a port in use
/// is a clear startup error.
pub(super) fn check_port_free(addr: &Multiaddr) -> Result<(), NodeError> {
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

pub(super) fn build_swarm(identity: &Identity, config: &NetworkConfig) -> Result<Swarm<Behaviour>, NodeError> {
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
                        .set_request_size_maximum(super::anti_entropy::REQUEST_MAX_BYTES)
                        .set_response_size_maximum(super::anti_entropy::RESPONSE_MAX_BYTES),
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
