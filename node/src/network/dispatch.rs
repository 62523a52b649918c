//! The event loop's dispatch: commands from the node's handle, swarm
//! events, the direct job protocol, bootstrap redials, and gossip
//! validation.

use libp2p::gossipsub::{self, IdentTopic, MessageAcceptance};
use libp2p::request_response;
use libp2p::swarm::SwarmEvent;
use libp2p::{identify, mdns, PeerId};

use super::swarm::BehaviourEvent;
use super::{gossip_merge, Command, EventLoop, NetEvent, NetStats, BUSY, REJOIN_EVERY};
use crate::error::NodeError;
use crate::jobs::wire::{JobRequest, JobResponse};
use gcs_protocol::now_ms;

impl EventLoop {
    pub(super) fn on_command(&mut self, cmd: Command) {
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
                    self.ae.reset_cursors();
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

    pub(super) fn on_swarm(&mut self, ev: SwarmEvent<BehaviourEvent>) {
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

    pub(super) fn on_job_protocol(&mut self, ev: request_response::Event<JobRequest, JobResponse>) {
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
    pub(super) fn redial_bootstrap(&mut self) {
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
    pub(super) fn on_gossip(
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
        let author = msg.source.unwrap_or(source);
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
                self.events.emit_gossip(NetEvent::Message { topic, message: Box::new(m), source, author });
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
