//! `gcs-node --role worker --gpu 0` on the GPU decoder, end to end (issue
//! 17): built with `--features wgpu`, the worker serves SmolLM2 on the
//! CubeCL kernels through wgpu (Mesa's lavapipe on a machine without a
//! GPU) behind a `--role gateway` node, real processes over TCP and
//! libp2p. A chat completion returns text, and what the worker's
//! registrations advertise names the GPU, the K/V capacity on it, the
//! batch size that capacity gives, and the decode speed measured on it.
//! Gemma 3 270M (Q4_K_M: Q5_0 and K-quant weights, gemma3's layers)
//! serves on the GPU the same way.
//!
//! Not in the default test run (a cold wgpu build is ~30 min on 2 cores):
//! `cargo test -p gcs-node --features wgpu --test gpu_serve -- --nocapture`

#![cfg(feature = "wgpu")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;
#[path = "support/procs.rs"]
mod procs;

use std::time::{Duration, Instant};

use procs::{create_key, model_dir, tail, Node};
use serde_json::Value;

/// The worker's log line carrying what its registrations advertise.
fn accelerator(log: &str) -> Option<Value> {
    let line = log.lines().find(|l| l.contains("worker accelerator"))?;
    let json = line.split("accelerator=").nth(1)?;
    // The field is the last one logged before the message's end.
    let json = &json[..json.rfind('}')? + 1];
    serde_json::from_str(json).ok()
}

/// A gateway and a `--gpu 0` worker serving `model` with `kv_mb` MiB of
/// K/V and a 512-token context, once the gateway lists the model; the
/// gateway's API key.
fn serve_on_the_gpu(tmp: &std::path::Path, model: &str, kv_mb: &str) -> (Node, Node, String) {
    serve_on_the_gpu_with(tmp, model, kv_mb, &[])
}

/// [`serve_on_the_gpu`] with `env` set for the worker.
fn serve_on_the_gpu_with(
    tmp: &std::path::Path,
    model: &str,
    kv_mb: &str,
    env: &[(&str, &str)],
) -> (Node, Node, String) {
    let key = create_key(&tmp.join("gw"));
    // lavapipe compiles every kernel on first use and runs them on the
    // CPU: generous timeouts.
    let gw = Node::start(
        &tmp.join("gw"),
        500,
        &["--role", "gateway", "--first-token-timeout-ms", "300000", "--wall-timeout-ms", "600000"],
    );
    let bootstrap = gw.bootstrap();
    let t0 = Instant::now();
    let worker = Node::start_with_env(
        &tmp.join("worker"),
        500,
        &[
            "--role",
            "worker",
            "--bootstrap",
            &bootstrap,
            "--gpu",
            "0",
            "--model",
            model,
            "--ctx",
            "512",
            "--kv-cache-mb",
            kv_mb,
        ],
        env,
    );
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let (status, text) = gw.request("GET", "/v1/models", &key, "");
        if status == 200 && text.contains(model) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never listed: {status} {text}\nworker: {}\ngateway: {}",
            tail(&worker.log),
            tail(&gw.log)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    eprintln!("listed {:.1}s after the worker started", t0.elapsed().as_secs_f64());
    let log = std::fs::read_to_string(&worker.log).unwrap();
    assert!(log.contains("GPU decoder loaded"), "{}", tail(&worker.log));
    (gw, worker, key)
}

