//! The node runtime: identity, keyspace, network, registry and heartbeats,
//! driven by one task.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gcs_keyspace::{Keyspace, KeyspaceOptions};
use gcs_protocol::{
    ids, sign, Capabilities, Heartbeat, Message, ModelInfo, NodeId, NodeRegistration, NodeStatus,
    QueueInfo, Trust, PROTOCOL_VERSION,
};
use libp2p::{Multiaddr, PeerId};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::error::NodeError;
use crate::identity::Identity;
use crate::network::{NetEvent, Network, NetworkConfig};
use crate::registry::{Accepted, Registry};
use crate::topics;

/// What a node does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// HTTP ingress: publishes jobs, validates claims.
    Gateway,
    /// Executes jobs.
    Worker,
    /// Both, in one process.
    All,
}

impl Role {
    /// Whether this role runs a worker.
    pub fn is_worker(self) -> bool {
        matches!(self, Role::Worker | Role::All)
    }
}

/// Node settings.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Role.
    pub role: Role,
    /// Data directory (identity, keyspace).
    pub data_dir: PathBuf,
    /// Network settings.
    pub network: NetworkConfig,
    /// How often a worker re-publishes its registration (26.10.2: 10 s).
    pub heartbeat_interval: Duration,
    /// Registration lifetime (26.10.2: 30 s).
    pub registration_ttl: Duration,
    /// Models a worker serves.
    pub models: Vec<ModelInfo>,
    /// Swarm id.
    pub swarm_id: String,
}

impl NodeConfig {
    /// Defaults for `role` in `data_dir`.
    pub fn new(role: Role, data_dir: PathBuf) -> Self {
        Self {
            role,
            data_dir,
            network: NetworkConfig::default(),
            heartbeat_interval: Duration::from_secs(10),
            registration_ttl: Duration::from_secs(30),
            models: vec![],
            swarm_id: "public".into(),
        }
    }
}

/// A running node.
#[derive(Debug)]
pub struct NodeHandle {
    /// GCS node id.
    pub node_id: NodeId,
    /// libp2p peer id (same key).
    pub peer_id: PeerId,
    network: Network,
    registry: Arc<Mutex<Registry>>,
    keyspace: Arc<Keyspace>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

/// Wall-clock milliseconds (the one place the runtime reads the clock).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl NodeHandle {
    /// Fresh registrations this node knows.
    pub fn fresh_registrations(&self) -> Vec<NodeRegistration> {
        let r = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        r.fresh(now_ms()).cloned().collect()
    }

    /// Listen addresses, with `/p2p/<peer id>` appended.
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>, NodeError> {
        let peer = self.peer_id;
        Ok(self
            .network
            .listen_addrs()
            .await?
            .into_iter()
            .map(|a| a.with(libp2p::multiaddr::Protocol::P2p(peer)))
            .collect())
    }

    /// The network handle (publishing raw bytes is what tests of a
    /// misbehaving peer need).
    pub fn network(&self) -> &Network {
        &self.network
    }

    /// The node's keyspace.
    pub fn keyspace(&self) -> &Keyspace {
        &self.keyspace
    }

    /// Writes `value` at `key` and, for a globally replicated namespace,
    /// gossips the delta to every node.
    pub async fn put_replicated(&self, key: &str, value: Vec<u8>) -> Result<(), NodeError> {
        let delta = self.keyspace.put(key, value, now_ms())?;
        if gcs_keyspace::Namespace::of_key(key)?.scope() == gcs_keyspace::Scope::Global {
            self.network.publish(topics::KEYSPACE_DELTAS, delta.encode()).await?;
        }
        Ok(())
    }

    /// Graceful shutdown: a worker publishes an offline registration first.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

struct Runtime {
    identity: Identity,
    config: NodeConfig,
    network: Network,
    registry: Arc<Mutex<Registry>>,
    keyspace: Arc<Keyspace>,
}

/// Starts a node.
pub async fn start(config: NodeConfig) -> Result<NodeHandle, NodeError> {
    std::fs::create_dir_all(&config.data_dir).map_err(|e| NodeError::DataDir {
        path: config.data_dir.display().to_string(),
        reason: e.to_string(),
    })?;
    let identity = Identity::load_or_create(&config.data_dir)?;
    let node_id = identity.node_id();
    let keyspace = Arc::new(Keyspace::open(
        &config.data_dir.join("keyspace"),
        node_id.as_str(),
        KeyspaceOptions::default(),
    )?);
    let (network, events) =
        Network::start(&identity, config.network.clone(), keyspace.clone()).await?;
    for t in [topics::CAPABILITIES_ALL, topics::API_JOBS_ALL, topics::KEYSPACE_DELTAS] {
        network.subscribe(t).await?;
    }
    let registry = Arc::new(Mutex::new(Registry::new(config.network.limits.clone())));
    tracing::info!(node_id = %node_id, peer_id = %identity.peer_id(), role = ?config.role, "node started");
    let (stop_tx, stop_rx) = oneshot::channel();
    let peer_id = identity.peer_id();
    let rt = Runtime {
        identity,
        config,
        network: network.clone(),
        registry: registry.clone(),
        keyspace: keyspace.clone(),
    };
    let task = tokio::spawn(rt.run(events, stop_rx));
    Ok(NodeHandle { node_id, peer_id, network, registry, keyspace, stop: Some(stop_tx), task })
}

impl Runtime {
    async fn run(self, mut events: mpsc::Receiver<NetEvent>, mut stop: oneshot::Receiver<()>) {
        let mut heartbeat = tokio::time::interval(self.config.heartbeat_interval);
        let mut prune = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = &mut stop => break,
                ev = events.recv() => match ev {
                    // A new subscriber to the capability topic: announce at
                    // once rather than at the next heartbeat, so a worker that
                    // joins is known within a round trip, not 10 s.
                    Some(NetEvent::PeerSubscribed { topic, .. })
                        if topic == topics::CAPABILITIES_ALL && self.config.role.is_worker() =>
                    {
                        self.publish_registration(NodeStatus::Online).await;
                    }
                    Some(ev) => self.on_event(ev),
                    None => break,
                },
                _ = heartbeat.tick(), if self.config.role.is_worker() => {
                    self.publish_registration(NodeStatus::Online).await;
                }
                _ = prune.tick() => {
                    let gone = self.registry.lock().unwrap_or_else(|p| p.into_inner()).prune(now_ms());
                    for n in gone {
                        tracing::info!(node = %n, "registration expired");
                    }
                }
            }
        }
        if self.config.role.is_worker() {
            self.publish_registration(NodeStatus::Offline).await;
            // Give the swarm a moment to flush the offline registration
            // before its connections close.
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        self.network.shutdown().await;
        tracing::info!("node stopped");
    }

