//! `netsim adversary`: a misbehaving peer *process*. It joins the swarm with
//! the node library's own network stack (libp2p TCP + Noise + Yamux,
//! gossipsub, the `/gcs/job/1.0.0` direct protocol), registers like a worker
//! (copying an honest worker's model list), and during real streams sends
//! over the wire:
//!
//! - forged registrations on gossip (tampered signature, an impostor using
//!   an honest node's id, expired, future-dated; model ids
//!   [`FORGED_MODELS`]); a tampered registration and a replayed (old) honest
//!   one in its own keyspace, offered to peers through anti-entropy, and
//!   honest registrations re-published on gossip once they are older than
//!   gossipsub's duplicate window;
//! - forged claims (signed by a key other than the sender's, tampered,
//!   expired) and replayed claims (its own, for this and for earlier jobs);
//! - on every other job it wins (it claims two jobs in three), its own stream — `adv0 adv1 …`
//!   ([`output_text`]) — with duplicated, reordered and delayed chunks,
//!   forged copies (tampered, signed by another key, under a made-up lease,
//!   a validly signed conflicting copy of a delivered sequence), replays of
//!   earlier chunks and of other jobs' chunks, a second finish, and chunks
//!   after the result;
//! - on the other jobs it wins, it stalls: the gateway requeues
//!   the job to an honest worker, and the adversary then streams under its
//!   revoked lease into the live job;
//! - on the jobs it does not claim or loses, chunks under made-up
//!   leases and chunks impersonating the honest worker.
//!
//! Every attempt is counted in `<data-dir>/adversary.json` (rewritten after
//! each change); the scenario checks that each kind in [`REQUIRED`] really
//! happened, that no forged or replayed claim was granted a lease, and,
//! through the clients, that every stream is one worker's output.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gcs_keyspace::{Keyspace, KeyspaceOptions};
use gcs_node::jobs::peer_of;
use gcs_node::jobs::wire::{JobRequest, JobResponse};
use gcs_node::{now_ms, Identity, NetEvent, Network, NetworkConfig};
use gcs_protocol::{
    encode, ids, open, sign, ApiRequestJob, Attestation, Delta, FinalResult, FinishReason, Hash32,
    JobClaim, LeaseGrant, Limits, Message, MessageType, Metering, NodeKey,
    NodeRegistration, ResponseBody, ResultStatus, StreamChunk, UsageDelta,
    PROTOCOL_VERSION,
};
use libp2p::PeerId;
use tokio::sync::Notify;

mod disk_fill;
pub use disk_fill::{dir_bytes, disk_required, DISK_REQUIRED};

/// Content chunks of the adversary's own answer (fewer if `max_tokens` is).
pub const TOKENS: u32 = 12;

/// What the adversary streams for a request with `max_tokens`: the client
/// must see exactly this (or a prefix) when the adversary served it.
pub fn output_text(max_tokens: u32) -> String {
    (0..max_tokens.min(TOKENS)).map(|i| format!("adv{i} ")).collect()
}

/// Model ids only forged registrations carry.
pub const FORGED_MODELS: [&str; 5] = [
    "netsim-forged-tampered",
    "netsim-forged-impostor",
    "netsim-forged-expired",
    "netsim-forged-future",
    "netsim-forged-anti-entropy",
];

/// Attack kinds a scenario run must have carried out.
pub const REQUIRED: [&str; 12] = [
    "registration_forged",
    "registration_replayed",
    "claim_forged",
    "claim_replayed",
    "stream_won",
    "chunk_duplicate",
    "chunk_reordered",
    "chunk_delayed",
    "chunk_replayed",
    "chunk_forged",
    "chunk_stale_lease_live",
    "chunk_outsider_live",
];

/// Kinds that must stay at zero: a forged or replayed claim that got a lease.
pub const FORBIDDEN: [&str; 2] = ["claim_forged_granted", "claim_replayed_granted"];

const REPORT: &str = "adversary.json";

