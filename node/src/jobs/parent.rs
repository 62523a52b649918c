//! A parent job's roll-up usage record (26.14, 26.21.1 `child_jobs`): the
//! gateway aggregates its children (gateway/src/children.rs) and signs one
//! record for the parent, which counts them and sums their tokens. The
//! children's own records charge those tokens; the roll-up charges none
//! (`UsageRecord::charged_tokens`), so nothing is metered twice.

use gcs_gateway::ParentUsage;
use gcs_protocol::{now_ms, sign, MessageType, UsageRecord, PROTOCOL_VERSION};

use super::gateway::{store_usage, Ctx};
use crate::error::NodeError;

/// The parent's record, signed by this gateway at `now`.
pub(crate) fn record(p: &ParentUsage, ctx: &Ctx<'_>, now: u64) -> Result<UsageRecord, NodeError> {
    let mut u = UsageRecord {
        message_type: MessageType::UsageRecord,
        version: PROTOCOL_VERSION,
        job_id: p.job_id.clone(),
        tenant_id: p.tenant_id.clone(),
        project_id: p.project_id.clone(),
        api_key_id: p.api_key_id.clone(),
        // Its children ran on their own workers; their records name them.
        node_id: None,
        recorded_by: ctx.key.node_id(),
        model: p.model.clone(),
        api_type: p.api_type,
        network: p.network,
        input_tokens: p.input_tokens,
        cached_tokens: 0,
        output_tokens_generated: p.output_tokens,
        output_tokens_sent_to_client: p.output_tokens,
        embedding_tokens: if p.api_type == gcs_protocol::ApiType::Embedding {
            p.input_tokens
        } else {
            0
        },
        retrieval_chunks: 0,
        child_jobs: p.child_jobs.max(1),
        compute_ms: p.compute_ms,
        first_token_ms: None,
        wall_ms: p.wall_ms,
        requeue_count: 0,
        cost_gnus: "0".into(),
        cancellation_reason: p.cancellation_reason,
        failed_after_partial_output: false,
        batch_id: p.batch_id.clone(),
        holders: vec![],
        parent_job_id: None,
        price_percent: p.price_percent,
        created_at_ms: now,
        signature: None,
    };
    // The gateway's own caller is trusted, but the record travels: it must
    // pass the checks every peer applies.
    gcs_protocol::SignedMessage::check_fields(&u, ctx.limits)?;
    sign(&mut u, ctx.key)?;
    Ok(u)
}

/// Signs and stores the roll-up (synced, gossiped to the tenant's
/// gateways like every usage record).
pub(crate) async fn store(p: &ParentUsage, ctx: &Ctx<'_>) -> Result<(), NodeError> {
    let u = record(p, ctx, now_ms())?;
    store_usage(&u, ctx).await
}