    fn registration(&self, status: NodeStatus) -> Result<NodeRegistration, NodeError> {
        let now = now_ms();
        let ttl = self.config.registration_ttl.as_millis() as u64;
        let key = &self.identity.key;
        let mut reg = NodeRegistration {
            message_type: gcs_protocol::MessageType::NodeRegistration,
            version: PROTOCOL_VERSION,
            registration_id: ids::new_id(ids::REGISTRATION, now)?,
            node_id: key.node_id(),
            public_key: key.public_key(),
            swarm_id: self.config.swarm_id.clone(),
            tenant_id: None,
            status,
            capabilities: Capabilities {
                api_request_job: true,
                chat: self
                    .config
                    .models
                    .iter()
                    .any(|m| m.tasks.contains(&gcs_protocol::ApiType::ChatCompletion)),
                completion: self
                    .config
                    .models
                    .iter()
                    .any(|m| m.tasks.contains(&gcs_protocol::ApiType::Completion)),
                embedding: self
                    .config
                    .models
                    .iter()
                    .any(|m| m.tasks.contains(&gcs_protocol::ApiType::Embedding)),
                streaming: true,
                ..Default::default()
            },
            models: self.config.models.clone(),
            queue: QueueInfo { accepts_public_jobs: true, ..Default::default() },
            trust: Trust::default(),
            heartbeat: Heartbeat { created_at_ms: now, expires_at_ms: now + ttl, ttl_ms: ttl },
            addresses: vec![],
            signature: None,
        };
        sign(&mut reg, key)?;
        Ok(reg)
    }

    async fn publish_registration(&self, status: NodeStatus) {
        let result = async {
            let reg = self.registration(status)?;
            let bytes = gcs_protocol::encode(&reg)?;
            self.store_registration(&reg, &bytes);
            self.network.publish(topics::CAPABILITIES_ALL, bytes).await
        }
        .await;
        if let Err(e) = result {
            tracing::warn!(error = %e, "could not publish registration");
        }
    }

    fn store_registration(&self, reg: &NodeRegistration, bytes: &[u8]) {
        let key = format!("/gcs/nodes/registrations/{}", reg.node_id);
        if let Err(e) = self.keyspace.put(&key, bytes.to_vec(), now_ms()) {
            tracing::warn!(error = %e, "could not store registration");
        }
    }

    fn on_event(&self, ev: NetEvent) {
        match ev {
            NetEvent::Message { message, topic, source } => {
                if let Message::NodeRegistration(reg) = *message {
                    let node = reg.node_id.clone();
                    let models: Vec<String> =
                        reg.models.iter().map(|m| m.model_id.clone()).collect();
                    let bytes = gcs_protocol::encode(&reg).unwrap_or_default();
                    let outcome = self
                        .registry
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .accept(reg.clone(), now_ms());
                    match outcome {
                        Accepted::New => {
                            tracing::info!(%node, ?models, %source, "worker registration arrived");
                            self.store_registration(&reg, &bytes);
                        }
                        Accepted::Refreshed => self.store_registration(&reg, &bytes),
                        Accepted::Offline => tracing::info!(%node, "worker went offline"),
                        Accepted::Outdated | Accepted::Stale => {}
                    }
                } else {
                    tracing::debug!(%topic, "message not handled yet");
                }
            }
            NetEvent::Refused { topic, reason, penalised, source } => {
                tracing::warn!(%source, %topic, %reason, penalised, "refused gossip message");
            }
            NetEvent::PeerConnected(p) => tracing::info!(peer = %p, "peer connected"),
            NetEvent::PeerDisconnected(p) => tracing::info!(peer = %p, "peer disconnected"),
            NetEvent::Listening(_) | NetEvent::PeerSubscribed { .. } => {}
        }
    }
}