#[test]
fn a_gpu_worker_serves_chat_through_the_gateway() {
    let smol = model_dir().join("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !smol.is_file() {
        prereq::missing(&smol.display().to_string(), "run scripts/fetch-models.sh smollm2");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // 64 MiB of f16 K/V at 23,040 bytes a position: 182 blocks, 2,912
    // positions; no --max-jobs, so the batch follows them (2,912 / 512).
    let (gw, worker, key) = serve_on_the_gpu(tmp.path(), "smollm2-135m-instruct", "64");

    let log = std::fs::read_to_string(&worker.log).unwrap();
    let acc = accelerator(&log).unwrap_or_else(|| panic!("no accelerator logged:\n{}", tail(&worker.log)));
    eprintln!("advertised accelerator: {acc}");
    assert_eq!(acc["backend"], "cubecl-wgpu", "{acc}");
    assert!(!acc["name"].as_str().unwrap().is_empty(), "{acc}");
    assert_eq!(acc["kv_tokens"], 182 * 16, "{acc}");
    let line = log.lines().find(|l| l.contains("worker accelerator")).unwrap();
    assert!(line.contains("max_jobs=5"), "the batch from the K/V capacity: {line}");
    let rate: f64 = log
        .lines()
        .filter(|l| l.contains("chat model ready"))
        .filter_map(|l| l.split("decode_tokens_per_s=").nth(1))
        .find_map(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    assert!(rate > 0.0, "decode speed measured on the GPU: {rate}");

    let m = gw.json("GET", "/v1/models/smollm2-135m-instruct", &key, "");
    // As logged, within the last bit of serde_json's float parsing (not
    // correctly rounded without its `float_roundtrip` feature).
    let listed = m["gnus"]["decode_tokens_per_s"].as_f64().unwrap_or_else(|| panic!("{m}"));
    assert!((listed - rate).abs() <= rate * 1e-12, "{m}");

    let body = r#"{"model":"smollm2-135m-instruct","max_tokens":8,"temperature":0,
                   "messages":[{"role":"user","content":"Name a colour."}]}"#;
    let t = Instant::now();
    let r = gw.json("POST", "/v1/chat/completions", &key, body);
    let text = r["choices"][0]["message"]["content"].as_str().unwrap();
    eprintln!("GPU chat in {:.1}s: {text:?} ({rate:.1} tok/s measured)", t.elapsed().as_secs_f64());
    assert!(!text.trim().is_empty(), "answered nothing: {r}");
    assert!(r["usage"]["completion_tokens"].as_u64().unwrap() >= 1, "{r}");

    // A seeded top-p draw with logprobs: each token drawn from the
    // device's best candidates, its logprobs computed from them.
    let body = r#"{"model":"smollm2-135m-instruct","max_tokens":8,"top_p":0.9,"seed":7,
                   "logprobs":true,"top_logprobs":2,
                   "messages":[{"role":"user","content":"Name a colour."}]}"#;
    let r = gw.json("POST", "/v1/chat/completions", &key, body);
    let content =
        r["choices"][0]["logprobs"]["content"].as_array().unwrap_or_else(|| panic!("{r}"));
    eprintln!("GPU top-p 0.9: {:?}", r["choices"][0]["message"]["content"]);
    assert_eq!(content.len() as u64, r["usage"]["completion_tokens"].as_u64().unwrap(), "{r}");
    for c in content {
        let lp = c["logprob"].as_f64().unwrap();
        let top = c["top_logprobs"].as_array().unwrap();
        assert!(lp <= 0.0 && top.len() == 2, "{c}");
        assert!(top[0]["logprob"].as_f64().unwrap() >= lp, "{c}");
    }

    // A JSON object with penalties and a bias: its grammar's mask and the
    // additions applied on the device before each pick: an object, which
    // parses unless cut at max_tokens.
    let body = r#"{"model":"smollm2-135m-instruct","max_tokens":40,"temperature":0.7,"seed":3,
                   "response_format":{"type":"json_object"},"frequency_penalty":0.5,
                   "presence_penalty":0.3,"logit_bias":{"28":-100},
                   "messages":[{"role":"user","content":"Describe a cat as JSON."}]}"#;
    let r = gw.json("POST", "/v1/chat/completions", &key, body);
    let text = r["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("{r}"));
    eprintln!("GPU JSON object: {text:?}");
    assert!(text.starts_with('{'), "{r}");
    if r["choices"][0]["finish_reason"] == "stop" {
        let v: serde_json::Value =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {r}"));
        assert!(v.is_object(), "{r}");
    }
}

