//! First-valid-claim validation (26.12.1): a claim wins only if it is valid
//! on all eleven counts (twelve for an exact continuation: the claimant's
//! engine build and model file must be the lost holder's); otherwise the
//! claimant is told which count failed.

use gcs_protocol::{
    verify, ApiRequestJob, ApiType, ClaimRejectReason, JobClaim, Limits, MembershipScope,
    NodeRegistration, RoutingMode,
};

/// What the gateway knows when a claim arrives.
#[derive(Debug)]
pub struct ClaimContext<'a> {
    /// The job, if the gateway knows it.
    pub job: Option<&'a ApiRequestJob>,
    /// The claimant's latest registration, if any.
    pub registration: Option<&'a NodeRegistration>,
    /// A claim already won, or the job finished.
    pub already_claimed: bool,
    /// Receiver clock.
    pub now_ms: u64,
    /// Freshness bounds.
    pub limits: &'a Limits,
}

/// Whether `reg` presents a certificate, signed by the job's membership
/// issuer (the tenant's or swarm's key the gateway holds), that admits
/// exactly this node to `group` in `scope` at `now`. What a node says of
/// itself (`tenant_id`, `swarm_id`, `accepts_*`) admits nothing. Revoked
/// and superseded certificates were already removed by the gateway's shell
/// (`membership::current`).
pub(crate) fn admitted(
    job: &ApiRequestJob,
    reg: &NodeRegistration,
    scope: MembershipScope,
    group: &str,
    now_ms: u64,
) -> bool {
    let Some(issuer) = &job.routing.membership_issuer else { return false };
    reg.memberships.iter().any(|c| {
        &c.issuer == issuer && c.admits(scope, group, &reg.node_id, now_ms) && verify(c).is_ok()
    })
}

/// Whether `reg` is one of the job tenant's private nodes (26.11.3): it
/// takes private jobs and the tenant admitted it.
pub(crate) fn private_ok(job: &ApiRequestJob, reg: &NodeRegistration, now_ms: u64) -> bool {
    reg.queue.accepts_private_jobs
        && admitted(job, reg, MembershipScope::TenantMember, &job.tenant.tenant_id, now_ms)
        && (job.routing.allowed_nodes.is_empty()
            || job.routing.allowed_nodes.contains(&reg.node_id))
}

/// Whether `reg` is attached to the job's gateway (`gateway_local`,
/// 26.11.3): the gateway's own worker (`--role all`), or a worker that
/// presents a `gateway_worker` certificate the job's gateway signed with
/// its own node key, naming itself as the group and the claimant as the
/// node. The issuer is the job's signer, never a field anyone else chose.
pub(crate) fn attached(job: &ApiRequestJob, reg: &NodeRegistration, now_ms: u64) -> bool {
    let gw = &job.gateway_node_id;
    reg.node_id == *gw
        || reg.memberships.iter().any(|c| {
            &c.issuer == gw
                && c.admits(MembershipScope::GatewayWorker, gw.as_str(), &reg.node_id, now_ms)
                && verify(c).is_ok()
        })
}

fn public_ok(reg: &NodeRegistration) -> bool {
    reg.queue.accepts_public_jobs
}