/// The counts an adversary wrote into its data directory.
pub fn read_report(dir: &Path) -> BTreeMap<String, u64> {
    std::fs::read(dir.join(REPORT))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Command-line settings.
#[derive(Clone, Debug)]
pub struct Args {
    /// Identity, keyspace and report.
    pub data_dir: PathBuf,
    /// libp2p listen address.
    pub listen: String,
    /// Peers to dial.
    pub bootstrap: Vec<String>,
    /// Which attacks: `wire` (above), `trust` ([`crate::adversary_trust`])
    /// or `flood` ([`crate::adversary_flood`]).
    pub attacks: Attacks,
    /// Messages a second of the `flood` attacks.
    pub flood_rate: u32,
}

/// The attack sets of one adversary run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Attacks {
    /// Forged, replayed and disorderly messages (this module).
    #[default]
    Wire,
    /// Catalogue poisoning and a fake gateway's flood (`adversary_trust`).
    Trust,
    /// A steady stream of signed gossip at a set rate (`adversary_flood`).
    Flood,
}

/// The report key that says a run made the trust attacks.
pub const TRUST_MODE: &str = "mode_trust";

/// The kinds a run with this report must have carried out.
pub fn required(report: &BTreeMap<String, u64>) -> &'static [&'static str] {
    if report.contains_key(TRUST_MODE) {
        &crate::adversary_trust::REQUIRED
    } else {
        &REQUIRED
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Adv {
    key: NodeKey,
    /// A second identity: signs what the adversary sends as someone else.
    other: NodeKey,
    net: Network,
    limits: Limits,
    dir: PathBuf,
    counts: Mutex<BTreeMap<String, u64>>,
    reg_id: Mutex<String>,
    /// An honest worker's registration: models and capabilities to copy.
    template: Mutex<Option<NodeRegistration>>,
    /// Honest registrations heard (arrival time, bytes) for replay.
    heard: Mutex<Vec<(u64, Vec<u8>)>>,
    old_claims: Mutex<Vec<Vec<u8>>>,
    old_chunks: Mutex<Vec<Vec<u8>>>,
    /// Jobs this adversary stalls on, woken when the job is re-announced.
    stalled: Mutex<HashMap<String, Arc<Notify>>>,
    rounds: Mutex<u64>,
    /// Leases won so far: even wins stream disorderly, odd ones stall.
    wins: Mutex<u64>,
}

/// Runs the adversary until it is killed.
pub fn run(args: Args) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(main_loop(args))
}

fn models_named(template: &NodeRegistration, name: &str) -> Vec<gcs_protocol::ModelInfo> {
    template
        .models
        .iter()
        .take(1)
        .map(|m| {
            let mut m = m.clone();
            m.model_id = name.into();
            m.aliases.clear();
            m
        })
        .collect()
}

async fn main_loop(args: Args) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.data_dir)?;
    let identity = Identity::load_or_create(&args.data_dir)?;
    let ks = Keyspace::open(
        &args.data_dir.join("keyspace"),
        identity.node_id().as_str(),
        KeyspaceOptions::default(),
    )?;
    let mut cfg = NetworkConfig { mdns: false, ..NetworkConfig::default() };
    cfg.listen = vec![args.listen.parse()?];
    cfg.bootstrap = args.bootstrap.iter().map(|b| b.parse()).collect::<Result<_, _>>()?;
    let key = NodeKey::from_seed(identity.key.seed());
    let ks = Arc::new(ks);
    let (net, mut events) = Network::start(&identity, cfg, ks.clone()).await?;
    for t in [gcs_node::topics::CAPABILITIES_ALL, gcs_node::topics::API_JOBS_ALL] {
        net.subscribe(t).await?;
    }
    let adv = Arc::new(Adv {
        key,
        other: NodeKey::generate()?,
        net: net.clone(),
        limits: Limits::default(),
        dir: args.data_dir.clone(),
        counts: Mutex::default(),
        reg_id: Mutex::new(ids::new_id(ids::REGISTRATION, now_ms())?),
        template: Mutex::default(),
        heard: Mutex::default(),
        old_claims: Mutex::default(),
        old_chunks: Mutex::default(),
        stalled: Mutex::default(),
        rounds: Mutex::default(),
        wins: Mutex::default(),
    });
    adv.save();
    let trust = match args.attacks {
        Attacks::Trust => {
            adv.bump(TRUST_MODE);
            let a = adv.clone();
            let bump = Arc::new(move |k: &str| a.bump(k));
            let key = NodeKey::from_seed(adv.key.seed());
            Some(Arc::new(crate::adversary_trust::Rogue::new(key, net.clone(), ks.clone(), bump)?))
        }
        Attacks::Wire | Attacks::Flood => None,
    };
    let flooder = match args.attacks {
        Attacks::Flood => {
            let key = NodeKey::from_seed(adv.key.seed());
            let rate = args.flood_rate;
            let f = crate::adversary_flood::Flooder::new(key, net.clone(), ks.clone(), rate)?;
            let f = Arc::new(f);
            let (a, b) = (adv.clone(), adv.clone());
            let template = move || lock(&a.template).clone();
            let flush = Arc::new(move |c: &BTreeMap<String, u64>| b.add(c));
            tokio::spawn(f.clone().run(template, flush));
            Some(f)
        }
        Attacks::Wire | Attacks::Trust => None,
    };
    // The disk-fill attack runs as its own identity (disk_fill.rs), with
    // the wire attacks.
    let filler = match args.attacks {
        Attacks::Wire => Some(Arc::new(
            disk_fill::Filler::start(&args.data_dir, &args.listen, &args.bootstrap).await?,
        )),
        Attacks::Trust | Attacks::Flood => None,
    };
    let mut tick = tokio::time::interval(Duration::from_secs(3));
    let mut seen: HashSet<String> = HashSet::new();
    let mut index = 0u64;
    let me = adv.key.node_id();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let a = adv.clone();
                let ks = ks.clone();
                match (&trust, lock(&adv.template).clone()) {
                    (Some(t), Some(template)) => {
                        let t = t.clone();
                        tokio::spawn(async move { t.round(&template).await });
                    }
                    (Some(_), None) => {}
                    (None, _) if flooder.is_some() => {}
                    (None, _) => {
                        tokio::spawn(async move { a.heartbeat(&ks).await });
                    }
                }
                if let Some(f) = filler.clone() {
                    let a = adv.clone();
                    tokio::spawn(async move { f.tick(&a).await });
                }
            }
            ev = events.recv() => match ev {
                None => break,
                Some(NetEvent::Message { message, .. }) => match *message {
                    Message::NodeRegistration(r) if r.node_id != me => {
                        let first = {
                            let mut t = lock(&adv.template);
                            let first = t.is_none() && r.capabilities.api_request_job;
                            if first {
                                *t = Some(r.clone());
                            }
                            first
                        };
                        if let Ok(b) = encode(&r) {
                            let mut heard = lock(&adv.heard);
                            if heard.len() >= 64 {
                                heard.remove(0);
                            }
                            heard.push((now_ms(), b));
                        }
                        if first {
                            adv.publish_own().await;
                        }
                    }
                    Message::ApiRequestJob(job) => {
                        if let Some(t) = trust.as_ref().filter(|_| !seen.contains(&job.job_id)) {
                            t.heard(&job);
                        }
                        if !seen.insert(job.job_id.clone()) {
                            // A re-announcement: a job we stalled on was requeued.
                            if let Some(n) = lock(&adv.stalled).get(&job.job_id) {
                                n.notify_one();
                            }
                            continue;
                        }
                        if lock(&adv.template).is_none() || trust.is_some() || flooder.is_some() {
                            continue;
                        }
                        let mode = index % 3;
                        index += 1;
                        let a = adv.clone();
                        tokio::spawn(async move { a.job(job, mode).await });
                    }
                    _ => {}
                },
                // Cancellations from the gateway: taken, and ignored.
                Some(NetEvent::JobRequest { id, request, .. }) => {
                    let answer = trust
                        .as_ref()
                        .and_then(|t| t.answer(&request))
                        .or_else(|| flooder.as_ref().map(|f| f.answer(&request)));
                    let _ = net.respond(id, answer.unwrap_or(JobResponse::Ack)).await;
                }
                Some(NetEvent::PeerSubscribed { topic, .. })
                    if topic == gcs_node::topics::CAPABILITIES_ALL =>
                {
                    adv.publish_own().await;
                }
                Some(_) => {}
            }
        }
    }
    Ok(())
}

