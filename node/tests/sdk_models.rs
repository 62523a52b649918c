//! Issue 18's SDK check, with the official OpenAI Python SDK: the gateway
//! lists both chat models — SmolLM2 by catalogue name and the Gemma 3 270M
//! file by path (`--model PATH.gguf --model-id gemma-file`) — and
//! tests/sdk/models.py chats with each, blocking and streaming, first when
//! one worker serves both models, then (a fresh gateway) when two workers
//! serve one model each. Real `gcs-node` processes over TCP and libp2p.
//!
//! Needs GCS_PYTHON (the venv scripts/test-deps.sh makes) and both model
//! files: SKIP without them, a failure under `CI=true`
//! (tests/support/prereq.rs).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;
#[path = "support/procs.rs"]
mod procs;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use procs::{create_key, model_dir, tail, Node};

use serde_json::Value;

const SMOL: &str = "smollm2-135m-instruct";
const GEMMA: &str = "gemma-file";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A worker joined to `gw` serving `models` (`--model` arguments).
fn worker(dir: &Path, gw: &Node, models: &[&str]) -> Node {
    let boot = gw.bootstrap();
    let mut args = vec!["--role", "worker", "--bootstrap", &boot];
    for m in models {
        args.extend(["--model", m]);
        if m.ends_with(".gguf") {
            args.extend(["--model-id", GEMMA, "--ctx", "4096"]);
        }
    }
    Node::start(dir, 500, &args)
}

/// Waits until `/v1/models` lists both chat models, one worker each.
fn wait_listed(gw: &Node, key: &str, workers: &[&Node]) -> Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (status, text) = gw.request("GET", "/v1/models", key, "");
        let m: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let count = |id: &str| {
            let data = m["data"].as_array()?;
            data.iter().find(|e| e["id"] == id)?["gnus"]["workers"].as_u64()
        };
        // One worker per model in both set-ups.
        if status == 200 && count(SMOL) == Some(1) && count(GEMMA) == Some(1) {
            return m;
        }
        let logs: Vec<String> = workers.iter().map(|w| tail(&w.log)).collect();
        assert!(Instant::now() < deadline, "never listed both: {status} {text}\n{logs:?}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Runs tests/sdk/models.py against `gw`.
fn sdk_run(python: &str, gw: &Node, key: &str, what: &str) {
    let t = Instant::now();
    let out = Command::new(python)
        .arg("tests/sdk/models.py")
        .current_dir(root())
        .env("GCS_BASE_URL", format!("http://127.0.0.1:{}/v1", gw.http))
        .env("GCS_KEY", key)
        .env("GCS_MODELS", format!("{SMOL},{GEMMA}"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "models.py ({what}) failed ({}):\n{stdout}\n{}\ngateway: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        tail(&gw.log)
    );
    eprint!("{stdout}");
    eprintln!("models.py ({what}): ok in {:.1}s", t.elapsed().as_secs_f64());
}

#[test]
fn the_python_sdk_chats_with_each_model_from_one_worker_and_from_two() {
    const DEPS: &str = "run `bash scripts/test.sh` (scripts/test-deps.sh installs it)";
    let Some(python) = prereq::env("GCS_PYTHON", DEPS) else { return };
    if !prereq::program(&python, DEPS) {
        return;
    }
    let dir = model_dir();
    let smol = dir.join("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    let gemma = dir.join("gemma-3-270m/gemma-3-270m-q4_k_m.gguf");
    for (file, name) in [(&smol, "smollm2"), (&gemma, "gemma3-270m")] {
        if !file.is_file() {
            let fix = format!("run scripts/fetch-models.sh {name}");
            prereq::missing(&file.display().to_string(), &fix);
            return;
        }
    }
    let gemma = gemma.display().to_string();
    let tmp = tempfile::tempdir().unwrap();

    // One worker serving both models.
    let key = create_key(&tmp.path().join("gw1"));
    let gw = Node::start(&tmp.path().join("gw1"), 500, &["--role", "gateway"]);
    let both = worker(&tmp.path().join("both"), &gw, &[SMOL, &gemma]);
    wait_listed(&gw, &key, &[&both]);
    sdk_run(&python, &gw, &key, "one worker, two models");
    drop((both, gw));

    // Two workers, one model each, behind a fresh gateway: each model's
    // answers can only have come from the worker that serves it.
    let key = create_key(&tmp.path().join("gw2"));
    let gw = Node::start(&tmp.path().join("gw2"), 500, &["--role", "gateway"]);
    let a = worker(&tmp.path().join("smol"), &gw, &[SMOL]);
    let b = worker(&tmp.path().join("gemma"), &gw, &[&gemma]);
    let m = wait_listed(&gw, &key, &[&a, &b]);
    let data = m["data"].as_array().unwrap();
    let entry = |id: &str| data.iter().find(|e| e["id"] == id).unwrap()["gnus"].clone();
    assert_eq!(entry(GEMMA)["quantization"], "q4_k_m", "{m}");
    assert_eq!(entry(SMOL)["quantization"], "q4_1", "{m}");
    sdk_run(&python, &gw, &key, "two workers, one model each");
}