/// Checks a claim against the eleven counts. The signature is checked first
/// so an unsigned or forged claim learns nothing about the job's policy.
pub fn validate_claim(claim: &JobClaim, ctx: &ClaimContext<'_>) -> Result<(), ClaimRejectReason> {
    use ClaimRejectReason as R;
    verify(claim).map_err(|_| R::BadSignature)?;
    let job = ctx.job.filter(|j| j.job_id == claim.job_id).ok_or(R::JobNotFound)?;
    if ctx.now_ms > job.expires_at_ms {
        return Err(R::JobExpired);
    }
    let reg = ctx
        .registration
        .filter(|r| r.node_id == claim.node_id && r.is_fresh(ctx.now_ms, ctx.limits))
        .ok_or(R::RegistrationStale)?;
    let caps = &reg.capabilities;
    let type_ok = caps.api_request_job
        && match job.request.api_type {
            ApiType::ChatCompletion => caps.chat,
            ApiType::Completion => caps.completion,
            ApiType::Embedding => caps.embedding,
        };
    if !type_ok {
        return Err(R::JobTypeUnsupported);
    }
    let model = reg
        .model(&job.request.model)
        .filter(|m| m.tasks.contains(&job.request.api_type))
        .filter(|m| m.model_id == claim.capability_match.model_id)
        .ok_or(R::ModelUnsupported)?;
    if let Some(offer) = &job.requirements.continuation {
        // Only the same arithmetic reproduces the lost holder's tokens; an
        // empty (unadvertised) build or hash matches nothing.
        let same = !model.engine_build.is_empty()
            && !model.model_hash.is_empty()
            && model.engine_build == offer.engine_build
            && model.model_hash == offer.model_hash;
        if !same {
            return Err(R::ContinuationMismatch);
        }
    }
    if (job.request.stream || job.requirements.supports_streaming) && !caps.streaming {
        return Err(R::StreamingUnsupported);
    }
    if model.context_tokens < job.requirements.min_context_tokens {
        return Err(R::ContextTooSmall);
    }
    let r = &job.routing;
    let policy = !r.excluded_nodes.contains(&reg.node_id)
        && match r.network {
            RoutingMode::Public => public_ok(reg),
            RoutingMode::Private => private_ok(job, reg, ctx.now_ms),
            // Private first is a preference the gateway applies while the
            // claim window is open; either kind of node is valid.
            RoutingMode::Hybrid => private_ok(job, reg, ctx.now_ms) || public_ok(reg),
            RoutingMode::LocalOnly => {
                reg.queue.accepts_local_only_jobs
                    && admitted(job, reg, MembershipScope::SwarmMember, &r.swarm_id, ctx.now_ms)
            }
            RoutingMode::GatewayLocal => attached(job, reg, ctx.now_ms),
        };
    if !policy {
        return Err(R::PolicyDenied);
    }
    if reg.queue.current_api_jobs >= reg.queue.max_concurrent_api_jobs {
        return Err(R::NoCapacity);
    }
    if ctx.already_claimed {
        return Err(R::AlreadyClaimed);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gcs_protocol::samples::{self, Params};
    use gcs_protocol::{sign, NodeKey};

    struct Case {
        job: ApiRequestJob,
        reg: NodeRegistration,
        claim: JobClaim,
        key: NodeKey,
        claimed: bool,
        now: u64,
    }

    impl Case {
        fn new() -> Self {
            let (w, g) = samples::keys();
            let p = Params::default();
            Case {
                job: samples::api_job(&g, &p),
                reg: samples::registration(&w, &p),
                claim: samples::claim(&w, &p),
                key: w,
                claimed: false,
                now: p.now_ms + 200,
            }
        }
        fn check(&mut self) -> Result<(), ClaimRejectReason> {
            let mut c = self.claim.clone();
            if c.signature.is_none() {
                sign(&mut c, &self.key).unwrap();
            }
            let limits = Limits::default();
            validate_claim(
                &c,
                &ClaimContext {
                    job: Some(&self.job),
                    registration: Some(&self.reg),
                    already_claimed: self.claimed,
                    now_ms: self.now,
                    limits: &limits,
                },
            )
        }
    }

    use ClaimRejectReason as R;

    #[test]
    fn a_claim_valid_on_all_counts_wins() {
        assert_eq!(Case::new().check(), Ok(()));
    }
    #[test]
    fn count_1_unknown_job() {
        let mut c = Case::new();
        c.claim.job_id = gcs_protocol::ids::id_from_parts(gcs_protocol::ids::JOB, 1, 1);
        assert_eq!(c.check(), Err(R::JobNotFound));
    }
    #[test]
    fn count_2_expired_job() {
        let mut c = Case::new();
        c.now = c.job.expires_at_ms + 1;
        assert_eq!(c.check(), Err(R::JobExpired));
    }
    #[test]
    fn count_3_stale_registration() {
        let mut c = Case::new();
        c.now = c.reg.heartbeat.expires_at_ms;
        c.job.expires_at_ms = c.now + 1;
        assert_eq!(c.check(), Err(R::RegistrationStale));
    }
    #[test]
    fn count_4_job_type() {
        let mut c = Case::new();
        c.reg.capabilities.chat = false;
        assert_eq!(c.check(), Err(R::JobTypeUnsupported));
    }
    #[test]
    fn count_5_model_or_alias() {
        let mut c = Case::new();
        c.job.request.model = "gnus-code".into();
        assert_eq!(c.check(), Err(R::ModelUnsupported));
        let mut c = Case::new();
        c.job.request.model = "smollm2-135m-instruct".into();
        assert_eq!(c.check(), Ok(()), "the canonical id works as well as an alias");
    }
    #[test]
    fn count_12_a_continuation_needs_the_same_engine_build_and_model_file() {
        let hash = "ab".repeat(32);
        let mut c = Case::new();
        for m in &mut c.reg.models {
            m.engine_build = "gcs-engine 0.1.0".into();
            m.model_hash = hash.clone();
        }
        c.job.requirements.continuation = Some(gcs_protocol::ContinuationOffer {
            continuation: 1,
            engine_build: "gcs-engine 0.1.0".into(),
            model_hash: hash.clone(),
        });
        assert_eq!(c.check(), Ok(()), "same build, same file");
        let offer = c.job.requirements.continuation.clone().unwrap();
        let other_build = gcs_protocol::ContinuationOffer {
            engine_build: "gcs-engine 0.2.0".into(),
            ..offer.clone()
        };
        c.job.requirements.continuation = Some(other_build);
        assert_eq!(c.check(), Err(R::ContinuationMismatch), "another build");
        let other_file = gcs_protocol::ContinuationOffer { model_hash: "cd".repeat(32), ..offer };
        c.job.requirements.continuation = Some(other_file);
        assert_eq!(c.check(), Err(R::ContinuationMismatch), "another file");
        let mut c2 = Case::new();
        c2.job.requirements.continuation = c.job.requirements.continuation.clone();
        c2.job.requirements.continuation.as_mut().unwrap().model_hash = String::new();
        c2.job.requirements.continuation.as_mut().unwrap().engine_build = String::new();
        assert_eq!(c2.check(), Err(R::ContinuationMismatch), "nothing advertised matches nothing");
    }
    #[test]
    fn count_6_streaming() {
        let mut c = Case::new();
        c.reg.capabilities.streaming = false;
        assert_eq!(c.check(), Err(R::StreamingUnsupported));
    }
    #[test]
    fn count_7_context() {
        let mut c = Case::new();
        c.job.requirements.min_context_tokens = 16_384;
        assert_eq!(c.check(), Err(R::ContextTooSmall));
    }
    /// A private job of the sample tenant, and a worker presenting `cert`.
    fn private_case(cert: Option<gcs_protocol::MembershipCertificate>) -> Case {
        let mut c = Case::new();
        c.job.routing.network = RoutingMode::Private;
        c.job.routing.membership_issuer = Some(samples::tenant_key().node_id());
        c.reg.queue.accepts_private_jobs = true;
        c.reg.memberships = cert.into_iter().collect();
        c
    }

    /// The sample tenant's signed certificate for the sample worker.
    fn cert(
        edit: impl FnOnce(&mut gcs_protocol::MembershipCertificate),
    ) -> gcs_protocol::MembershipCertificate {
        let (w, _) = samples::keys();
        let t = samples::tenant_key();
        let mut m = samples::membership(&t, &w, &Params::default());
        edit(&mut m);
        sign(&mut m, &t).unwrap();
        m
    }

    #[test]
    fn count_8_a_certified_private_node_wins() {
        assert_eq!(private_case(Some(cert(|_| {}))).check(), Ok(()));
    }
    #[test]
    fn count_8_self_description_admits_nothing() {
        let mut c = private_case(None);
        c.reg.tenant_id = Some(c.job.tenant.tenant_id.clone());
        assert_eq!(
            c.check(),
            Err(R::PolicyDenied),
            "tenant_id + accepts_private_jobs, no certificate"
        );
        let mut c = Case::new();
        c.job.routing.network = RoutingMode::Private;
        assert_eq!(c.check(), Err(R::PolicyDenied), "a public node cannot take a private job");
    }
    #[test]
    fn count_8_a_certificate_of_another_tenant_is_refused() {
        let mut c = private_case(Some(cert(|m| m.group_id = "other_tenant".into())));
        assert_eq!(c.check(), Err(R::PolicyDenied));
    }
    #[test]
    fn count_8_a_certificate_from_an_untrusted_key_is_refused() {
        // Self-issued: the attacker's own key "admits" it to the tenant.
        let (w, _) = samples::keys();
        let mut m = samples::membership(&w, &w, &Params::default());
        sign(&mut m, &w).unwrap();
        assert_eq!(private_case(Some(m)).check(), Err(R::PolicyDenied));
        // A job whose gateway holds no key for the tenant admits no one.
        let mut c = private_case(Some(cert(|_| {})));
        c.job.routing.membership_issuer = None;
        assert_eq!(c.check(), Err(R::PolicyDenied));
    }
    #[test]
    fn count_8_a_certificate_for_another_node_is_refused() {
        let other = NodeKey::from_seed([9; 32]).node_id();
        let mut c = private_case(Some(cert(|m| m.node_id = other)));
        assert_eq!(c.check(), Err(R::PolicyDenied));
    }
    #[test]
    fn count_8_an_expired_certificate_is_refused() {
        let mut c = private_case(Some(cert(|_| {})));
        c.now = c.reg.memberships[0].expires_at_ms;
        c.job.expires_at_ms = c.now + 1;
        c.reg.heartbeat.expires_at_ms = c.now + 1;
        assert_eq!(c.check(), Err(R::PolicyDenied));
        let mut c = private_case(Some(cert(|m| m.scope = MembershipScope::TenantGateway)));
        assert_eq!(c.check(), Err(R::PolicyDenied), "a gateway certificate is not a member's");
    }
    #[test]
    fn count_8_a_forged_certificate_is_refused() {
        let mut m = cert(|_| {});
        m.expires_at_ms += 1; // changed after signing
        assert_eq!(private_case(Some(m)).check(), Err(R::PolicyDenied));
    }
    #[test]
    fn count_8_a_revoked_certificate_is_refused() {
        let (w, _) = samples::keys();
        let t = samples::tenant_key();
        let mut r = samples::revocation(&t, &w, &Params::default());
        sign(&mut r, &t).unwrap();
        let mut c = private_case(Some(cert(|_| {})));
        c.reg.memberships =
            crate::lifecycle::membership::current(&w.node_id(), &c.reg.memberships, &[r.into()]);
        assert_eq!(c.check(), Err(R::PolicyDenied));
    }
    #[test]
    fn count_8_local_only_needs_the_swarm_certificate() {
        let mut c = Case::new();
        c.job.routing.network = RoutingMode::LocalOnly;
        c.job.routing.swarm_id = "lab".into();
        c.job.routing.membership_issuer = Some(samples::tenant_key().node_id());
        c.reg.queue.accepts_local_only_jobs = true;
        c.reg.swarm_id = "lab".into();
        assert_eq!(c.check(), Err(R::PolicyDenied), "a self-declared swarm_id admits nothing");
        c.reg.memberships = vec![cert(|m| {
            m.scope = MembershipScope::SwarmMember;
            m.group_id = "lab".into();
        })];
        assert_eq!(c.check(), Ok(()));
        c.job.routing.swarm_id = "other".into();
        assert_eq!(c.check(), Err(R::PolicyDenied), "another swarm's job");
    }
    #[test]
    fn count_8_routing_and_privacy_policy() {
        let mut c = private_case(Some(cert(|_| {})));
        c.job.routing.allowed_nodes = vec![NodeKey::from_seed([9; 32]).node_id()];
        assert_eq!(c.check(), Err(R::PolicyDenied), "not on the tenant's allow-list");
        let mut c = Case::new();
        c.job.routing.network = RoutingMode::Hybrid;
        assert_eq!(c.check(), Ok(()), "hybrid falls back to public");
        c.job.routing.excluded_nodes = vec![c.reg.node_id.clone()];
        assert_eq!(c.check(), Err(R::PolicyDenied), "excluded after a failure");
        let mut c = private_case(Some(cert(|_| {})));
        c.job.routing.network = RoutingMode::Hybrid;
        c.reg.queue.accepts_public_jobs = false;
        assert_eq!(c.check(), Ok(()), "a certified private-only node takes hybrid jobs");
        c.reg.memberships.clear();
        assert_eq!(c.check(), Err(R::PolicyDenied));
    }
    /// A gateway-local job of the sample gateway; the worker presents no
    /// certificate.
    fn gateway_local_case() -> Case {
        let (_, g) = samples::keys();
        let mut c = Case::new();
        c.job.routing.network = RoutingMode::GatewayLocal;
        c.job.routing.membership_issuer = Some(g.node_id());
        c
    }

    /// The same, the worker presenting a `gateway_worker` certificate the
    /// gateway signed (`edit`ed first; signed by the worker if `edit` made
    /// it the issuer).
    fn attached_case(edit: impl Fn(&mut gcs_protocol::MembershipCertificate)) -> Case {
        let (w, g) = samples::keys();
        let mut c = gateway_local_case();
        let mut m = samples::membership(&g, &w, &Params::default());
        m.scope = MembershipScope::GatewayWorker;
        m.group_id = g.node_id().to_string();
        edit(&mut m);
        let signer = if m.issuer == g.node_id() { &g } else { &w };
        sign(&mut m, signer).unwrap();
        c.reg.memberships = vec![m];
        c
    }

    #[test]
    fn count_8_gateway_local_needs_the_gateways_certificate() {
        assert_eq!(attached_case(|_| {}).check(), Ok(()), "attached by its gateway");
        assert_eq!(gateway_local_case().check(), Err(R::PolicyDenied), "a public node");
        let (w, _) = samples::keys();
        let self_issued = attached_case(|m| m.issuer = w.node_id()).check();
        assert_eq!(self_issued, Err(R::PolicyDenied), "a worker cannot attach itself");
        let other = NodeKey::from_seed([9; 32]).node_id().to_string();
        let mut c = attached_case(|m| m.group_id = other.clone());
        assert_eq!(c.check(), Err(R::PolicyDenied), "attached to another gateway");
        c = attached_case(|m| m.scope = MembershipScope::TenantMember);
        assert_eq!(c.check(), Err(R::PolicyDenied), "another scope of the same key");
        c = attached_case(|m| m.expires_at_ms = m.issued_at_ms + 1);
        assert_eq!(c.check(), Err(R::PolicyDenied), "expired");
        c = attached_case(|_| {});
        c.job.routing.membership_issuer = None;
        assert_eq!(c.check(), Ok(()), "the issuer is the job's gateway, not the field");
    }
    #[test]
    fn count_8_the_gateways_own_worker_is_attached() {
        let (_, g) = samples::keys();
        let mut c = gateway_local_case();
        c.reg = samples::registration(&g, &Params::default());
        c.claim = samples::claim(&g, &Params::default());
        c.key = g;
        assert_eq!(c.check(), Ok(()));
    }
    #[test]
    fn count_8_a_revoked_gateway_worker_is_refused() {
        let (w, g) = samples::keys();
        let mut c = attached_case(|_| {});
        let mut r = samples::revocation(&g, &w, &Params::default());
        r.scope = MembershipScope::GatewayWorker;
        r.group_id = g.node_id().to_string();
        sign(&mut r, &g).unwrap();
        c.reg.memberships =
            crate::lifecycle::membership::current(&w.node_id(), &c.reg.memberships, &[r.into()]);
        assert_eq!(c.check(), Err(R::PolicyDenied));
    }
    #[test]
    fn count_9_capacity() {
        let mut c = Case::new();
        c.reg.queue.current_api_jobs = c.reg.queue.max_concurrent_api_jobs;
        assert_eq!(c.check(), Err(R::NoCapacity));
    }
    #[test]
    fn count_10_signature() {
        let mut c = Case::new();
        sign(&mut c.claim, &c.key).unwrap();
        c.claim.estimated.wall_ms += 1;
        assert_eq!(c.check(), Err(R::BadSignature));
    }
    #[test]
    fn count_11_already_claimed() {
        let mut c = Case::new();
        c.claimed = true;
        assert_eq!(c.check(), Err(R::AlreadyClaimed));
    }
}
