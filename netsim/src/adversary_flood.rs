//! `netsim adversary --attacks flood --flood-rate N`: a steady stream of
//! validly signed gossip for the whole run (the soak's flooder, issue 15).
//! Three kinds in turn, `N` messages a second in all:
//!
//! - **registrations** by [`SYBILS`] sybil keys, each a copy of the honest
//!   worker's (its model, fresh heartbeat), so the gateway's registry and
//!   catalogue see a crowd of workers that never claim;
//! - **job announcements** signed by the flooder as their gateway, for the
//!   honest model: workers weigh them and claim, and the flooder answers
//!   every claim with a plain acknowledgement (no lease), so the honest
//!   workers spend a claim round trip on each and run none;
//! - **usage records** of made-up jobs of the gateway's tenant (`netsim`),
//!   signed by the flooder as the recording gateway, as keyspace deltas on
//!   the tenant's usage topic: the honest gateway must refuse them (the
//!   flooder is no gateway of that tenant).
//!
//! What was sent is counted (`flood_*` in adversary.json, flushed once a
//! second); what the gateway made of it is in its /metrics.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gcs_keyspace::Keyspace;
use gcs_node::jobs::wire::{JobRequest, JobResponse};
use gcs_node::{now_ms, Network};
use gcs_protocol::{
    encode, ids, sign, ApiType, JobLimits, NodeKey, NodeRegistration, Routing,
};

/// Sybil identities whose registrations the flood rotates through (the
/// gateway's registry holds at most this many extra entries from it).
pub const SYBILS: usize = 16;
/// The tenant whose usage topic the forged records go to (netsim's keys).
pub const TENANT: &str = "netsim";

/// Kinds a flood run must have sent.
pub const REQUIRED: [&str; 3] = ["flood_registration", "flood_job", "flood_usage"];

/// Counts to add to the adversary's report.
pub type Flush = Arc<dyn Fn(&BTreeMap<String, u64>) + Send + Sync>;

/// The flooder.
pub struct Flooder {
    key: NodeKey,
    net: Network,
    ks: Arc<Keyspace>,
    sybils: Vec<NodeKey>,
    rate: u32,
    counts: Mutex<BTreeMap<String, u64>>,
}

impl std::fmt::Debug for Flooder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flooder").field("rate", &self.rate).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Flooder {
    /// A flooder signing jobs and usage as `key`, `rate` messages a second.
    pub fn new(key: NodeKey, net: Network, ks: Arc<Keyspace>, rate: u32) -> anyhow::Result<Self> {
        let sybils = (0..SYBILS).map(|_| NodeKey::generate()).collect::<Result<_, _>>()?;
        Ok(Self { key, net, ks, sybils, rate: rate.max(1), counts: Mutex::default() })
    }

    fn count(&self, kind: &str, ok: bool) {
        let mut c = lock(&self.counts);
        *c.entry(kind.into()).or_default() += u64::from(ok);
        *c.entry(if ok { "flood_sent" } else { "flood_publish_failed" }.into()).or_default() += 1;
    }

    /// Floods until the process is killed, copying `template` (an honest
    /// worker's registration) once one is known. Counts go to `flush`
    /// once a second.
    pub async fn run(
        self: Arc<Self>,
        template: impl Fn() -> Option<NodeRegistration> + Send + 'static,
        flush: Flush,
    ) {
        // Ticks of 100 ms; the rate spread over them (at least one each).
        let per_tick = self.rate.div_ceil(10);
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut n: u64 = 0;
        loop {
            tick.tick().await;
            let Some(t) = template() else { continue };
            for _ in 0..per_tick {
                match n % 3 {
                    0 => self.registration(&t, n).await,
                    1 => self.job(&t).await,
                    _ => self.usage(&t).await,
                }
                n += 1;
            }
            if n % (u64::from(per_tick) * 10) < u64::from(per_tick) {
                flush(&std::mem::take(&mut *lock(&self.counts)));
            }
        }
    }

    async fn publish(&self, kind: &str, topic: &str, bytes: Option<Vec<u8>>) {
        let ok = match bytes {
            Some(b) => self.net.publish(topic, b).await.is_ok(),
            None => false,
        };
        self.count(kind, ok);
    }

    async fn registration(&self, template: &NodeRegistration, n: u64) {
        let k = &self.sybils[(n / 3) as usize % SYBILS];
        let r = crate::adversary_sybil::resign(template, k, now_ms(), |_| {});
        let bytes = r.and_then(|r| encode(&r).ok());
        self.publish("flood_registration", gcs_node::topics::CAPABILITIES_ALL, bytes).await;
    }

    async fn job(&self, template: &NodeRegistration) {
        let Some(model) = template.models.first() else { return };
        // Never fetched (no claim is granted): any bytes do.
        let body = b"netsim flood".to_vec();
        let spec = gcs_node::jobs::JobSpec {
            api_type: ApiType::ChatCompletion,
            model: model.model_id.clone(),
            stream: true,
            body: body.clone(),
            tenant_id: "netsim-flood".into(),
            project_id: "p".into(),
            api_key_id: "k".into(),
            idempotency_key: "i".into(),
            limits: JobLimits::default(),
            max_output_tokens: 16,
            routing: Routing::public(),
            batch_id: None,
            parent: None,
            price_percent: None,
        };
        let bytes = gcs_node::jobs::announce::build_job(&spec, &self.key, &body, now_ms())
            .ok()
            .and_then(|j| encode(&j).ok());
        self.publish("flood_job", gcs_node::topics::API_JOBS_ALL, bytes).await;
    }

    async fn usage(&self, template: &NodeRegistration) {
        let now = now_ms();
        let p = gcs_protocol::samples::Params { now_ms: now, ..Default::default() };
        let mut u = gcs_protocol::samples::usage(&self.key, &self.key, &p);
        let delta = (|| {
            u.job_id = ids::new_id(ids::JOB, now).ok()?;
            u.tenant_id = TENANT.into();
            u.node_id = Some(template.node_id.clone());
            u.created_at_ms = now;
            sign(&mut u, &self.key).ok()?;
            let key = gcs_keyspace::keys::usage(&u.job_id);
            self.ks.put(&key, encode(&u).ok()?, now).ok()
        })();
        let topic = gcs_node::topics::tenant_usage(TENANT);
        self.publish("flood_usage", &topic, delta.map(|d| d.encode())).await;
    }

    /// Its answer to a direct request: every claim (on its own jobs or
    /// any other) is acknowledged and never granted.
    pub fn answer(&self, _req: &JobRequest) -> JobResponse {
        JobResponse::Ack
    }
}
