//! Child jobs (26.14) over real processes: a `--role gateway` node and two
//! `--role worker` nodes serving the BERT embedder. An embeddings request of
//! 3 × embed_batch (4) inputs is one parent whose three children name it in
//! their usage records; the answer equals the inputs embedded one by one,
//! in order; the parent's record counts `child_jobs` = 3 and charges
//! nothing (the children's records carry the tokens).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;
#[path = "support/procs.rs"]
mod procs;

use std::time::{Duration, Instant};

use procs::{create_key, model_dir, tail, Node};
use serde_json::{json, Value};

fn vector(v: &Value) -> Vec<f64> {
    v["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

#[test]
fn a_large_embeddings_request_is_served_by_children_of_one_parent() {
    if !model_dir().join("all-minilm-l6-v2/model.safetensors").is_file() {
        prereq::missing("all-minilm-l6-v2", "run scripts/fetch-models.sh all-minilm-l6-v2");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let key = create_key(&tmp.path().join("gw"));
    let gw = Node::start(&tmp.path().join("gw"), 300, &["--role", "gateway"]);
    let boot = gw.bootstrap();
    let args = ["--role", "worker", "--bootstrap", &boot, "--model", "all-minilm-l6-v2"];
    let w1 = Node::start(&tmp.path().join("w1"), 300, &args);
    let w2 = Node::start(&tmp.path().join("w2"), 300, &args);
    // Both workers registered with the gateway.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (_, m) = gw.request("GET", "/metrics", &key, "");
        let fresh = m
            .lines()
            .find_map(|l| l.strip_prefix("gcs_fresh_registrations "))
            .and_then(|n| n.trim().parse::<u32>().ok());
        if fresh >= Some(2) {
            break;
        }
        assert!(Instant::now() < deadline, "workers never registered\n{}\n{}", tail(&w1.log), tail(&w2.log));
        std::thread::sleep(Duration::from_millis(300));
    }
    let inputs: Vec<String> = (0..12).map(|i| format!("sentence number {i} about topic {}", i % 5)).collect();
    let body = json!({"model": "gnus-embed", "input": inputs}).to_string();
    let all = gw.json("POST", "/v1/embeddings", &key, &body);
    let data = all["data"].as_array().unwrap();
    assert_eq!(data.len(), 12, "{all}");
    for (i, input) in inputs.iter().enumerate() {
        assert_eq!(data[i]["index"], i);
        let one = gw.json("POST", "/v1/embeddings", &key, &json!({"model": "gnus-embed", "input": input}).to_string());
        let (a, b) = (vector(&data[i]), vector(&one["data"][0]));
        assert_eq!(a.len(), b.len());
        let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        assert!(diff < 1e-4, "input {i}: the split answer differs by {diff}");
    }
    let usage = gw.json("GET", "/v1/usage?limit=1000", &key, "");
    let recs = usage["data"].as_array().unwrap();
    let parents: Vec<&Value> = recs.iter().filter(|r| r["child_jobs"].as_u64() > Some(0)).collect();
    assert_eq!(parents.len(), 1, "one parent: {usage}");
    let p = parents[0];
    assert_eq!(p["child_jobs"], 3, "{p}");
    assert_eq!(p["charged_tokens"], 0, "the roll-up charges nothing: {p}");
    let children: Vec<&Value> = recs.iter().filter(|r| r["parent_job_id"] == p["job_id"]).collect();
    assert_eq!(children.len(), 3, "three children name the parent: {usage}");
    let sum: u64 = children.iter().map(|c| c["input_tokens"].as_u64().unwrap()).sum();
    assert!(sum > 0);
    assert_eq!(p["input_tokens"].as_u64(), Some(sum), "the roll-up sums its children");
    assert_eq!(all["usage"]["prompt_tokens"].as_u64(), Some(sum), "{all}");
    let workers: std::collections::BTreeSet<&str> =
        children.iter().filter_map(|c| c["node_id"].as_str()).collect();
    eprintln!("children ran on {} worker(s)", workers.len());
    // The 12 single requests: one job each, no parent.
    assert_eq!(recs.iter().filter(|r| r["parent_job_id"].is_null() && r["child_jobs"] == 0).count(), 12);
}
