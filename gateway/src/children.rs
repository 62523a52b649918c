//! Child jobs (26.14) of one admitted request: the request is the parent
//! API job (a `gcsapi_` id of its own, aggregated here at the gateway, as
//! 26.14.2 allows for the MVP), each child a network job that names it
//! (`ChildJobReference`, signed in its announcement). Children inherit the
//! parent's policy (the request's routing, privacy and limits) and its
//! deadline: a child's wall timeout is what is left of the parent's,
//! counted from the parent's admission. Every child is required: the first
//! one that fails ends the parent with that error and cancels the others
//! in the network. The parent's roll-up usage record counts `child_jobs`;
//! the tokens are charged once, by the children's own records.

use std::time::{Duration, Instant};

use gcs_protocol::{
    ids, now_ms, CancellationReason, ChildJobReference, FinalResult, JobLimits,
};
use tokio::sync::mpsc;

use crate::admit::{submit_as, InFlight, EDGE_GRACE};
use crate::backend::{JobEvent, ParentUsage};
use crate::error::ApiError;
use crate::payload::JobRequest;

/// The children of one parent, in order, once they all completed.
pub(crate) struct Done {
    /// The parent's id.
    pub parent_id: String,
    /// Each child's id and result, in the order submitted.
    pub results: Vec<(String, Box<FinalResult>)>,
}

/// The limits of a child submitted now: the parent's, with a wall timeout
/// that ends at the parent's deadline (`None`: the deadline has passed).
pub(crate) fn child_limits(parent: &JobLimits, admitted: Instant) -> Option<JobLimits> {
    let left = Duration::from_millis(parent.wall_timeout_ms).checked_sub(admitted.elapsed())?;
    let wall = u64::try_from(left.as_millis()).ok().filter(|&ms| ms > 0)?;
    // Other timeouts never outlast the wall one.
    Some(JobLimits {
        wall_timeout_ms: wall,
        first_token_timeout_ms: parent.first_token_timeout_ms.min(wall),
        idle_stream_timeout_ms: parent.idle_stream_timeout_ms.min(wall),
        claim_timeout_ms: parent.claim_timeout_ms.min(wall),
        ..parent.clone()
    })
}

/// Runs `jobs` as the required children of a new parent of the request
/// `f` (`phase` names what they do), waits for all of them and records the
/// parent's roll-up. `idem` keys the children (`<idem>#<i>`), so a repeat of
/// the request is answered by the same children.
pub(crate) async fn run(
    f: &mut InFlight,
    phase: &str,
    jobs: Vec<JobRequest>,
    idem: &str,
) -> Result<Done, ApiError> {
    let parent_id =
        ids::new_id(ids::JOB, now_ms()).map_err(|e| ApiError::internal(e.to_string()))?;
    let reference = ChildJobReference::api(&parent_id, phase);
    let mut subs = Vec::with_capacity(jobs.len());
    for (i, job) in jobs.iter().enumerate() {
        let Some(limits) = child_limits(&f.limits, f.started) else {
            cancel_open(f, &subs).await;
            return Err(ApiError::timeout("gnus_wall_timeout", "the request timed out"));
        };
        let key = format!("{idem}#{i}");
        match submit_as(f, job, false, key, Some(reference.clone()), limits).await {
            Ok(s) => subs.push(s),
            Err(e) => {
                cancel_open(f, &subs).await;
                return Err(e);
            }
        }
    }
    let n = subs.len();
    let wall = f.started + Duration::from_millis(f.limits.wall_timeout_ms) + EDGE_GRACE;
    let (tx, mut rx) = mpsc::channel(n.max(1));
    for (i, (job_id, events)) in subs.into_iter().enumerate() {
        let tx = tx.clone();
        tokio::spawn(async move {
            let r = wait(events, wall).await;
            let _ = tx.send((i, job_id, r)).await;
        });
    }
    drop(tx);
    let mut results: Vec<Option<(String, Box<FinalResult>)>> = vec![None; n];
    let mut failure = None;
    while let Some((i, job_id, r)) = rx.recv().await {
        f.ended(&job_id);
        match r {
            Ok(res) => results[i] = Some((job_id, res)),
            Err(e) => {
                // A required child failed: the parent fails with its error
                // and its other children are cancelled in the network.
                failure = Some(e);
                break;
            }
        }
    }
    let done: Vec<(String, Box<FinalResult>)> = results.iter().flatten().cloned().collect();
    let mut usage = roll_up(f, &parent_id, n, &done);
    if let Some(e) = failure {
        let open: Vec<String> = f.open_jobs.clone();
        for job in open {
            f.cancel(&job, CancellationReason::Admin).await;
        }
        usage.cancellation_reason = Some(CancellationReason::Admin);
        record(f, usage).await;
        tracing::info!(parent = %parent_id, error = %e, "a required child job failed");
        return Err(e);
    }
    record(f, usage).await;
    Ok(Done { parent_id, results: done })
}