impl Adv {
    fn bump(&self, kind: &str) {
        *lock(&self.counts).entry(kind.to_string()).or_default() += 1;
        self.save();
    }

    /// Adds a batch of counts (one report write for all of them).
    fn add(&self, batch: &BTreeMap<String, u64>) {
        let mut c = lock(&self.counts);
        for (k, n) in batch {
            *c.entry(k.clone()).or_default() += n;
        }
        drop(c);
        self.save();
    }

    fn save(&self) {
        let text = serde_json::to_vec_pretty(&*lock(&self.counts)).unwrap_or_default();
        let tmp = self.dir.join(format!("{REPORT}.tmp"));
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(tmp, self.dir.join(REPORT));
        }
    }

    async fn send(&self, gw: PeerId, bytes: Vec<u8>) -> Option<JobResponse> {
        self.net.request(gw, JobRequest::Envelope(bytes)).await.ok()
    }

    fn own_registration(&self) -> Option<NodeRegistration> {
        let t = lock(&self.template).clone()?;
        // Admitted to nothing: the template's certificates are dropped.
        let r = crate::adversary_sybil::resign(&t, &self.key, now_ms(), |r| {
            r.queue.max_concurrent_api_jobs = 64
        })?;
        *lock(&self.reg_id) = r.registration_id.clone();
        Some(r)
    }

    async fn publish_own(&self) {
        if let Some(b) = self.own_registration().and_then(|r| encode(&r).ok()) {
            let _ = self.net.publish(gcs_node::topics::CAPABILITIES_ALL, b).await;
        }
    }

    /// A registration for `key` carrying only the forged model `name`.
    fn registration_for(
        &self,
        key: &NodeKey,
        name: &str,
        created: u64,
    ) -> Option<NodeRegistration> {
        let t = lock(&self.template).clone()?;
        crate::adversary_sybil::resign(&t, key, created, |r| r.models = models_named(&t, name))
    }

    /// Every 3 s: its own registration; every third round also the forged
    /// ones (few enough that peer scoring does not graylist it, so its
    /// honest-looking heartbeats still count) and replays.
    async fn heartbeat(&self, ks: &Keyspace) {
        self.publish_own().await;
        let round = {
            let mut r = lock(&self.rounds);
            *r += 1;
            *r
        };
        let Some(t) = lock(&self.template).clone() else { return };
        if round % 3 != 1 {
            return;
        }
        let now = now_ms();
        let mut forged = vec![];
        // Tampered after signing.
        if let Some(mut r) = self.registration_for(&self.other, "netsim-original", now) {
            r.models = models_named(&t, FORGED_MODELS[0]);
            forged.push(r);
        }
        // An impostor: an honest node's id, signed with the adversary's key.
        if let Some(mut r) = self.registration_for(&self.key, FORGED_MODELS[1], now) {
            r.node_id = t.node_id.clone();
            r.public_key = t.public_key;
            forged.push(r);
        }
        // Validly signed by fresh keys, but expired / from the future.
        if let Ok(k) = NodeKey::generate() {
            forged.extend(self.registration_for(&k, FORGED_MODELS[2], now - 90_000));
        }
        if let Ok(k) = NodeKey::generate() {
            forged.extend(self.registration_for(&k, FORGED_MODELS[3], now + 60_000));
        }
        for r in forged {
            if let Ok(b) = encode(&r) {
                let _ = self.net.publish(gcs_node::topics::CAPABILITIES_ALL, b).await;
                self.bump("registration_forged");
            }
        }
        // A tampered registration in its keyspace: peers pull it by anti-entropy.
        if let Some(mut r) = self.registration_for(&self.other, "netsim-original", now) {
            r.models = models_named(&t, FORGED_MODELS[4]);
            if let Ok(b) = encode(&r) {
                let key = gcs_keyspace::keys::registration(r.node_id.as_str());
                if ks.put(&key, b, now).is_ok() {
                    self.bump("registration_forged_anti_entropy");
                }
            }
        }
        // Replays. On gossip, a registration heard less than gossipsub's
        // duplicate window (60 s) ago is dropped by the adversary's own
        // gossipsub as already seen, so only older ones really go out.
        let heard: Vec<(u64, Vec<u8>)> = lock(&self.heard).clone();
        let stale = heard.iter().filter(|(at, _)| now.saturating_sub(*at) > 65_000).take(2);
        for (_, b) in stale {
            let _ = self.net.publish(gcs_node::topics::CAPABILITIES_ALL, b.clone()).await;
            self.bump("registration_replayed_gossip");
        }
        // Through anti-entropy: the oldest honest registration heard, stored
        // in its own keyspace under the honest node's key with a newer write
        // time, for peers to pull.
        if let Some((_, b)) = heard.first() {
            if let Ok(Message::NodeRegistration(r)) = gcs_protocol::decode(b, &self.limits) {
                let key = gcs_keyspace::keys::registration(r.node_id.as_str());
                if ks.put(&key, b.clone(), now).is_ok() {
                    self.bump("registration_replayed");
                }
            }
        }
    }

    fn claim(&self, job: &ApiRequestJob, key: &NodeKey, created: u64) -> Option<JobClaim> {
        let t = lock(&self.template).clone()?;
        let model = t.model(&job.request.model)?;
        let reg = lock(&self.reg_id).clone();
        gcs_node::lifecycle::worker_job::signed_claim(&job.job_id, model, key, reg, created).ok()
    }

    /// Sends a claim; the lease if one was granted.
    async fn send_claim(&self, gw: PeerId, bytes: Vec<u8>) -> Option<LeaseGrant> {
        match self.send(gw, bytes).await? {
            JobResponse::Envelope(b) => match open(&b, now_ms(), &self.limits).ok()? {
                Message::LeaseGrant(l) => Some(l),
                _ => None,
            },
            _ => None,
        }
    }

    async fn forged_claims(&self, gw: PeerId, job: &ApiRequestJob) {
        let now = now_ms();
        let mut forged = vec![];
        // Validly signed, by a key that is not the sender's.
        forged.extend(self.claim(job, &self.other, now));
        // Tampered after signing.
        if let Some(mut c) = self.claim(job, &self.key, now) {
            c.claim_id = ids::new_id(ids::CLAIM, now + 1).unwrap_or_default();
            forged.push(c);
        }
        // Expired.
        forged.extend(self.claim(job, &self.key, now - 70_000));
        for c in forged {
            let Ok(b) = encode(&c) else { continue };
            let granted = self.send_claim(gw, b).await.is_some();
            self.bump(if granted { "claim_forged_granted" } else { "claim_forged" });
        }
    }

    async fn replay_claims(&self, gw: PeerId, current: Option<Vec<u8>>) {
        let old: Vec<Vec<u8>> = lock(&self.old_claims).iter().rev().take(2).cloned().collect();
        for b in old.into_iter().chain(current) {
            let granted = self.send_claim(gw, b).await.is_some();
            self.bump(if granted { "claim_replayed_granted" } else { "claim_replayed" });
        }
    }

    fn chunk(
        &self,
        job: &ApiRequestJob,
        key: &NodeKey,
        lease_id: &str,
        seq: u64,
        text: Option<String>,
        finish: Option<FinishReason>,
    ) -> Option<StreamChunk> {
        let mut c = StreamChunk {
            message_type: MessageType::StreamChunk,
            version: PROTOCOL_VERSION,
            job_id: job.job_id.clone(),
            node_id: key.node_id(),
            lease_id: lease_id.into(),
            sequence: seq,
            delta: Delta {
                role: (seq == 0).then(|| "assistant".to_string()),
                content: text.clone(),
                ..Default::default()
            },
            usage_delta: UsageDelta { output_tokens: u32::from(text.is_some()) },
            finish_reason: finish,
            created_at_ms: now_ms(),
            signature: None,
        };
        sign(&mut c, key).ok()?;
        Some(c)
    }

    async fn job(self: Arc<Self>, job: ApiRequestJob, mode: u64) {
        let Some(gw) = peer_of(&job.gateway_node_id) else { return };
        if mode == 2 {
            // Let an honest worker win and start, then attack its stream.
            tokio::time::sleep(Duration::from_millis(300)).await;
            self.outsider(gw, &job).await;
            let late = self.claim(&job, &self.key, now_ms()).and_then(|c| encode(&c).ok());
            self.replay_claims(gw, late).await;
            return;
        }
        let Some(claim) = self.claim(&job, &self.key, now_ms()) else { return };
        let Ok(claim_bytes) = encode(&claim) else { return };
        let lease = self.send_claim(gw, claim_bytes.clone()).await;
        self.forged_claims(gw, &job).await;
        let stream = lease.is_some() && {
            let mut w = lock(&self.wins);
            *w += 1;
            *w % 2 == 1
        };
        match lease {
            Some(l) if stream => {
                self.bump("stream_won");
                self.replay_claims(gw, Some(claim_bytes.clone())).await;
                self.rogue_stream(gw, &job, &claim, &l).await;
            }
            Some(l) => {
                self.bump("stall_won");
                self.stall(gw, &job, &l).await;
            }
            None => {
                self.bump("claim_lost");
                self.outsider(gw, &job).await;
            }
        }
        let mut old = lock(&self.old_claims);
        old.push(claim_bytes);
        let excess = old.len().saturating_sub(16);
        old.drain(..excess);
    }

    async fn send_chunk(&self, gw: PeerId, c: &StreamChunk) -> Option<JobResponse> {
        self.send(gw, encode(c).ok()?).await
    }

    /// The adversary holds the lease: its own answer, delivered disorderly.
    async fn rogue_stream(
        &self,
        gw: PeerId,
        job: &ApiRequestJob,
        claim: &JobClaim,
        lease: &LeaseGrant,
    ) {
        let n = u64::from(job.requirements.max_output_tokens.clamp(1, TOKENS));
        if n < 9 {
            self.bump("stream_too_short");
        }
        let l = lease.lease_id.as_str();
        let c: Vec<StreamChunk> = (0..n)
            .filter_map(|i| self.chunk(job, &self.key, l, i, Some(format!("adv{i} ")), None))
            .collect();
        let Some(finish) = self.chunk(job, &self.key, l, n, None, Some(FinishReason::Length))
        else {
            return;
        };
        let sleep = |ms| tokio::time::sleep(Duration::from_millis(ms));
        let at = |i: usize| c.get(i).cloned();
        let send = |x: Option<StreamChunk>| async move {
            if let Some(x) = x {
                let _ = self.send_chunk(gw, &x).await;
            }
        };
        send(at(0)).await;
        send(at(0)).await;
        self.bump("chunk_duplicate");
        send(at(2)).await;
        send(at(1)).await;
        self.bump("chunk_reordered");
        send(at(3)).await;
        // Forged sequence-4 chunks: tampered, signed by another key, under
        // a made-up lease.
        if let Some(mut x) = at(4) {
            x.delta.content = Some("FORGED ".into());
            send(Some(x)).await;
            self.bump("chunk_forged");
        }
        send(self.chunk(job, &self.other, l, 4, Some("OTHER ".into()), None)).await;
        self.bump("chunk_forged");
        let fake = ids::new_id(ids::LEASE, now_ms()).unwrap_or_default();
        send(self.chunk(job, &self.key, &fake, 4, Some("FAKELEASE ".into()), None)).await;
        self.bump("chunk_forged");
        send(at(4)).await;
        // A validly signed conflicting copy of a delivered sequence.
        send(self.chunk(job, &self.key, l, 4, Some("CONFLICT ".into()), None)).await;
        self.bump("chunk_forged");
        // Delayed: 7 and 6 wait for 5 within the gateway's reorder window.
        send(at(7)).await;
        sleep(60).await;
        send(at(6)).await;
        sleep(60).await;
        send(at(5)).await;
        self.bump("chunk_delayed");
        for i in 8..n as usize {
            send(at(i)).await;
        }
        // Replays: earlier chunks of this stream, and chunks of earlier jobs.
        send(at(1)).await;
        send(at(3)).await;
        self.bump("chunk_replayed");
        let old: Vec<Vec<u8>> = lock(&self.old_chunks).iter().rev().take(2).cloned().collect();
        for b in old {
            let _ = self.send(gw, b).await;
            self.bump("chunk_replayed_other_job");
        }
        send(Some(finish.clone())).await;
        send(Some(finish)).await;
        self.bump("chunk_duplicate");
        let text = output_text(n as u32);
        let response = Some(ResponseBody {
            format: format!("openai.{}", job.request.api_type),
            body: serde_json::json!({"object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            ]}),
        });
        let result_hash = Hash32::of(&serde_json::to_vec(&response).unwrap_or_default());
        let mut r = FinalResult {
            message_type: MessageType::FinalResult,
            version: PROTOCOL_VERSION,
            job_id: job.job_id.clone(),
            node_id: self.key.node_id(),
            lease_id: Some(lease.lease_id.clone()),
            status: ResultStatus::Completed,
            response,
            error: None,
            metering: Some(Metering {
                input_tokens: 1,
                output_tokens: n,
                tokens_sent_to_client: n,
                cached_tokens: 0,
                compute_ms: 1,
                first_token_ms: 1,
                child_jobs: 0,
                cost_gnus: "0".into(),
            }),
            attestation: Some(Attestation {
                claim_id: claim.claim_id.clone(),
                registration_id: claim.registration_id.clone(),
                result_hash,
            }),
            chunks_sent: n + 1,
            created_at_ms: now_ms(),
            signature: None,
        };
        if sign(&mut r, &self.key).is_ok() {
            if let Ok(b) = encode(&r) {
                let _ = self.send(gw, b).await;
            }
        }
        // After the end.
        send(at(2)).await;
        self.bump("chunk_replayed");
        let mut old = lock(&self.old_chunks);
        old.extend(c.iter().take(4).filter_map(|x| encode(x).ok()));
        let excess = old.len().saturating_sub(16);
        old.drain(..excess);
    }

    /// Holds the lease without streaming until the job is requeued, then
    /// streams into the live job under the revoked lease.
    async fn stall(&self, gw: PeerId, job: &ApiRequestJob, lease: &LeaseGrant) {
        let woken = Arc::new(Notify::new());
        lock(&self.stalled).insert(job.job_id.clone(), woken.clone());
        let requeued =
            tokio::time::timeout(Duration::from_secs(40), woken.notified()).await.is_ok();
        lock(&self.stalled).remove(&job.job_id);
        if !requeued {
            self.bump("stall_never_requeued");
            return;
        }
        // At once: the honest worker that takes over may finish a short job
        // within a few hundred ms, and the attack is on the live job (the
        // gateway acknowledges, the fence drops).
        tokio::time::sleep(Duration::from_millis(20)).await;
        let n = u64::from(TOKENS);
        for i in 0..200u64 {
            let Some(c) = self.chunk(
                job,
                &self.key,
                &lease.lease_id,
                i % n,
                Some(format!("STALE{i} ")),
                None,
            ) else {
                return;
            };
            match self.send_chunk(gw, &c).await {
                Some(JobResponse::Ack) => self.bump("chunk_stale_lease_live"),
                _ => break,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// An honest worker streams: chunks under made-up leases and chunks
    /// that claim to be the honest worker's, until the job ends.
    async fn outsider(&self, gw: PeerId, job: &ApiRequestJob) {
        let honest = lock(&self.template).as_ref().map(|t| t.node_id.clone());
        for i in 0..150u64 {
            let fake = ids::new_id(ids::LEASE, now_ms()).unwrap_or_default();
            let Some(c) = self.chunk(job, &self.key, &fake, i % 4, Some(format!("OUT{i} ")), None)
            else {
                return;
            };
            match self.send_chunk(gw, &c).await {
                Some(JobResponse::Ack) => self.bump("chunk_outsider_live"),
                _ => break,
            }
            if let (Some(h), Some(mut x)) = (honest.clone(), Some(c)) {
                // Impersonation: the honest node's id, the adversary's signature.
                x.node_id = h;
                let _ = self.send_chunk(gw, &x).await;
                self.bump("chunk_forged");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
