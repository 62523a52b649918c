//! One worker, two chat models (issue 18): a `--role gateway` node and a
//! `--role worker` node serving the catalogue's SmolLM2 by name and the
//! Gemma 3 270M file by path (`--model PATH.gguf --model-id ...`, `--ctx`),
//! real processes over TCP and libp2p. `/v1/models` lists both with what
//! the file says about itself (its quantization, the capped context), each
//! model answers chat and completion requests from its own weights (the
//! tokenizers count the same prompt differently: SmolLM2 adds no BOS,
//! Gemma does), and the worker measured each model's decode speed at start.
//! A second worker serving the same file counts for that model only.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;
#[path = "support/procs.rs"]
mod procs;

use std::process::Command;
use std::time::{Duration, Instant};

use procs::{create_key, free_port, model_dir, tail, Node, BIN};

use serde_json::Value;

/// The entry of `/v1/models` named `id`.
fn listed<'a>(models: &'a Value, id: &str) -> Option<&'a Value> {
    models["data"].as_array()?.iter().find(|m| m["id"] == id)
}

/// The `decode_tokens_per_s` of the `/v1/models` entry `id`, read from the
/// number as the JSON spells it: serde_json's default parser (no
/// `float_roundtrip`) may land an ulp off it, `str::parse` does not.
fn advertised_rate(text: &str, id: &str) -> Option<f64> {
    let entry = &text[text.find(&format!("\"id\":\"{id}\""))?..];
    let entry = &entry[..entry[1..].find("\"id\":\"").map_or(entry.len(), |i| i + 1)];
    let key = "\"decode_tokens_per_s\":";
    let num = &entry[entry.find(key)? + key.len()..];
    let end = num.find(|c: char| !(c.is_ascii_digit() || "+-.eE".contains(c))).unwrap_or(num.len());
    num[..end].parse().ok()
}

