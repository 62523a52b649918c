//! The job's usage record, and bounds on what a worker says it metered: a
//! worker may lie, the gateway bills what it can check.

use gcs_protocol::{
    sign, ApiRequestJob, JobState, MessageType, NodeKey, UsageRecord, PROTOCOL_VERSION,
};

use super::{Effect, JobTracker};

/// Slack for the tokens a chat template and a default system prompt add to
/// a payload (the engine's, not the client's).
pub const TEMPLATE_TOKENS: u64 = 1024;

/// Whether `m` already was what [`bounded_metering`] made of it (`b`): a
/// worker that reports counts outside the bounds lies or is broken.
pub fn within_bounds(m: &gcs_protocol::Metering, b: &gcs_protocol::Metering) -> bool {
    (m.input_tokens, m.output_tokens, m.cached_tokens)
        == (b.input_tokens, b.output_tokens, b.cached_tokens)
}

/// A worker's metering, bounded by what the gateway knows (a worker may
/// lie): output at least what was delivered and at most the job's
/// `max_output_tokens` (a job without generation meters only what it
/// delivered); input at most one token per payload byte plus the template's
/// [`TEMPLATE_TOKENS`]; cached at most the input.
pub fn bounded_metering(
    job: &ApiRequestJob,
    m: &gcs_protocol::Metering,
    delivered: u64,
) -> gcs_protocol::Metering {
    let max_out = u64::from(job.requirements.max_output_tokens).max(delivered);
    let max_in = job.request.payload_ref.size_bytes.saturating_add(TEMPLATE_TOKENS);
    let input_tokens = m.input_tokens.min(max_in);
    gcs_protocol::Metering {
        input_tokens,
        output_tokens: m.output_tokens.clamp(delivered, max_out),
        cached_tokens: m.cached_tokens.min(input_tokens),
        ..m.clone()
    }
}

impl JobTracker {
    /// The job's one usage record, signed.
    pub(super) fn usage(&self, now: u64, key: &NodeKey) -> Vec<Effect> {
        let j = &self.job;
        let mut u = UsageRecord {
            message_type: MessageType::UsageRecord,
            version: PROTOCOL_VERSION,
            job_id: j.job_id.clone(),
            tenant_id: self.billing.tenant_id.clone(),
            project_id: self.billing.project_id.clone(),
            api_key_id: self.billing.api_key_id.clone(),
            node_id: self.lease.as_ref().map(|l| l.node_id.clone()),
            recorded_by: key.node_id(),
            model: j.request.model.clone(),
            api_type: j.request.api_type,
            network: j.routing.network,
            input_tokens: self.input_tokens,
            cached_tokens: self.cached_tokens,
            output_tokens_generated: self.generated_tokens.max(self.delivered_tokens()),
            output_tokens_sent_to_client: self.delivered_tokens(),
            embedding_tokens: 0,
            retrieval_chunks: 0,
            child_jobs: 0,
            compute_ms: self.compute_ms,
            first_token_ms: self.first_token_ms.map(|t| t.saturating_sub(j.created_at_ms)),
            wall_ms: now.saturating_sub(j.created_at_ms),
            requeue_count: self.attempt,
            cost_gnus: "0".into(),
            cancellation_reason: self.cancellation,
            failed_after_partial_output: self.state == JobState::Failed && self.fence.started(),
            batch_id: self.batch_id.clone(),
            holders: self.holder_shares(),
            // A child job's record names its parent (26.14.2).
            parent_job_id: j.parent.as_ref().map(|p| p.parent_job.job_id.clone()),
            price_percent: self.price_percent,
            created_at_ms: now,
            signature: None,
        };
        match sign(&mut u, key) {
            Ok(()) => vec![Effect::Usage(Box::new(u))],
            Err(_) => vec![],
        }
    }
}
