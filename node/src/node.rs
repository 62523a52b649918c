//! The node runtime: identity, keyspace, network, registry and heartbeats,
//! driven by one task.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gcs_keyspace::{Keyspace, KeyspaceOptions};
use gcs_protocol::{
    ids, now_ms, sign, Capabilities, Heartbeat, Message, ModelInfo, NodeId, NodeRegistration, NodeStatus,
    QueueInfo, Trust, PROTOCOL_VERSION,
};
use libp2p::{Multiaddr, PeerId};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::error::NodeError;
use crate::identity::Identity;
use crate::jobs::executor::Executor;
use crate::jobs::gateway::{Ctx, GatewayState};
use crate::jobs::wire::{JobRequest, JobResponse};
use crate::jobs::worker::WorkerState;
use crate::jobs::{JobEvent, JobSpec};
use crate::lifecycle::tracker::TrackerConfig;
use crate::lifecycle::worker_job::{Policy, Share};
use crate::network::{NetEvent, Network, NetworkConfig};
use crate::registry::{Accepted, Registry, Source};
use crate::topics::{self, PUBLIC_SWARM};
use crate::backend::{NodeClient, RuntimeCommand};

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
    /// The inference engine a worker runs jobs on; a worker without one
    /// advertises no API-job capability and claims nothing.
    pub executor: Option<Arc<dyn Executor>>,
    /// Jobs a worker runs at once.
    pub max_concurrent_jobs: usize,
    /// Processing subtasks a worker runs at once, beside its API jobs
    /// (specs/batch.md, "Processing on the network"); 0: none.
    pub max_processing_jobs: usize,
    /// Lease of a processing lock (renewed at half of it).
    pub processing_lease_ms: u64,
    /// Gateway lease timing.
    pub tracker: TrackerConfig,
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
    /// Swarm id: a worker outside `public` also takes `local_only` jobs of
    /// its swarm, announced on `gcs.api.jobs.local.<swarm>`.
    pub swarm_id: String,
    /// Tenant whose private node this worker is (26.11.3): it joins
    /// `gcs.api.jobs.private.<tenant>` and may win that tenant's private
    /// and hybrid jobs.
    pub private_tenant: Option<String>,
    /// A private worker that takes no public jobs.
    pub private_only: bool,
    /// Membership certificates this node presents in its registration
    /// (`--membership`): a tenant's private node, a swarm's node, or a
    /// tenant's gateway. Also stored and gossiped at start, so other
    /// gateways of the tenant can check this one's usage records.
    pub memberships: Vec<gcs_protocol::MembershipCertificate>,
    /// How much of a worker's slots and backlog one gateway may take while
    /// others are active.
    pub gateway_share: Share,
    /// The only gateways a worker takes jobs from (`None`: any).
    pub gateways: Option<std::collections::BTreeSet<NodeId>>,
    /// Gateways this worker is attached to (26.11.3 `gateway_local`): it
    /// joins each one's `gcs.api.jobs.gateway.<id>` and may win its
    /// gateway-local jobs with that gateway's `gateway_worker` certificate.
    pub gateway_local: std::collections::BTreeSet<NodeId>,
}

/// A worker's freed slot; never, for a node without one.
async fn slot_freed(worker: Option<&WorkerState>) {
    match worker {
        Some(w) => w.slot_freed().await,
        None => std::future::pending().await,
    }
}

/// The gossip topics a node joins: private and local job topics only
/// where it may win such jobs, a tenant's usage topic only on its gateways.
fn subscriptions(config: &NodeConfig) -> Vec<String> {
    let mut t = vec![topics::CAPABILITIES_ALL.to_string(), topics::KEYSPACE_DELTAS.to_string()];
    let worker = config.role.is_worker();
    // A gateway needs no job topic (it hears its own jobs' claims directly),
    // but joining the public one keeps it a relay in small networks.
    if !(config.role == Role::Worker && config.private_only && config.private_tenant.is_some()) {
        t.push(topics::API_JOBS_ALL.to_string());
    }
    if worker {
        if let Some(tenant) = &config.private_tenant {
            t.push(topics::api_jobs_private(tenant));
        }
        if config.swarm_id != PUBLIC_SWARM {
            t.push(topics::api_jobs_local(&config.swarm_id));
        }
        t.extend(config.gateway_local.iter().map(|g| topics::api_jobs_gateway(g.as_str())));
    }
    if config.role != Role::Worker {
        t.extend(config.network.served_tenants.iter().map(|s| topics::tenant_usage(s)));
    }
    t
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
            swarm_id: PUBLIC_SWARM.into(),
            private_tenant: None,
            private_only: false,
            memberships: vec![],
            gateway_share: Share::default(),
            gateways: None,
            gateway_local: Default::default(),
            executor: None,
            max_concurrent_jobs: 4,
            max_processing_jobs: DEFAULT_PROCESSING_JOBS,
            processing_lease_ms: crate::processing::worker::DEFAULT_LEASE_MS,
            tracker: TrackerConfig::default(),
        }
    }
}

