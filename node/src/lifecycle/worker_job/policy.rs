//! Which announced jobs a worker may win: its routing policy (mirroring
//! its registration, so it does not claim what the gateway must refuse),
//! the gateways it works for, and the models it serves.

use std::collections::BTreeSet;

use gcs_protocol::{ApiRequestJob, ModelInfo, NodeId, RoutingMode};

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

    /// The model `me` would serve `job` with, if it may claim it.
    pub fn admit<'m>(
        &self,
        job: &ApiRequestJob,
        me: &NodeId,
        models: &'m [ModelInfo],
    ) -> Option<&'m ModelInfo> {
        if !self.allows(job, me) {
            return None;
        }
        models
            .iter()
            .find(|m| m.answers_to(&job.request.model) && m.tasks.contains(&job.request.api_type))
    }
}