/// Cancels the children submitted so far (a later one was refused).
async fn cancel_open(f: &mut InFlight, subs: &[(String, mpsc::Receiver<JobEvent>)]) {
    for (job, _) in subs {
        f.cancel(job, CancellationReason::Admin).await;
    }
}

/// One job's end: its result, or the error the request fails with.
pub(crate) async fn wait(
    mut rx: mpsc::Receiver<JobEvent>,
    wall: Instant,
) -> Result<Box<FinalResult>, ApiError> {
    loop {
        match tokio::time::timeout_at(wall.into(), rx.recv()).await {
            Ok(Some(JobEvent::Completed(r))) => return Ok(r),
            Ok(Some(JobEvent::Failed { error, .. })) => return Err(ApiError::from_info(&error)),
            Ok(Some(JobEvent::Cancelled)) | Ok(None) => {
                return Err(ApiError::unavailable("the request was cancelled in the network"))
            }
            Ok(Some(_)) => continue,
            Err(_) => return Err(ApiError::timeout("gnus_wall_timeout", "the request timed out")),
        }
    }
}

/// The parent's roll-up of the children that completed.
fn roll_up(
    f: &InFlight,
    parent_id: &str,
    children: usize,
    done: &[(String, Box<FinalResult>)],
) -> ParentUsage {
    let m = || done.iter().filter_map(|(_, r)| r.metering.as_ref());
    let c = &f.common;
    ParentUsage {
        job_id: parent_id.to_string(),
        api_type: c.api_type,
        model: c.model.clone(),
        tenant_id: f.key.tenant_id.clone(),
        project_id: f.key.project_id.clone(),
        api_key_id: f.key.id.clone(),
        network: c.network,
        child_jobs: u32::try_from(children).unwrap_or(u32::MAX),
        input_tokens: m().map(|m| m.input_tokens).sum(),
        output_tokens: m().map(|m| m.output_tokens).sum(),
        compute_ms: m().map(|m| m.compute_ms).sum(),
        wall_ms: u64::try_from(f.started.elapsed().as_millis()).unwrap_or(u64::MAX),
        cancellation_reason: None,
        batch_id: f.batch_id.clone(),
        price_percent: f.batch_id.as_ref().map(|_| f.state.config.batch_price()),
    }
}

/// Stores the roll-up. The children's records already charge the tokens,
/// so a roll-up that cannot be stored is logged, and the answer stands.
async fn record(f: &InFlight, usage: ParentUsage) {
    let id = usage.job_id.clone();
    if let Err(e) = f.state.backend.record_parent(usage).await {
        tracing::error!(parent = %id, error = %e, "parent usage record not stored");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_child_gets_what_is_left_of_the_parents_deadline() {
        let parent = JobLimits { wall_timeout_ms: 60_000, ..JobLimits::default() };
        let admitted = Instant::now() - Duration::from_secs(50);
        let l = child_limits(&parent, admitted).unwrap();
        assert!((9_000..=10_000).contains(&l.wall_timeout_ms), "{}", l.wall_timeout_ms);
        assert!(l.first_token_timeout_ms <= l.wall_timeout_ms);
        assert!(l.idle_stream_timeout_ms <= l.wall_timeout_ms);
        assert_eq!(l.max_requeues, parent.max_requeues, "the rest is the parent's");
        let late = Instant::now() - Duration::from_secs(61);
        assert!(child_limits(&parent, late).is_none(), "past the deadline: no child");
    }
}
