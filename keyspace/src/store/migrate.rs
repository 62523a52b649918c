//! Store layout migrations run at open.

use super::*;

/// Keys written into the `local` column family before idempotency entries,
/// confined jobs and the local indexes had column families of their own
/// (with their own retention): moved to theirs, once, at open. Bounded:
/// the `local` family holds only this node's own records.
pub(super) fn split_local(db: &DB) -> Result<(), KeyspaceError> {
    let cf = |name: &str| {
        db.cf_handle(name).ok_or_else(|| KeyspaceError::Db(format!("missing column family {name}")))
    };
    let local = cf(Namespace::Local.cf())?;
    let mut batch = WriteBatch::default();
    let mut moved = 0usize;
    for item in db.iterator_cf(local, IteratorMode::Start) {
        let (k, v) = item?;
        let Ok(key) = std::str::from_utf8(&k) else { continue };
        match Namespace::of_key(key) {
            Ok(ns) if ns != Namespace::Local => {
                batch.put_cf(cf(ns.cf())?, &k, &v);
                batch.delete_cf(local, &k);
                moved += 1;
            }
            _ => {}
        }
    }
    if moved > 0 {
        db.write(batch)?;
        tracing::info!(moved, "local records moved to their own column families");
    }
    Ok(())
}