#[test]
fn one_worker_serves_smollm2_by_name_and_gemma_by_path() {
    let dir = model_dir();
    let smol = dir.join("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    let gemma = dir.join("gemma-3-270m/gemma-3-270m-q4_k_m.gguf");
    for (file, name) in [(&smol, "smollm2"), (&gemma, "gemma3-270m")] {
        if !file.is_file() {
            prereq::missing(
                &file.display().to_string(),
                &format!("run scripts/fetch-models.sh {name}"),
            );
            return;
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let key = create_key(&tmp.path().join("gw"));
    let gw = Node::start(&tmp.path().join("gw"), 500, &["--role", "gateway"]);
    let bootstrap = gw.bootstrap();
    let gemma_path = gemma.display().to_string();
    let t0 = Instant::now();
    let worker = Node::start(
        &tmp.path().join("worker"),
        500,
        &[
            "--role",
            "worker",
            "--bootstrap",
            &bootstrap,
            "--model",
            "smollm2-135m-instruct",
            "--model",
            &gemma_path,
            "--model-id",
            "gemma-file",
            "--ctx",
            "4096",
        ],
    );

    // Both models listed, the file's one as the file describes itself.
    let deadline = Instant::now() + Duration::from_secs(120);
    let (models, models_text) = loop {
        // Until the gateway listens, nothing answers (status 0).
        let (status, text) = gw.request("GET", "/v1/models", &key, "");
        let m: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if status == 200
            && listed(&m, "gemma-file").is_some()
            && listed(&m, "smollm2-135m-instruct").is_some()
        {
            break (m, text);
        }
        assert!(
            Instant::now() < deadline,
            "never listed both: {status} {text}\nworker: {}\ngateway: {}",
            tail(&worker.log),
            tail(&gw.log)
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    eprintln!("both models listed {:.1}s after the worker started", t0.elapsed().as_secs_f64());
    let g = &listed(&models, "gemma-file").unwrap()["gnus"];
    assert_eq!(g["quantization"], "q4_k_m", "{g}");
    assert_eq!(g["context_tokens"], 4096, "--ctx caps the file's 32768: {g}");
    assert_eq!(g["workers"], 1);
    assert!(g["tasks"].as_array().unwrap().iter().any(|t| t == "chat.completion"), "{g}");
    let s = &listed(&models, "smollm2-135m-instruct").unwrap()["gnus"];
    assert_eq!(s["quantization"], "q4_1", "{s}");

    // Each model answers from its own weights: the same completion prompt
    // is 2 SmolLM2 tokens and 3 Gemma tokens (<bos> first).
    let mut prompt_tokens = vec![];
    for model in ["smollm2-135m-instruct", "gemma-file"] {
        let body = format!(
            r#"{{"model":"{model}","prompt":"Hello world","max_tokens":6,"temperature":0}}"#
        );
        let r = gw.json("POST", "/v1/completions", &key, &body);
        assert_eq!(r["model"], model, "{r}");
        let text = r["choices"][0]["text"].as_str().unwrap();
        assert!(!text.is_empty(), "{model} answered nothing: {r}");
        assert!(r["usage"]["completion_tokens"].as_u64().unwrap() >= 1, "{r}");
        prompt_tokens.push(r["usage"]["prompt_tokens"].as_u64().unwrap());
        eprintln!("{model} completion: {text:?}");

        let body = format!(
            r#"{{"model":"{model}","max_tokens":8,"temperature":0,
                "messages":[{{"role":"user","content":"Name a colour."}}]}}"#
        );
        let r = gw.json("POST", "/v1/chat/completions", &key, &body);
        assert_eq!(r["model"], model, "{r}");
        let text = r["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(!text.is_empty(), "{model} chat answered nothing: {r}");
        eprintln!("{model} chat: {text:?}");
    }
    assert_eq!(prompt_tokens, [2, 3], "each prompt ran on its own model's tokenizer");

    // The start-up measurement of each model, from the worker's log.
    let log = std::fs::read_to_string(&worker.log).unwrap();
    let rates: Vec<f64> = log
        .lines()
        .filter(|l| l.contains("chat model ready"))
        .filter_map(|l| l.split("decode_tokens_per_s=").nth(1))
        .filter_map(|v| v.split_whitespace().next()?.parse().ok())
        .collect();
    assert_eq!(rates.len(), 2, "one measurement per chat model:\n{}", tail(&worker.log));
    assert!(rates.iter().all(|&r| r > 1.0), "measured decode speeds {rates:?}");
    eprintln!("measured decode tok/s (smollm2, gemma): {rates:?}");
    // Each model's own figure travels in its registration entry: the
    // gateway lists the two (one worker: its own) apart, as logged.
    let advertised: Vec<f64> = ["smollm2-135m-instruct", "gemma-file"]
        .iter()
        .map(|id| advertised_rate(&models_text, id).unwrap_or_else(|| panic!("{id}: {models_text}")))
        .collect();
    assert_eq!(advertised, rates, "advertised per model as measured");
    assert_ne!(advertised[0], advertised[1], "two models, two figures");

    // A second worker with the same file under the same id: the gateway
    // counts both for that model (their registrations describe it alike).
    let second = Node::start(
        &tmp.path().join("worker2"),
        500,
        &["--role", "worker", "--bootstrap", &bootstrap]
            .into_iter()
            .chain(["--model", &gemma_path, "--model-id", "gemma-file", "--ctx", "4096"])
            .collect::<Vec<_>>(),
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let m = gw.json("GET", "/v1/models", &key, "");
        let g = listed(&m, "gemma-file").map(|g| g["gnus"].clone()).unwrap_or(Value::Null);
        if g["workers"] == 2 {
            assert_eq!(g["context_tokens"], 4096, "{g}");
            let s = &listed(&m, "smollm2-135m-instruct").unwrap()["gnus"];
            assert_eq!(s["workers"], 1, "only the first worker serves SmolLM2: {s}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the second worker never counted: {m}\n{}",
            tail(&second.log)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn a_file_the_engine_cannot_serve_stops_the_worker_naming_why() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("not-a-model.gguf");
    std::fs::write(&bad, b"this is not a gguf file").unwrap();
    let out = Command::new(BIN)
        .args(["--data-dir", tmp.path().join("w").to_str().unwrap(), "--no-mdns"])
        .args(["--role", "worker", "--model", bad.to_str().unwrap()])
        .args(["--listen", &format!("/ip4/127.0.0.1/tcp/{}", free_port())])
        .output()
        .unwrap();
    assert!(!out.status.success(), "a worker with an unservable file must not start");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not-a-model.gguf") && err.contains("not a GGUF file"), "{err}");
    let out = Command::new(BIN)
        .args(["--data-dir", tmp.path().join("w").to_str().unwrap(), "--no-mdns"])
        .args(["--role", "worker", "--model", "/nonexistent/x.gguf"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/x.gguf"), "{err}");
}