/// Processing slots of a worker by default.
pub const DEFAULT_PROCESSING_JOBS: usize = 1;

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
    client: NodeClient,
    jobs_heard: Arc<std::sync::atomic::AtomicU64>,
    refused_usage: crate::tenants::TrustHandle,
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

    /// Job announcements this node has received on gossip (topic routing
    /// is observable: a public worker never hears a private job).
    pub fn jobs_heard(&self) -> u64 {
        self.jobs_heard.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The node's keyspace.
    pub fn keyspace(&self) -> &Keyspace {
        &self.keyspace
    }

    /// The node's keyspace, for tasks that outlive a borrow.
    pub fn shared_keyspace(&self) -> Arc<Keyspace> {
        self.keyspace.clone()
    }

    /// Usage records from peers this node refused (signer not admitted by
    /// the tenant, foreign key, untrusted tenant).
    pub fn refused_usage(&self) -> u64 {
        self.refused_usage.refused_usage()
    }

    /// A cloneable handle for the HTTP gateway (it implements
    /// [`gcs_gateway::Backend`]).
    pub fn client(&self) -> NodeClient {
        self.client.clone()
    }

    /// Submits a job (gateway roles): signs and publishes it, and returns its
    /// id and the fenced event stream for the client.
    pub async fn submit(
        &self,
        spec: JobSpec,
    ) -> Result<(String, mpsc::Receiver<JobEvent>), NodeError> {
        self.client().submit(spec).await
    }

    /// Cancels a job on the client's behalf.
    pub async fn cancel(
        &self,
        job_id: &str,
        reason: gcs_protocol::CancellationReason,
    ) -> Result<(), NodeError> {
        self.client().cancel(job_id, reason).await
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

/// The runtime task's state: what every role shares, and each role's own
/// state as a separate field, so a role borrows itself mutably while it
/// reads the environment.
struct Runtime {
    env: Env,
    gateway: Option<GatewayState>,
    worker: Option<WorkerState>,
}

/// What every role of the node shares.
struct Env {
    identity: Identity,
    config: NodeConfig,
    network: Network,
    registry: Arc<Mutex<Registry>>,
    keyspace: Arc<Keyspace>,
    registration_id: Arc<Mutex<String>>,
    jobs_heard: Arc<std::sync::atomic::AtomicU64>,
    /// A worker's processing slots (None: it takes no subtasks).
    processing: Option<crate::processing::shell::Shell>,
    /// A gateway's mirror of its tenants' tasks.
    mirror: Option<crate::processing::mirror::Mirror>,
}

/// Starts a node.
pub async fn start(config: NodeConfig) -> Result<NodeHandle, NodeError> {
    std::fs::create_dir_all(&config.data_dir).map_err(|e| NodeError::DataDir {
        path: config.data_dir.display().to_string(),
        reason: e.to_string(),
    })?;
    let identity = Identity::load_or_create(&config.data_dir)?;
    let trust = config.network.tenant_trust.clone();
    let node_id = identity.node_id();
    let keyspace = Arc::new(Keyspace::open(
        &config.data_dir.join("keyspace"),
        node_id.as_str(),
        KeyspaceOptions::default(),
    )?);
    // Records stored before the per-key usage index existed (once per store).
    match crate::indexes::backfill_usage_index(&keyspace, now_ms()) {
        Ok(0) => {}
        Ok(n) => tracing::info!(records = n, "usage index built"),
        Err(e) => tracing::warn!(error = %e, "usage index not built"),
    }
    let (network, events) =
        Network::start(&identity, config.network.clone(), keyspace.clone()).await?;
    for t in subscriptions(&config) {
        network.subscribe(&t).await?;
    }
    let registry = Arc::new(Mutex::new(Registry::new(config.network.limits.clone())));
    tracing::info!(node_id = %node_id, peer_id = %identity.peer_id(), role = ?config.role, "node started");
    let (stop_tx, stop_rx) = oneshot::channel();
    let (cmd_tx, cmd_rx) = mpsc::channel(256);
    let peer_id = identity.peer_id();
    let registration_id = Arc::new(Mutex::new(ids::new_id(ids::REGISTRATION, now_ms())?));
    let worker = match (&config.executor, config.role.is_worker()) {
        (Some(exec), true) => Some(WorkerState::new(
            exec.clone(),
            gcs_protocol::NodeKey::from_seed(identity.key.seed()),
            network.clone(),
            config.models.clone(),
            config.max_concurrent_jobs,
            registration_id.clone(),
            config.network.limits.clone(),
            Policy {
                private_tenant: config.private_tenant.clone(),
                public: !(config.private_only && config.private_tenant.is_some()),
                swarm_id: config.swarm_id.clone(),
                gateways: config.gateways.clone(),
                gateway_local: config.gateway_local.clone(),
            },
            config.gateway_share,
            keyspace.clone(),
        )),
        _ => None,
    };
    let processing = match (&worker, config.max_processing_jobs) {
        (Some(w), n) if n > 0 => Some(crate::processing::shell::start(crate::processing::shell::Parts {
            slots: n,
            lease_ms: config.processing_lease_ms,
            ks: keyspace.clone(),
            key: w.key.clone(),
            trust: trust.clone(),
            executor: w.executor.clone(),
            models: config
                .models
                .iter()
                .flat_map(|m| std::iter::once(m.model_id.clone()).chain(m.aliases.iter().cloned()))
                .collect(),
            network: network.clone(),
            avoid: Default::default(),
            unreachable: Default::default(),
        })),
        _ => None,
    };
    let mirror = (config.role != Role::Worker).then(|| {
        crate::processing::mirror::start(keyspace.clone(), trust.clone(), node_id.clone(), network.clone())
    });
    let jobs_heard = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let client = NodeClient::new(
        cmd_tx,
        registry.clone(),
        keyspace.clone(),
        worker.clone(),
        network.clone(),
        trust.clone(),
        Arc::new(gcs_protocol::NodeKey::from_seed(identity.key.seed())),
    );
    let rt = Runtime {
        gateway: (config.role != Role::Worker).then(|| GatewayState::new(config.tracker.sit_out_ms)),
        worker,
        env: Env {
            processing,
            mirror,
            jobs_heard: jobs_heard.clone(),
            registration_id,
            identity,
            config,
            network: network.clone(),
            registry: registry.clone(),
            keyspace: keyspace.clone(),
        },
    };
    let task = tokio::spawn(rt.run(events, stop_rx, cmd_rx));
    Ok(NodeHandle {
        node_id,
        peer_id,
        network,
        registry,
        keyspace,
        stop: Some(stop_tx),
        task,
        client,
        jobs_heard,
        refused_usage: trust,
    })
}

impl Env {
    /// The gateway's view of the node; `local_worker` is this node's own
    /// worker (`--role all`).
    fn ctx<'a>(&'a self, local_worker: Option<&'a WorkerState>) -> Ctx<'a> {
        Ctx {
            key: &self.identity.key,
            network: &self.network,
            keyspace: &self.keyspace,
            registry: &self.registry,
            limits: &self.config.network.limits,
            tracker: self.config.tracker,
            local_worker,
            swarm_id: &self.config.swarm_id,
            trust: &self.config.network.tenant_trust,
        }
    }
}

impl Runtime {
    async fn on_command(&mut self, cmd: RuntimeCommand) {
        let ctx = self.env.ctx(self.worker.as_ref());
        match (cmd, self.gateway.as_mut()) {
            (RuntimeCommand::Submit(spec, reply), Some(g)) => {
                let r = g.submit(*spec, &ctx).await;
                let _ = reply.send(r);
            }
            (RuntimeCommand::Submit(_, reply), None) => {
                let _ = reply.send(Err(NodeError::NotAGateway));
            }
            (RuntimeCommand::Cancel(job, reason), Some(g)) => g.cancel(&job, reason, &ctx).await,
            (RuntimeCommand::Cancel(..), None) => {}
            (RuntimeCommand::RecordParent(p, reply), Some(_)) => {
                let _ = reply.send(crate::jobs::parent::store(&p, &ctx).await);
            }
            (RuntimeCommand::RecordParent(_, reply), None) => {
                let _ = reply.send(Err(NodeError::NotAGateway));
            }
        }
    }

    async fn on_job_request(&mut self, peer: PeerId, id: u64, req: JobRequest) {
        let env = &self.env;
        // Cancellations are for the worker side; everything else for the gateway.
        if let JobRequest::Envelope(bytes) = &req {
            if let Ok(Message::Cancellation(c)) =
                gcs_protocol::open(bytes, now_ms(), &env.config.network.limits)
            {
                let ok = crate::jobs::peer_of(&c.issued_by) == Some(peer)
                    && self.worker.as_ref().is_some_and(|w| w.on_cancel(&c));
                let resp = if ok {
                    JobResponse::Ack
                } else {
                    JobResponse::Refused("no such job here".into())
                };
                let _ = env.network.respond(id, resp).await;
                return;
            }
        }
        let resp = match self.gateway.as_mut() {
            Some(g) => g.on_request(peer, req, &env.ctx(self.worker.as_ref())).await,
            // A worker keeps the outputs it made: a tenant's gateway that
            // lost them with another gateway pulls them here (mirror.rs).
            None if matches!(req, JobRequest::MirrorPull(_)) => {
                let ctx = env.ctx(self.worker.as_ref());
                crate::processing::serve::answer(ctx.keyspace, ctx.trust, peer, &req)
            }
            None => JobResponse::Refused("not a gateway".into()),
        };
        let _ = env.network.respond(id, resp).await;
    }

    async fn run(
        mut self,
        mut events: mpsc::Receiver<NetEvent>,
        mut stop: oneshot::Receiver<()>,
        mut commands: mpsc::Receiver<RuntimeCommand>,
    ) {
        if let Some(g) = self.gateway.as_mut() {
            match g.recover(&self.env.ctx(self.worker.as_ref())).await {
                Ok(0) => {}
                Ok(n) => tracing::warn!(jobs = n, "ended jobs left in flight by the previous run"),
                Err(e) => tracing::error!(error = %e, "could not recover in-flight jobs"),
            }
        }
        self.env.publish_memberships().await;
        let is_worker = self.env.config.role.is_worker();
        let mut heartbeat = tokio::time::interval(self.env.config.heartbeat_interval);
        let mut prune = tokio::time::interval(Duration::from_secs(1));
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        // Retention (specs/keyspace.md) only holds if someone compacts.
        let mut compact = tokio::time::interval(Duration::from_secs(60));
        let mut compacting: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            tokio::select! {
                _ = &mut stop => break,
                Some(cmd) = commands.recv() => self.on_command(cmd).await,
                _ = tick.tick(), if self.gateway.is_some() => {
                    if let Some(g) = self.gateway.as_mut() {
                        g.tick(&self.env.ctx(self.worker.as_ref())).await;
                    }
                }
                ev = events.recv() => match ev {
                    Some(ev) => self.on_event(ev).await,
                    None => break,
                },
                _ = heartbeat.tick(), if is_worker => {
                    self.env.publish_registration(NodeStatus::Online, self.worker.as_ref()).await;
                }
                // A freed slot is news for gateways judging claims by load.
                _ = slot_freed(self.worker.as_ref()) => {
                    self.env.publish_registration(NodeStatus::Online, self.worker.as_ref()).await;
                }
                _ = compact.tick() => {
                    // Off the runtime task: a scan of every namespace must
                    // not hold up job events. One compaction at a time.
                    if compacting.as_ref().is_none_or(|h: &tokio::task::JoinHandle<()>| h.is_finished()) {
                        let ks = self.env.keyspace.clone();
                        compacting = Some(tokio::task::spawn_blocking(move || {
                            match ks.compact(now_ms()) {
                                Ok(stats) if !stats.removed.is_empty() => tracing::debug!(?stats, "keyspace compacted"),
                                Ok(_) => {}
                                Err(e) => tracing::warn!(error = %e, "keyspace compaction failed"),
                            }
                        }));
                    }
                }
                _ = prune.tick() => {
                    let gone = self.env.registry.lock().unwrap_or_else(|p| p.into_inner()).prune(now_ms());
                    for n in gone {
                        tracing::info!(node = %n, "registration expired");
                    }
                }
            }
        }
        if let Some(p) = &self.env.processing {
            p.stop();
        }
        if let Some(m) = self.env.mirror.take() {
            m.stop().await;
        }
        if is_worker {
            self.env.publish_registration(NodeStatus::Offline, self.worker.as_ref()).await;
            // Give the swarm a moment to flush the offline registration
            // before its connections close.
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        self.env.network.shutdown().await;
        tracing::info!("node stopped");
    }

    async fn on_event(&mut self, ev: NetEvent) {
        let env = &self.env;
        match ev {
            NetEvent::Message { message, topic, author, .. } => match *message {
                Message::ApiRequestJob(job) => {
                    env.jobs_heard.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if let Some(w) = &self.worker {
                        w.consider(job);
                    }
                }
                Message::NodeRegistration(reg) => env.on_registration(reg, &author),
                // Allowed on job topics by `topics::allows`, but answered
                // over direct streams: a gossiped copy carries no authority.
                Message::Requeue(_) | Message::Cancellation(_) => {
                    tracing::debug!(%topic, "gossiped requeue or cancellation ignored")
                }
                // Certificates travel inside registrations and as keyspace
                // records (`keys::membership`), never as gossip messages.
                Message::MembershipCertificate(_) | Message::MembershipRevocation(_) => {
                    tracing::debug!(%topic, "membership message on gossip ignored")
                }
                // Processing records travel as keyspace deltas
                // (processing/records.rs), never as gossip messages.
                Message::TaskLock(_) | Message::TaskResult(_) => {
                    tracing::debug!(%topic, "processing message on gossip ignored")
                }
                // Refused by topic validation before they get here.
                Message::JobClaim(_)
                | Message::ClaimRejection(_)
                | Message::LeaseGrant(_)
                | Message::LeaseRenewal(_)
                | Message::StreamChunk(_)
                | Message::FinalResult(_)
                | Message::UsageRecord(_) => {
                    tracing::debug!(%topic, "direct-stream message on gossip ignored")
                }
            },
            // A new subscriber to the capability topic: announce at once
            // rather than at the next heartbeat, so a worker that joins is
            // known within a round trip, not 10 s.
            NetEvent::PeerSubscribed { topic, .. } => {
                if topic == topics::CAPABILITIES_ALL && env.config.role.is_worker() {
                    env.publish_registration(NodeStatus::Online, self.worker.as_ref()).await;
                }
            }
            NetEvent::JobRequest { peer, id, request } => {
                self.on_job_request(peer, id, request).await
            }
            NetEvent::PeerDisconnected(peer) => {
                tracing::info!(%peer, "peer disconnected");
                if let Some(g) = self.gateway.as_mut() {
                    g.on_peer_disconnected(peer, &env.ctx(self.worker.as_ref())).await;
                }
            }
            NetEvent::Refused { topic, reason, penalised, source } => {
                tracing::warn!(%source, %topic, %reason, penalised, "refused gossip message");
            }
            NetEvent::PeerConnected(p) => tracing::info!(peer = %p, "peer connected"),
            NetEvent::Listening(_) => {}
        }
    }
}

impl Env {
    fn registration(
        &self,
        status: NodeStatus,
        worker: Option<&WorkerState>,
    ) -> Result<NodeRegistration, NodeError> {
        let now = now_ms();
        let ttl = self.config.registration_ttl.as_millis() as u64;
        let key = &self.identity.key;
        let registration_id = ids::new_id(ids::REGISTRATION, now)?;
        *self.registration_id.lock().unwrap_or_else(|p| p.into_inner()) = registration_id.clone();
        let models = &self.config.models;
        let serves = |t: gcs_protocol::ApiType| models.iter().any(|m| m.tasks.contains(&t));
        let mut reg = NodeRegistration {
            message_type: gcs_protocol::MessageType::NodeRegistration,
            version: PROTOCOL_VERSION,
            registration_id,
            node_id: key.node_id(),
            public_key: key.public_key(),
            swarm_id: self.config.swarm_id.clone(),
            tenant_id: self.config.private_tenant.clone(),
            status,
            capabilities: Capabilities {
                api_request_job: worker.is_some(),
                chat: serves(gcs_protocol::ApiType::ChatCompletion),
                completion: serves(gcs_protocol::ApiType::Completion),
                embedding: serves(gcs_protocol::ApiType::Embedding),
                streaming: true,
                processing_chunk_job: worker.is_some() && self.processing.is_some(),
                ..Default::default()
            },
            models: models.clone(),
            queue: QueueInfo {
                accepts_public_jobs: !(self.config.private_only
                    && self.config.private_tenant.is_some()),
                accepts_private_jobs: self.config.private_tenant.is_some(),
                accepts_local_only_jobs: self.config.swarm_id != PUBLIC_SWARM,
                max_concurrent_api_jobs: self.config.max_concurrent_jobs as u32,
                current_api_jobs: worker.map_or(0, |w| w.load()) as u32,
                free_kv_tokens: worker.map_or(0, |w| w.executor.free_kv_tokens()),
                decode_tokens_per_s: worker.map_or(0.0, |w| w.executor.decode_tokens_per_s()),
                accelerator: worker.and_then(|w| w.executor.accelerator()),
                max_concurrent_processing_jobs: self.processing.as_ref().map_or(0, |p| p.slots.max()) as u32,
                current_processing_jobs: self.processing.as_ref().map_or(0, |p| p.slots.running()) as u32,
                ..Default::default()
            },
            trust: Trust::default(),
            heartbeat: Heartbeat { created_at_ms: now, expires_at_ms: now + ttl, ttl_ms: ttl },
            addresses: vec![],
            memberships: crate::tenants::own_memberships(
                &self.keyspace,
                &key.node_id(),
                &self.config.memberships,
            ),
            signature: None,
        };
        sign(&mut reg, key)?;
        Ok(reg)
    }

    /// Stores and gossips this node's own certificates.
    async fn publish_memberships(&self) {
        for c in &self.config.memberships {
            let m = Message::MembershipCertificate(c.clone());
            if let Err(e) = crate::tenants::publish_statement(&self.keyspace, &self.network, &m).await {
                tracing::warn!(error = %e, "membership certificate not published");
            }
        }
    }

    async fn publish_registration(&self, status: NodeStatus, worker: Option<&WorkerState>) {
        let result = async {
            let reg = self.registration(status, worker)?;
            let bytes = gcs_protocol::encode(&reg)?;
            self.store_registration(&reg);
            // Gossip does not deliver our own messages: a gateway in the same
            // process (`--role all`) learns its worker here.
            self.registry.lock().unwrap_or_else(|p| p.into_inner()).accept(
                reg.clone(),
                Source::Own,
                now_ms(),
            );
            self.network.publish(topics::CAPABILITIES_ALL, bytes).await
        }
        .await;
        if let Err(e) = result {
            tracing::warn!(error = %e, "could not publish registration");
        }
    }

    /// A registration that `author` published (many node ids behind one
    /// author compete with each other in a full registry).
    fn on_registration(&self, reg: NodeRegistration, author: &PeerId) {
        let node = reg.node_id.clone();
        let models: Vec<String> = reg.models.iter().map(|m| m.model_id.clone()).collect();
        let own = crate::jobs::peer_of(&node).as_ref() == Some(author);
        let source = if own { Source::Own } else { Source::Peer(*author) };
        let outcome =
            self.registry.lock().unwrap_or_else(|p| p.into_inner()).accept(reg.clone(), source, now_ms());
        match outcome {
            Accepted::New => {
                tracing::info!(%node, ?models, %author, own, "worker registration arrived");
                self.store_registration(&reg);
            }
            // Encoded only when kept: outdated and stale copies (every
            // relayed heartbeat) cost nothing more.
            Accepted::Refreshed => self.store_registration(&reg),
            Accepted::Offline => tracing::info!(%node, "worker went offline"),
            Accepted::Outdated | Accepted::Stale => {}
            Accepted::Full => tracing::debug!(%node, "registry full: registration ignored"),
        }
    }

    fn store_registration(&self, reg: &NodeRegistration) {
        let key = gcs_keyspace::keys::registration(reg.node_id.as_str());
        let stored = gcs_protocol::encode(reg)
            .map_err(NodeError::from)
            .and_then(|b| self.keyspace.put(&key, b, now_ms()).map(drop).map_err(NodeError::from));
        if let Err(e) = stored {
            tracing::warn!(error = %e, "could not store registration");
        }
    }
}
