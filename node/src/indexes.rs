//! Local indexes that keep the gateway's reads off full scans: the usage
//! records of one API key by creation time (`/v1/usage`, the first budget
//! load), and the jobs this gateway submitted and has not yet metered
//! (restart recovery). Both are empty registers (or a key) under
//! `/gcs/local/...`, never replicated; each node derives them from the
//! records it stores. Format version: [`USAGE_INDEX_VERSION`].

use gcs_keyspace::{keys, Keyspace, KeyspaceError};
use gcs_protocol::{ApiRequestJob, UsageRecord};

/// Version of the per-key usage index (stored under its marker).
pub const USAGE_INDEX_VERSION: u8 = 1;

/// Usage records one read returns at most (a key's range beyond it is cut
/// at the newest-first end; a budget over so many records is spent anyway).
pub const MAX_USAGE_READ: usize = 100_000;

/// Open jobs read at most by one recovery.
pub const MAX_OPEN_JOBS: usize = 100_000;

/// Whether an id can be a key segment of an index.
fn indexable(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        && id != "."
        && id != ".."
}

/// Adds a usage record to its key's index. A record whose ids cannot be
/// key segments is kept unindexed (logged): it cannot be looked up by key.
pub fn index_usage(ks: &Keyspace, u: &UsageRecord, now_ms: u64) -> Result<(), KeyspaceError> {
    if !indexable(&u.api_key_id) || !indexable(&u.job_id) {
        tracing::warn!(job_id = %u.job_id, "usage record ids cannot be indexed by key");
        return Ok(());
    }
    let key = keys::usage_of_key(&u.api_key_id, u.created_at_ms, &u.job_id);
    if ks.get(&key)?.is_none() {
        ks.put(&key, vec![], now_ms)?;
    }
    Ok(())
}

/// Indexes the usage record stored for `job_id` (after a merge from a peer).
pub fn index_stored_usage(ks: &Keyspace, job_id: &str, now_ms: u64) -> Result<(), KeyspaceError> {
    match ks.find_cbor::<UsageRecord>(&keys::usage(job_id))? {
        Some(u) => index_usage(ks, &u, now_ms),
        None => Ok(()),
    }
}

/// The usage records of `api_key_id` created in `[since_ms, until_ms)`,
/// read from its index (one range, not every record).
pub fn usage_of_key(
    ks: &Keyspace,
    api_key_id: &str,
    since_ms: u64,
    until_ms: u64,
) -> Result<Vec<UsageRecord>, KeyspaceError> {
    if !indexable(api_key_id) || since_ms >= until_ms {
        return Ok(vec![]);
    }
    let from = keys::usage_of_key_from(api_key_id, since_ms);
    let to = keys::usage_of_key_from(api_key_id, until_ms);
    let mut out = vec![];
    for (k, _) in ks.scan_range(&from, &to, MAX_USAGE_READ)? {
        let mut segs = k.rsplit('/');
        let (Some(job), Some(at)) = (segs.next(), segs.next().and_then(|a| a.parse::<u64>().ok()))
        else {
            continue;
        };
        // The record itself decides (it may have expired, or a peer's copy
        // replaced it): the index only says where to look. A job has one
        // entry per copy indexed here (two gateways that metered the same
        // answer), and only the stored copy's, by its creation time, counts.
        if let Some(u) = ks.find_cbor::<UsageRecord>(&keys::usage(job))? {
            if u.api_key_id == api_key_id && u.created_at_ms == at && at >= since_ms && at < until_ms {
                out.push(u);
            }
        }
    }
    Ok(out)
}

/// Builds the per-key index over the records stored before it existed:
/// one full scan, once per store (a marker records that it was done).
pub fn backfill_usage_index(ks: &Keyspace, now_ms: u64) -> Result<usize, KeyspaceError> {
    let marker = keys::usage_index_marker();
    if ks.get_bytes(&marker)?.is_some_and(|v| v.first() == Some(&USAGE_INDEX_VERSION)) {
        return Ok(0);
    }
    let mut n = 0;
    for (_, u) in ks.scan_cbor::<UsageRecord>(keys::all_usage())? {
        index_usage(ks, &u, now_ms)?;
        n += 1;
    }
    ks.put(&marker, vec![USAGE_INDEX_VERSION], now_ms)?;
    Ok(n)
}

/// Marks a job this gateway submitted as open; `record_key` is where its
/// envelope is stored (public or confined).
pub fn open_job(
    ks: &Keyspace,
    job_id: &str,
    record_key: &str,
    now_ms: u64,
) -> Result<(), KeyspaceError> {
    ks.put(&keys::open_job(job_id), record_key.as_bytes().to_vec(), now_ms).map(drop)
}

/// The job is metered: recovery no longer needs it.
pub fn close_job(ks: &Keyspace, job_id: &str, now_ms: u64) -> Result<(), KeyspaceError> {
    if ks.get_bytes(&keys::open_job(job_id))?.is_some() {
        ks.delete(&keys::open_job(job_id), now_ms)?;
    }
    Ok(())
}

