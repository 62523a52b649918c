//! Issue 16's user check, with the official OpenAI Python SDK: a 500-token
//! streamed chat completion whose lease holder is SIGKILLed when the client
//! has received 200 tokens ends with the same 500 tokens, byte for byte, as
//! an uninterrupted run, with no exception and equal usage — greedy, and
//! seeded temperature-0.8 sampling. A `--role gateway` process and two
//! `--role worker` processes serving the real SmolLM2 file, over TCP and
//! libp2p; tests/sdk/continuation.py streams, finds the holder by CPU time
//! and kills it, and prints the seam gap the client saw.
//!
//! Needs GCS_PYTHON (the venv scripts/test-deps.sh makes) and the model:
//! SKIP without them, a failure under `CI=true` (tests/support/prereq.rs).

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

/// Registrations every 300 ms: a killed holder's loss is noticed sooner.
const HEARTBEAT_MS: u64 = 300;

/// A killed worker's registration lapses after this, so the gateway's count
/// says when the survivor is alone (the default 30 s would outlast the test).
const REGISTRATION_TTL_MS: &str = "2000";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn worker(dir: &Path, gw: &Node) -> Node {
    let boot = gw.bootstrap();
    let args = ["--role", "worker", "--bootstrap", &boot, "--model", "smollm2-135m-instruct"];
    let ttl = ["--registration-ttl-ms", REGISTRATION_TTL_MS];
    Node::start(dir, HEARTBEAT_MS, &[&args[..], &ttl].concat())
}

/// Waits until `/v1/models` counts `n` workers for SmolLM2.
fn wait_for_workers(gw: &Node, key: &str, n: u64, workers: &[Node]) {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let text = gw.request("GET", "/v1/models", key, "").1;
        let m: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let listed = m["data"].as_array().and_then(|d| {
            d.iter().find(|e| e["id"] == "smollm2-135m-instruct")?["gnus"]["workers"].as_u64()
        });
        if listed == Some(n) {
            return;
        }
        let logs: Vec<String> = workers.iter().map(|w| tail(&w.log)).collect();
        assert!(Instant::now() < deadline, "{listed:?} workers, not {n}: {logs:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Runs the script at `temperature`; returns the pid it killed.
fn sdk_run(python: &str, gw: &Node, key: &str, workers: &[Node], temperature: &str) -> u32 {
    let pids: Vec<String> = workers.iter().map(|w| w.child.id().to_string()).collect();
    let t = Instant::now();
    let out = Command::new(python)
        .arg("tests/sdk/continuation.py")
        .arg(temperature)
        .current_dir(root())
        .env("GCS_BASE_URL", format!("http://127.0.0.1:{}/v1", gw.http))
        .env("GCS_KEY", key)
        .env("GCS_WORKER_PIDS", pids.join(","))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "continuation.py {temperature} failed ({}):\n{stdout}\n{}\ngateway: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        tail(&gw.log)
    );
    eprint!("{stdout}");
    eprintln!("continuation.py {temperature}: ok in {:.1}s", t.elapsed().as_secs_f64());
    let killed = stdout.lines().filter_map(|l| l.strip_prefix("KILLED ")).last();
    killed.and_then(|p| p.trim().parse().ok()).expect("the script names the pid it killed")
}

#[test]
fn the_python_sdk_streams_500_tokens_across_a_worker_killed_at_token_200() {
    const DEPS: &str = "run `bash scripts/test.sh` (scripts/test-deps.sh installs it)";
    let Some(python) = prereq::env("GCS_PYTHON", DEPS) else { return };
    if !prereq::program(&python, DEPS) {
        return;
    }
    let file = model_dir().join("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !file.is_file() {
        prereq::missing(&file.display().to_string(), "run scripts/fetch-models.sh smollm2");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let key = create_key(&tmp.path().join("gw"));
    let gw = Node::start(&tmp.path().join("gw"), HEARTBEAT_MS, &["--role", "gateway"]);
    let mut workers: Vec<Node> =
        (0..2).map(|i| worker(&tmp.path().join(format!("w{i}")), &gw)).collect();
    wait_for_workers(&gw, &key, 2, &workers);
    for (i, temperature) in ["0", "0.8"].into_iter().enumerate() {
        let killed = sdk_run(&python, &gw, &key, &workers, temperature);
        let w = workers.iter_mut().position(|w| w.child.id() == killed);
        let w = w.unwrap_or_else(|| panic!("pid {killed} is not one of the workers"));
        let status = workers[w].child.wait().unwrap();
        assert!(!status.success(), "the killed worker exited by the signal: {status}");
        workers.remove(w);
        if i == 0 {
            // Seeded sampling, with a fresh second worker beside the survivor
            // (once the killed one's registration has lapsed).
            wait_for_workers(&gw, &key, 1, &workers);
            workers.push(worker(&tmp.path().join("w2"), &gw));
            wait_for_workers(&gw, &key, 2, &workers);
        }
    }
}
