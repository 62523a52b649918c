//! Batch jobs on the worker's slots (specs/batch.md, "Priority on the
//! worker"): a batch job never takes the last free slot, a freed slot goes
//! to a waiting interactive job first, and the class comes only from what
//! the gateway signed.

use super::*;
use crate::jobs::executor::{Priority, SOURCE_KIND_BATCH};
use gcs_protocol::samples::{self, Params};

const T0: u64 = 1_783_468_800_000;

fn job(id: &str, batch: bool) -> ApiRequestJob {
    let g = NodeKey::from_seed([1; 32]);
    let mut j = samples::api_job(&g, &Params { now_ms: T0, ..Params::default() });
    j.job_id = id.into();
    j.expires_at_ms = T0 + 600_000;
    if batch {
        j.source.kind = SOURCE_KIND_BATCH.into();
    }
    j
}

fn started(o: &Offer) -> bool {
    matches!(o, Offer::Start(_))
}

#[test]
fn the_class_is_the_signed_source_kind() {
    assert_eq!(Priority::of_job(&job("a", false)), Priority::Interactive);
    assert_eq!(Priority::of_job(&job("b", true)), Priority::Batch);
    let mut j = job("c", false);
    j.source.kind = "openai_batch ".into();
    assert_eq!(Priority::of_job(&j), Priority::Interactive, "only the exact kind");
}

#[test]
fn batch_jobs_leave_the_last_slot_to_interactive_work() {
    let mut s = Slots::with_backlog(4, 16);
    for i in 0..3 {
        assert!(started(&s.offer(job(&format!("b{i}"), true), T0)), "batch {i}");
    }
    assert_eq!(s.offer(job("b3", true), T0), Offer::Backlogged, "the last slot stays free");
    assert_eq!(s.running_batch(), 3);
    assert!(started(&s.offer(job("i0", false), T0)), "an interactive job takes it");
    assert_eq!(s.running(), 4);
    assert_eq!(s.offer(job("i1", false), T0), Offer::Backlogged);
    // A batch job ends: the waiting interactive job goes first, though the
    // batch job waited longer.
    let next = s.finished("b0", T0).expect("a waiting job");
    assert_eq!(next.job_id, "i1");
    assert!(started(&s.offer(next, T0)));
    // An interactive job ends: the freed slot is the last free one, so the
    // waiting batch job stays; once two are free it may take one.
    assert_eq!(s.finished("i0", T0), None, "batch never takes the last free slot");
    let next = s.finished("i1", T0).expect("two slots free");
    assert_eq!(next.job_id, "b3");
    assert!(started(&s.offer(next, T0)));
    assert_eq!((s.running(), s.running_batch()), (3, 3));
}

#[test]
fn interactive_jobs_use_every_slot_and_a_one_slot_worker_runs_batch_when_idle() {
    let mut s = Slots::with_backlog(2, 16);
    assert!(started(&s.offer(job("i0", false), T0)));
    assert!(started(&s.offer(job("i1", false), T0)));
    assert_eq!(s.offer(job("b0", true), T0), Offer::Backlogged);
    assert_eq!(s.finished("i0", T0), None, "one free slot of two: not for batch");
    let next = s.finished("i1", T0).expect("idle");
    assert!(started(&s.offer(next, T0)));

    let mut one = Slots::with_backlog(1, 16);
    assert!(started(&one.offer(job("b1", true), T0)), "idle: batch work may run");
    assert_eq!(one.offer(job("b2", true), T0), Offer::Backlogged);
    assert_eq!(one.offer(job("i2", false), T0), Offer::Backlogged);
    assert_eq!(one.finished("b1", T0).map(|j| j.job_id), Some("i2".into()));
}
