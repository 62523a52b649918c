//! A worker whose metering falls outside what the gateway knows gets a
//! penalty strike; an honest one does not.

use super::*;
use gcs_protocol::samples::{self, Params};
use gcs_protocol::{Metering, NodeKey, ResponseBody};

const T0: u64 = 1_783_468_800_000;

/// A tracker whose job is leased to `w`; returns it and the gateway key.
fn leased(w: &NodeKey) -> (JobTracker, NodeKey) {
    let gw = samples::keys().1;
    let mut job = samples::api_job(&gw, &Params::default());
    sign(&mut job, &gw).unwrap();
    let (mut t, _) = JobTracker::new(job, TrackerConfig::default(), T0);
    let p = Params { now_ms: T0 - 100, ..Params::default() };
    let mut reg = samples::registration(w, &p);
    sign(&mut reg, w).unwrap();
    let mut c = samples::claim(w, &p);
    c.job_id = t.job.job_id.clone();
    c.claim_id = ids::new_id(ids::CLAIM, T0).unwrap();
    sign(&mut c, w).unwrap();
    let fx = t.handle(Input::Claim(Box::new(c), Some(Box::new(reg))), T0, &gw, &Limits::default());
    assert!(fx.iter().any(|e| matches!(e, Effect::Lease(_))), "{fx:?}");
    (t, gw)
}

fn result_with(t: &mut JobTracker, gw: &NodeKey, w: &NodeKey, m: Metering) -> Vec<Effect> {
    let mut r = samples::final_result(w, &Params { now_ms: T0 + 10, ..Params::default() });
    r.job_id = t.job.job_id.clone();
    r.lease_id = t.lease().map(|l| l.lease_id.clone());
    r.response = Some(ResponseBody {
        format: "openai.chat.completion".into(),
        body: serde_json::Value::Null,
    });
    r.metering = Some(m);
    sign(&mut r, w).unwrap();
    t.handle(Input::Result(Box::new(r)), T0 + 10, gw, &Limits::default())
}

fn metering(input: u64, output: u64, cached: u64) -> Metering {
    Metering {
        input_tokens: input,
        output_tokens: output,
        tokens_sent_to_client: 0,
        cached_tokens: cached,
        compute_ms: 5,
        first_token_ms: 1,
        child_jobs: 0,
        cost_gnus: "0".into(),
    }
}

fn strikes(fx: &[Effect]) -> Vec<&NodeId> {
    fx.iter().filter_map(|e| if let Effect::Strike(n) = e { Some(n) } else { None }).collect()
}

#[test]
fn honest_metering_is_no_strike() {
    let w = NodeKey::from_seed([3; 32]);
    let (mut t, gw) = leased(&w);
    let fx = result_with(&mut t, &gw, &w, metering(10, 4, 4));
    assert!(strikes(&fx).is_empty(), "{fx:?}");
    assert!(fx.iter().any(|e| matches!(e, Effect::Complete(_))));
}

#[test]
fn metering_outside_the_bounds_strikes_the_worker_and_is_clamped() {
    let max_out = |t: &JobTracker| u64::from(t.job.requirements.max_output_tokens);
    for (what, m) in [
        ("output above max_output_tokens", metering(10, u64::MAX, 0)),
        ("input above what the payload can tokenize to", metering(u64::MAX, 4, 0)),
        ("cached above input", metering(10, 4, 11)),
    ] {
        let w = NodeKey::from_seed([3; 32]);
        let (mut t, gw) = leased(&w);
        let fx = result_with(&mut t, &gw, &w, m);
        assert_eq!(strikes(&fx), [&w.node_id()], "{what}");
        let u = fx
            .iter()
            .find_map(|e| if let Effect::Usage(u) = e { Some(u) } else { None })
            .expect("still one usage record");
        assert!(u.output_tokens_generated <= max_out(&t), "{what}: clamped");
        assert!(u.cached_tokens <= u.input_tokens, "{what}: clamped");
    }
}