/// Gemma 3 270M on the GPU decoder: Q5_0, Q4_K and Q6_K weights, per-head
/// Q/K norms, post-norms, GeGLU, sliding-window layers; a greedy chat
/// completion through the gateway answers (its agreement with the CPU
/// decoder is the engine's `gpu_decoder` test).
#[test]
fn a_gpu_worker_serves_gemma_through_the_gateway() {
    let gemma = model_dir().join("gemma-3-270m/gemma-3-270m-q4_k_m.gguf");
    if !gemma.is_file() {
        prereq::missing(&gemma.display().to_string(), "run scripts/fetch-models.sh gemma3-270m");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (gw, worker, key) = serve_on_the_gpu(tmp.path(), "gemma-3-270m", "16");
    let body = r#"{"model":"gemma-3-270m","max_tokens":6,"temperature":0,
                   "messages":[{"role":"user","content":"Name a colour."}]}"#;
    let t = Instant::now();
    let r = gw.json("POST", "/v1/chat/completions", &key, body);
    let text = r["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("{r}"));
    eprintln!("Gemma on the GPU in {:.1}s: {text:?}", t.elapsed().as_secs_f64());
    assert!(!text.trim().is_empty(), "answered nothing: {r}\n{}", tail(&worker.log));
    assert!(r["usage"]["completion_tokens"].as_u64().unwrap() >= 1, "{r}");
    let log = std::fs::read_to_string(&worker.log).unwrap();
    assert!(!log.contains("panicked"), "{}", tail(&worker.log));
}

/// `GCS_GPU_DENSE` on a served worker: Gemma with every matrix in f16
/// (`=1`) answers through the gateway, the decoder logged as dense from
/// one row; a value that is not a row count stops the worker with an error
/// naming it, rather than serving without it.
#[test]
fn gcs_gpu_dense_serves_gemma_over_f16_weights() {
    let gemma = model_dir().join("gemma-3-270m/gemma-3-270m-q4_k_m.gguf");
    if !gemma.is_file() {
        prereq::missing(&gemma.display().to_string(), "run scripts/fetch-models.sh gemma3-270m");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut bad = Node::start_with_env(
        &tmp.path().join("bad"),
        500,
        &["--role", "worker", "--gpu", "0", "--model", "gemma-3-270m", "--ctx", "512"],
        &[("GCS_GPU_DENSE", "on")],
    );
    let deadline = Instant::now() + Duration::from_secs(300);
    while bad.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "still running: {}", tail(&bad.log));
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = std::fs::read_to_string(&bad.log).unwrap();
    assert!(log.contains("GCS_GPU_DENSE=on"), "{}", tail(&bad.log));
    assert!(!log.contains("GPU decoder loaded"), "{}", tail(&bad.log));

    let env = [("GCS_GPU_DENSE", "1")];
    let (gw, worker, key) = serve_on_the_gpu_with(tmp.path(), "gemma-3-270m", "16", &env);
    let log = std::fs::read_to_string(&worker.log).unwrap();
    let loaded = log.lines().find(|l| l.contains("GPU decoder loaded")).unwrap();
    assert!(loaded.contains("dense_from=Some(1)"), "{loaded}");
    let body = r#"{"model":"gemma-3-270m","max_tokens":6,"temperature":0,
                   "messages":[{"role":"user","content":"Name a colour."}]}"#;
    let t = Instant::now();
    let r = gw.json("POST", "/v1/chat/completions", &key, body);
    let text = r["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("{r}"));
    eprintln!("Gemma, dense, on the GPU in {:.1}s: {text:?}", t.elapsed().as_secs_f64());
    assert!(!text.trim().is_empty(), "answered nothing: {r}\n{}", tail(&worker.log));
    let log = std::fs::read_to_string(&worker.log).unwrap();
    assert!(!log.contains("panicked"), "{}", tail(&worker.log));
}
