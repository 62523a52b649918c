//! Taking over a batch that another gateway of the tenant created
//! (specs/batch.md, "Adoption"). A batch on the processing queue leaves a
//! manifest with each of its tasks ([`manifest`]: the batch object as
//! created, the number of tasks, the price), which the network mirrors to
//! the tenant's other gateways with the tasks' inputs (their `custom_id`s)
//! and answers. Asked for a batch it does not have (`GET` or cancel by
//! id), a gateway looks for that manifest ([`Backend::find_batch`]); when
//! it holds the whole batch, it writes the record into its own store and
//! runs it from there: collecting the answers (never enqueueing anything),
//! writing the output files, cancelling in the network. Answers are
//! metered under ids of task, request and lock, so what the creating
//! gateway metered already is not metered again.
//!
//! [`Backend::find_batch`]: crate::backend::Backend::find_batch

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::store::{BatchRecord, Status, TaskRef};
use super::validate::Line;
use crate::error::ApiError;
use crate::files::blocking;
use crate::files::store::well_formed;
use crate::AppState;

/// Version of [`Manifest`].
pub const MANIFEST_VERSION: u16 = 1;
/// How long an id looked for in vain by a tenant is not looked for again
/// for that tenant (a GET loop on an unknown id costs one scan of a
/// batch's manifests per interval).
const MISS_TTL: Duration = Duration::from_secs(2);
/// Most ids remembered as looked for in vain.
const MAX_MISSES: usize = 4096;

/// What the creating gateway leaves with each task of a batch.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_VERSION`].
    pub v: u16,
    /// The batch object when it was enqueued (`in_progress`).
    pub record: BatchRecord,
    /// How many tasks the batch's requests became (one per model).
    pub tasks: usize,
    /// The price its answers are metered at.
    pub price_percent: u8,
}

/// The manifest bytes of `rec`, enqueued as `tasks` tasks.
pub(super) fn manifest(rec: &BatchRecord, tasks: usize, price_percent: u8) -> Vec<u8> {
    let mut record = rec.clone();
    record.processing = None;
    let m = Manifest { v: MANIFEST_VERSION, record, tasks, price_percent };
    serde_json::to_vec(&m).unwrap_or_default()
}

/// The record of `found` for `tenant`'s batch `id`, if it is whole: the
/// manifest of this version, of that batch and tenant, every task of it
/// here, and exactly one `custom_id` for each of its requests.
pub(super) fn record_of(
    found: &crate::backend::FoundBatch,
    tenant: &str,
    id: &str,
) -> Result<BatchRecord, &'static str> {
    let m: Manifest = serde_json::from_slice(&found.manifest).map_err(|_| "manifest unreadable")?;
    let mut rec = m.record;
    if m.v != MANIFEST_VERSION || rec.id != id || rec.tenant_id != tenant {
        return Err("manifest of another version, batch or tenant");
    }
    if found.tasks.len() != m.tasks || rec.status != Status::InProgress {
        return Err("not every task of the batch is here yet");
    }
    let mut seen = vec![false; rec.total as usize];
    for (i, _) in &found.custom_ids {
        match seen.get_mut(*i as usize) {
            Some(s) if !*s => *s = true,
            _ => return Err("a request out of place or twice"),
        }
    }
    if seen.iter().any(|s| !s) {
        return Err("not every request of the batch is here yet");
    }
    rec.processing = Some(
        found
            .tasks
            .iter()
            .map(|(model, task_id)| TaskRef { model: model.clone(), task_id: task_id.clone() })
            .collect(),
    );
    rec.adopted_from = Some(found.creator.clone());
    rec.price_percent = Some(m.price_percent.clamp(1, 100));
    Ok(rec)
}