/// The envelopes of the open jobs (those whose record is still stored).
pub fn open_jobs(ks: &Keyspace) -> Result<Vec<ApiRequestJob>, KeyspaceError> {
    let mut out = vec![];
    for (_, v) in ks.scan_prefix(keys::open_jobs())?.into_iter().take(MAX_OPEN_JOBS) {
        let Some(record_key) = v.as_register().and_then(|r| r.value()) else { continue };
        let Ok(record_key) = std::str::from_utf8(record_key) else { continue };
        if let Some(job) = ks.find_cbor::<ApiRequestJob>(record_key)? {
            out.push(job);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gcs_protocol::samples::{self, Params};

    fn usage(key_id: &str, job: &str, at: u64) -> UsageRecord {
        let (w, g) = samples::keys();
        let mut u = samples::usage(&w, &g, &Params::default());
        u.api_key_id = key_id.into();
        u.job_id = job.into();
        u.created_at_ms = at;
        u
    }

    #[test]
    fn a_keys_usage_is_read_by_range_from_its_index() {
        let dir = tempfile::tempdir().unwrap();
        let ks = Keyspace::open(dir.path(), "a", Default::default()).unwrap();
        for (k, j, t) in [("k1", "j1", 100), ("k1", "j2", 200), ("k2", "j3", 150), ("k1", "j4", 300)] {
            let u = usage(k, j, t);
            ks.put(&keys::usage(j), gcs_protocol::encode(&u).unwrap(), 1)
                .unwrap();
            index_usage(&ks, &u, 1).unwrap();
        }
        let ids = |v: Vec<UsageRecord>| v.into_iter().map(|u| u.job_id).collect::<Vec<_>>();
        assert_eq!(ids(usage_of_key(&ks, "k1", 0, u64::MAX).unwrap()), ["j1", "j2", "j4"]);
        assert_eq!(ids(usage_of_key(&ks, "k1", 150, 300).unwrap()), ["j2"]);
        assert_eq!(ids(usage_of_key(&ks, "k2", 0, u64::MAX).unwrap()), ["j3"]);
        assert!(usage_of_key(&ks, "k1/../k2", 0, u64::MAX).unwrap().is_empty());
        // An index entry whose record names another key counts for nobody.
        let forged = usage("k2", "j5", 120);
        ks.put(&keys::usage("j5"), gcs_protocol::encode(&forged).unwrap(), 1)
            .unwrap();
        ks.put(&keys::usage_of_key("k1", 120, "j5"), vec![], 1).unwrap();
        assert_eq!(ids(usage_of_key(&ks, "k1", 0, u64::MAX).unwrap()), ["j1", "j2", "j4"]);
        // Two copies of one job's record indexed (two gateways metered the
        // same answer; the later merge replaced the first): listed once.
        index_usage(&ks, &usage("k1", "j2", 210), 1).unwrap();
        assert_eq!(ids(usage_of_key(&ks, "k1", 0, u64::MAX).unwrap()), ["j1", "j2", "j4"]);
    }

    #[test]
    fn the_index_is_backfilled_once_over_older_records() {
        let dir = tempfile::tempdir().unwrap();
        let ks = Keyspace::open(dir.path(), "a", Default::default()).unwrap();
        let u = usage("k1", "j1", 100);
        ks.put(&keys::usage("j1"), gcs_protocol::encode(&u).unwrap(), 1).unwrap();
        assert!(usage_of_key(&ks, "k1", 0, u64::MAX).unwrap().is_empty(), "not indexed yet");
        assert_eq!(backfill_usage_index(&ks, 2).unwrap(), 1);
        assert_eq!(usage_of_key(&ks, "k1", 0, u64::MAX).unwrap().len(), 1);
        assert_eq!(backfill_usage_index(&ks, 3).unwrap(), 0, "once");
    }

    #[test]
    fn open_jobs_are_those_not_yet_closed() {
        let dir = tempfile::tempdir().unwrap();
        let ks = Keyspace::open(dir.path(), "a", Default::default()).unwrap();
        let (_, g) = samples::keys();
        let mut ids = vec![];
        for i in 0..3 {
            let mut job = samples::api_job(&g, &Params::default());
            job.job_id = format!("gcsapi_{i}");
            let key = if i == 1 { keys::confined_job(&job.job_id) } else { keys::job(&job.job_id) };
            ks.put(&key, gcs_protocol::encode(&job).unwrap(), 1).unwrap();
            open_job(&ks, &job.job_id, &key, 1).unwrap();
            ids.push(job.job_id);
        }
        // Someone else's job in the public namespace is not ours to recover.
        let mut other = samples::api_job(&g, &Params::default());
        other.job_id = "gcsapi_other".into();
        ks.put(&keys::job("gcsapi_other"), gcs_protocol::encode(&other).unwrap(), 1)
            .unwrap();
        close_job(&ks, &ids[0], 2).unwrap();
        let open: Vec<_> = open_jobs(&ks).unwrap().into_iter().map(|j| j.job_id).collect();
        assert_eq!(open, [ids[1].clone(), ids[2].clone()]);
    }
}
