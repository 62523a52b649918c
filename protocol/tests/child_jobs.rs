//! Child job references (26.14.2) on jobs and usage records, and the
//! tokens a usage record charges (parent roll-ups, batch pricing).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gcs_protocol::samples::{self, Params};
use gcs_protocol::*;

fn signed<T: SignedMessage>(mut m: T, key: &NodeKey) -> T {
    sign(&mut m, key).unwrap();
    m
}

fn parent_id() -> String {
    ids::id_from_parts(ids::JOB, 1_783_468_800_000, 42)
}

#[test]
fn a_job_without_a_parent_signs_as_before_and_a_parent_is_signed() {
    let (_, g) = samples::keys();
    let p = Params::default();
    let plain = signed(samples::api_job(&g, &p), &g);
    let bytes = encode(&plain).unwrap();
    assert!(!String::from_utf8_lossy(&bytes).contains("parent"), "no parent key when absent");
    verify(&plain).unwrap();
    let mut child = samples::api_job(&g, &p);
    child.parent = Some(ChildJobReference::api(&parent_id(), "embeddings"));
    let mut child = signed(child, &g);
    verify(&child).unwrap();
    child.check_fields(&Limits::default()).unwrap();
    let back: ApiRequestJob = codec::from_cbor_bytes(&encode(&child).unwrap()).unwrap();
    assert_eq!(back.parent, child.parent);
    child.parent = Some(ChildJobReference::api(&ids::id_from_parts(ids::JOB, 1, 1), "embeddings"));
    assert!(verify(&child).is_err(), "the parent is covered by the signature");
}

#[test]
fn a_bad_parent_reference_is_refused() {
    let (_, g) = samples::keys();
    let lim = Limits::default();
    let mut j = samples::api_job(&g, &Params::default());
    j.parent = Some(ChildJobReference::api("gcsapi_nope", "embeddings"));
    assert!(j.check_fields(&lim).is_err(), "a malformed parent id");
    j.parent = Some(ChildJobReference::api(&parent_id(), &"p".repeat(65)));
    assert!(j.check_fields(&lim).is_err(), "an oversized phase");
    let mut r = ChildJobReference::api(&parent_id(), "embeddings");
    r.parent_job.job_type = MessageType::UsageRecord;
    j.parent = Some(r);
    assert!(j.check_fields(&lim).is_err(), "a parent that is not an API job");
    j.parent = Some(ChildJobReference::api(&j.job_id.clone(), "embeddings"));
    assert!(j.check_fields(&lim).is_err(), "its own parent");
}

#[test]
fn a_reference_with_a_processing_task_still_decodes() {
    // The form 26.14.2 prints (before the task ref became optional).
    #[derive(serde::Serialize)]
    struct Old {
        parent_job: ParentJob,
        processing_task: ProcessingTaskRef,
    }
    let old = Old {
        parent_job: ChildJobReference::api(&parent_id(), "retrieval").parent_job,
        processing_task: ProcessingTaskRef { task_id: "task_abc".into(), subtask_id: "s1".into() },
    };
    let bytes = codec::to_canonical_bytes(&old).unwrap();
    let r: ChildJobReference = codec::from_cbor_bytes(&bytes).unwrap();
    assert_eq!(r.processing_task.as_ref().unwrap().task_id, "task_abc");
    assert_eq!(r.parent_job.phase, "retrieval");
    r.check("parent").unwrap();
    let api = ChildJobReference::api(&parent_id(), "embeddings");
    let s = String::from_utf8_lossy(&codec::to_canonical_bytes(&api).unwrap()).to_string();
    assert!(!s.contains("processing_task"), "an API child carries no task ref");
}

#[test]
fn usage_records_charge_children_once_and_batch_work_at_its_price() {
    let (w, g) = samples::keys();
    let p = Params::default();
    let mut u = samples::usage(&w, &g, &p);
    let real = u.input_tokens + u.output_tokens_generated;
    assert_eq!(u.charged_tokens(), real);
    u.price_percent = Some(50);
    assert!(u.check_fields(&Limits::default()).is_err(), "a price on a record of no batch");
    u.batch_id = Some("batch_0123456789abcdef01234567".into());
    assert_eq!(u.charged_tokens(), real.div_ceil(2), "half price, rounded up");
    let u = signed(u, &g);
    verify(&u).unwrap();
    assert_eq!(u.input_tokens + u.output_tokens_generated, real, "the counts stay real");
    let mut roll_up = samples::usage(&w, &g, &p);
    roll_up.child_jobs = 3;
    assert_eq!(roll_up.charged_tokens(), 0, "a parent's record is not charged again");
    let lim = Limits::default();
    let mut child = samples::usage(&w, &g, &p);
    child.parent_job_id = Some(parent_id());
    child.check_fields(&lim).unwrap();
    assert_eq!(child.charged_tokens(), real, "the child meters its own tokens");
    child.child_jobs = 1;
    assert!(child.check_fields(&lim).is_err(), "a child with children");
    let mut bad = samples::usage(&w, &g, &p);
    bad.batch_id = Some("batch_0123456789abcdef01234567".into());
    bad.price_percent = Some(0);
    assert!(bad.check_fields(&lim).is_err(), "a price of 0 %");
    bad.price_percent = Some(101);
    assert!(bad.check_fields(&lim).is_err(), "a price above 100 %");
    bad.price_percent = None;
    bad.child_jobs = MAX_CHILD_JOBS + 1;
    assert!(bad.check_fields(&lim).is_err(), "too many children");
    bad.child_jobs = 0;
    bad.parent_job_id = Some("nope".into());
    assert!(bad.check_fields(&lim).is_err(), "a malformed parent id");
}