/// Takes over `tenant`'s batch `id` if another gateway of the tenant
/// created it and this node holds all of it: the record, saved here, and
/// whether this call took it over (the caller then starts its runner);
/// `None` otherwise.
pub(crate) async fn adopt(
    state: &Arc<AppState>,
    tenant: &str,
    id: &str,
) -> Result<Option<(BatchRecord, bool)>, ApiError> {
    if !well_formed(id, "batch_") {
        return Ok(None);
    }
    let mut misses = state.batches.adopting.lock().await;
    misses.retain(|_, at| at.elapsed() < MISS_TTL);
    // Per tenant: another tenant's key asking for the id must not keep
    // its owner from finding it.
    let miss = format!("{tenant}/{id}");
    if misses.contains_key(&miss) {
        return Ok(None);
    }
    // Taken over meanwhile (by a request that held the lock before this one).
    if let Some(r) = state.batches.record(tenant, id).map_err(crate::files::api_error)? {
        return Ok(Some((r, false)));
    }
    let found = match state.backend.find_batch(tenant.to_string(), id.to_string()).await {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(batch_id = id, error = %e, "batch of another gateway not looked for");
            None
        }
    };
    let rec = match found.as_ref().map(|f| record_of(f, tenant, id)) {
        Some(Ok(rec)) => rec,
        Some(Err(why)) => {
            tracing::info!(batch_id = id, why, "batch of another gateway not taken over");
            remember(&mut misses, miss);
            return Ok(None);
        }
        None => {
            remember(&mut misses, miss);
            return Ok(None);
        }
    };
    // Within the tenant's record limit, as a batch created here.
    let (store, saved, keep) =
        (state.batches.store.clone(), rec.clone(), state.batches.limits.max_records_per_tenant);
    blocking(move || {
        super::prune(&store, &saved.tenant_id, keep.saturating_sub(1))?;
        store.save(&saved)
    })
    .await?;
    tracing::info!(
        batch_id = id,
        creator = rec.adopted_from.as_deref().unwrap_or(""),
        "batch adopted from another gateway of the tenant"
    );
    Ok(Some((rec, true)))
}

fn remember(misses: &mut std::collections::HashMap<String, Instant>, miss: String) {
    if misses.len() >= MAX_MISSES {
        misses.clear();
    }
    misses.insert(miss, Instant::now());
}

/// The lines of an adopted batch, as the network holds them: each
/// request's `custom_id` in its place (the bodies stay with the tasks);
/// `None` once the network no longer holds the batch.
pub(super) async fn lines(
    state: &AppState,
    rec: &BatchRecord,
) -> Result<Option<Vec<Line>>, ApiError> {
    let found = state
        .backend
        .find_batch(rec.tenant_id.clone(), rec.id.clone())
        .await
        .map_err(|e| e.to_api())?;
    let Some(found) = found else { return Ok(None) };
    let mut ids = found.custom_ids;
    ids.sort_by_key(|(i, _)| *i);
    if ids.len() as u64 != rec.total || ids.iter().enumerate().any(|(n, (i, _))| n as u64 != *i) {
        return Ok(None);
    }
    let line = |(i, custom_id): (u64, String)| Line {
        line: i + 1,
        custom_id,
        body: vec![],
        model: String::new(),
    };
    Ok(Some(ids.into_iter().map(line).collect()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::backend::FoundBatch;

    const ID: &str = "batch_0123456789abcdef01234567";

    fn found(tasks: usize, ids: &[u64]) -> FoundBatch {
        let rec = super::super::store::tests::record("t", ID);
        FoundBatch {
            creator: "gw1".into(),
            manifest: manifest(&rec, tasks, 50),
            tasks: vec![("m".into(), "task_1".into())],
            custom_ids: ids.iter().map(|i| (*i, format!("id{i}"))).collect(),
        }
    }

    /// Only a whole batch of this tenant is taken over: every task the
    /// manifest counts, one `custom_id` for each request, no other.
    #[test]
    fn only_a_whole_batch_of_the_tenant_is_taken_over() {
        let rec = record_of(&found(1, &[1, 0]), "t", ID).unwrap();
        assert_eq!(rec.adopted_from.as_deref(), Some("gw1"));
        assert_eq!(rec.price_percent, Some(50));
        assert_eq!(rec.processing.unwrap()[0].task_id, "task_1");
        assert!(record_of(&found(1, &[1, 0]), "other", ID).is_err(), "another tenant");
        assert!(record_of(&found(1, &[1, 0]), "t", "batch_0123456789abcdef01234568").is_err());
        assert!(record_of(&found(2, &[1, 0]), "t", ID).is_err(), "a task missing");
        assert!(record_of(&found(1, &[0]), "t", ID).is_err(), "a request missing");
        assert!(record_of(&found(1, &[0, 0, 1]), "t", ID).is_err(), "a request twice");
        assert!(record_of(&found(1, &[0, 2]), "t", ID).is_err(), "out of place");
        let mut bad = found(1, &[0, 1]);
        bad.manifest = b"{}".to_vec();
        assert!(record_of(&bad, "t", ID).is_err(), "unreadable");
    }
}
