//! Which announced jobs a worker may win: its routing policy (mirroring
//! its registration, so it does not claim what the gateway must refuse),
//! the gateways it works for, and the models it serves — for a
//! continuation, only with the engine build and model file it names.

use std::collections::BTreeSet;

use gcs_protocol::{ApiRequestJob, ContinuationOffer, ModelInfo, NodeId, RoutingMode};

use crate::topics::PUBLIC_SWARM;

/// The routing modes a worker can win.
#[derive(Clone, Debug)]
pub struct Policy {
    /// The tenant whose private node this is.
    pub private_tenant: Option<String>,
    /// Whether it takes public jobs.
    pub public: bool,
    /// Its swarm.
    pub swarm_id: String,
    /// The only gateways whose jobs it takes (`--gateways`); `None`: any
    /// gateway, each bounded by its share of the slots (`Slots`).
    pub gateways: Option<BTreeSet<NodeId>>,
    /// The gateways that attached it (`gateway_local` jobs).
    pub gateway_local: BTreeSet<NodeId>,
}

impl Default for Policy {
    /// A public node of the public swarm.
    fn default() -> Self {
        Self {
            private_tenant: None,
            public: true,
            swarm_id: PUBLIC_SWARM.into(),
            gateways: None,
            gateway_local: BTreeSet::new(),
        }
    }
}

impl Policy {
    /// Whether `me` may claim `job` under this policy.
    pub fn allows(&self, job: &ApiRequestJob, me: &NodeId) -> bool {
        let r = &job.routing;
        if r.excluded_nodes.contains(me) {
            return false;
        }
        if self.gateways.as_ref().is_some_and(|g| !g.contains(&job.gateway_node_id)) {
            return false;
        }
        let private = self.private_tenant.as_deref() == Some(job.tenant.tenant_id.as_str())
            && (r.allowed_nodes.is_empty() || r.allowed_nodes.contains(me));
        match r.network {
            RoutingMode::Public => self.public,
            RoutingMode::Private => private,
            // Public nodes wait for the re-announcement after the
            // private-first window; a claim before it is refused.
            RoutingMode::Hybrid => private || (self.public && job.announcement > 0),
            RoutingMode::LocalOnly => self.swarm_id != PUBLIC_SWARM && self.swarm_id == r.swarm_id,
            // Its gateway's own worker, or one that gateway attached.
            RoutingMode::GatewayLocal => {
                &job.gateway_node_id == me || self.gateway_local.contains(&job.gateway_node_id)
            }
        }
    }

    /// The model `me` would serve `job` with, if it may claim it. A job
    /// re-announced as an exact continuation (`requirements.continuation`)
    /// is served only by a model of exactly the offered engine build and
    /// model file hash: another build or file could not replay the
    /// delivered tokens bit for bit, and the gateway refuses its claim.
    pub fn admit<'m>(
        &self,
        job: &ApiRequestJob,
        me: &NodeId,
        models: &'m [ModelInfo],
    ) -> Option<&'m ModelInfo> {
        if !self.allows(job, me) {
            return None;
        }
        let offer = job.requirements.continuation.as_ref();
        models.iter().find(|m| {
            m.answers_to(&job.request.model)
                && m.tasks.contains(&job.request.api_type)
                && offer.is_none_or(|o| continues(m, o))
        })
    }
}

/// Whether `m` may continue a stream under `offer`: the same engine build
/// and the same (known, non-empty) model file hash.
pub fn continues(m: &ModelInfo, offer: &ContinuationOffer) -> bool {
    !m.model_hash.is_empty()
        && m.model_hash == offer.model_hash
        && !m.engine_build.is_empty()
        && m.engine_build == offer.engine_build
}
