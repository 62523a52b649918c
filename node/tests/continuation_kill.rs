//! Exact continuation end to end (issue 16): a `--role gateway` process and
//! `--role worker` processes serving the real SmolLM2 file, over TCP and
//! libp2p. A streamed 120-token chat completion whose lease holder is
//! killed (SIGKILL) after ~40 tokens continues on the other worker: the
//! client's text equals an uninterrupted run's, byte for byte, with no SSE
//! error event, and its usage counts equal the reference's — greedy, and
//! seeded temperature-0.8 sampling. Needs the model; skips otherwise.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;
#[path = "support/procs.rs"]
mod procs;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use procs::{create_key, model_dir, tail, Node};

use serde_json::Value;

/// Tokens streamed before the holder is killed.
const KILL_AFTER: usize = 40;

/// Registrations every 300 ms: a killed holder's loss is noticed sooner.
const HEARTBEAT_MS: u64 = 300;

fn gateway(dir: &Path) -> Node {
    Node::start(dir, HEARTBEAT_MS, &["--role", "gateway"])
}

fn worker(dir: &Path, gw: &Node) -> Node {
    let boot = gw.bootstrap();
    let args = ["--role", "worker", "--bootstrap", &boot, "--model", "smollm2-135m-instruct"];
    Node::start(dir, HEARTBEAT_MS, &args)
}

/// A GET's body ("" when nothing answers).
fn get(n: &Node, path: &str, key: &str) -> String {
    n.request("GET", path, key, "").1
}

/// A counter in the gateway's `/metrics`.
fn counter(gw: &Node, key: &str, name: &str) -> u64 {
    let m = get(gw, "/metrics", key);
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0)
}

/// User + system CPU ticks of a node process so far (Linux `/proc`).
fn cpu_ticks(n: &Node) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", n.child.id())).unwrap_or_default();
    // Fields after the command name, which is in parentheses.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let at = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    at(11) + at(12)
}

/// What a client saw of one stream.
#[derive(Debug, Default)]
struct Seen {
    text: String,
    usage: Value,
    errors: Vec<String>,
    done: bool,
    content_chunks: usize,
    /// The longest wait between two content chunks (the seam, when a
    /// holder was lost).
    max_gap: Duration,
}

/// Reads one HTTP/1.1 chunked body's data, a chunk at a time.
struct Chunked<R> {
    r: R,
    buf: Vec<u8>,
    eof: bool,
}

impl<R: BufRead> Chunked<R> {
    /// The next complete line of the body, without its end.
    fn line(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return Some(String::from_utf8_lossy(&line).trim_end().to_string());
            }
            if self.eof {
                return None;
            }
            let mut size = String::new();
            if self.r.read_line(&mut size).unwrap_or(0) == 0 {
                self.eof = true;
                continue;
            }
            let Ok(n) = usize::from_str_radix(size.trim(), 16) else { continue };
            if n == 0 {
                self.eof = true;
                continue;
            }
            let mut data = vec![0; n + 2];
            if self.r.read_exact(&mut data).is_err() {
                self.eof = true;
                continue;
            }
            data.truncate(n);
            self.buf.extend_from_slice(&data);
        }
    }
}

/// Streams `body` from the gateway; `at_tokens` runs once after that many
/// content chunks (each is one token here).
fn stream(gw: &Node, key: &str, body: &Value, mut at_tokens: Option<&mut dyn FnMut()>) -> Seen {
    let body = body.to_string();
    let mut s = TcpStream::connect(("127.0.0.1", gw.http)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Authorization: Bearer {key}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    let mut status = String::new();
    r.read_line(&mut status).unwrap();
    assert!(status.contains(" 200 "), "{status}\ngateway: {}", tail(&gw.log));
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        if h.trim().is_empty() {
            break;
        }
    }
    let mut body = Chunked { r, buf: vec![], eof: false };
    let mut seen = Seen::default();
    let mut last: Option<Instant> = None;
    while let Some(line) = body.line() {
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            seen.done = true;
            break;
        }
        let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
        if v.get("error").is_some() {
            seen.errors.push(data.to_string());
            continue;
        }
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            seen.text.push_str(c);
            seen.content_chunks += 1;
            if let Some(t) = last {
                seen.max_gap = seen.max_gap.max(t.elapsed());
            }
            last = Some(Instant::now());
            if seen.content_chunks == KILL_AFTER {
                if let Some(f) = at_tokens.take() {
                    f();
                }
            }
        }
        if !v["usage"].is_null() {
            seen.usage = v["usage"].clone();
        }
    }
    seen
}

fn request(temperature: f64) -> Value {
    serde_json::json!({
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}],
        // Long enough that the holder is still decoding through the whole
        // 500 ms sampling window after KILL_AFTER tokens: at ~200 tok/s, 120
        // tokens ended inside it and the holder looked no busier than the
        // idle worker ([35, 14] CPU ticks, seen once in CI).
        "max_tokens": 400,
        "temperature": temperature,
        "seed": 1234,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

fn wait_for_workers(gw: &Node, key: &str, n: u64, workers: &[&Node]) {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let m: Value = serde_json::from_str(&get(gw, "/v1/models", key)).unwrap_or(Value::Null);
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

/// Streams `body` twice: uninterrupted, then with its lease holder among
/// `workers` killed after [`KILL_AFTER`] tokens; the two must be equal.
fn killed_mid_stream_equals_reference(gw: &Node, key: &str, body: &Value, workers: &mut [Node]) {
    let reference = stream(gw, key, body, None);
    assert!(reference.errors.is_empty() && reference.done, "{reference:?}");
    assert!(
        reference.content_chunks > KILL_AFTER + 10,
        "the reference must run past the kill point: {reference:?}"
    );
    let started = counter(gw, key, "gcs_continuations_started_total");
    let succeeded = counter(gw, key, "gcs_continuations_succeeded_total");
    let t0 = Instant::now();
    let mut killed = None;
    let mut kill = || {
        // The holder is the worker that is computing: workers serve no
        // HTTP (no /metrics), and an idle worker only heartbeats.
        let before: Vec<u64> = workers.iter().map(cpu_ticks).collect();
        std::thread::sleep(Duration::from_millis(500));
        let busy: Vec<u64> =
            workers.iter().zip(&before).map(|(w, b)| cpu_ticks(w).saturating_sub(*b)).collect();
        let i = (0..workers.len()).max_by_key(|&i| busy[i]).unwrap();
        assert!(
            busy.iter().filter(|&&b| b * 3 > busy[i]).count() == 1,
            "one busy worker: {busy:?}"
        );
        workers[i].child.kill().unwrap();
        killed = Some(i);
    };
    let seen = stream(gw, key, body, Some(&mut kill));
    let i = killed.expect("the holder was killed mid-stream");
    eprintln!(
        "T={}: killed worker {i} after {KILL_AFTER} tokens; stream done in {:.1}s; \
         longest gap between tokens {} ms (reference: {} ms)",
        body["temperature"],
        t0.elapsed().as_secs_f64(),
        seen.max_gap.as_millis(),
        reference.max_gap.as_millis()
    );
    assert_eq!(counter(gw, key, "gcs_continuations_started_total"), started + 1, "it continued");
    assert_eq!(counter(gw, key, "gcs_continuations_succeeded_total"), succeeded + 1);
    assert!(
        seen.errors.is_empty(),
        "no SSE error event: {:?}\ngateway: {}",
        seen.errors,
        tail(&gw.log)
    );
    assert!(seen.done, "the stream ends with [DONE]");
    assert_eq!(seen.text, reference.text, "the continued text equals the uninterrupted run's");
    // Every token once. `cached_tokens` is left out: it says which worker's
    // prefix cache held the prompt (the survivor may have it from the
    // reference run), not what was generated.
    let counts = |u: &Value| {
        let n = |k: &str| u[k].as_u64();
        (n("prompt_tokens"), n("completion_tokens"), n("total_tokens"))
    };
    assert_eq!(counts(&seen.usage), counts(&reference.usage), "usage counts every token once");
    assert!(counts(&seen.usage).1.is_some(), "{:?}", seen.usage);
    let cached = seen.usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert!(cached <= seen.usage["prompt_tokens"].as_u64().unwrap(), "{:?}", seen.usage);
    assert_eq!(
        seen.usage["completion_tokens"].as_u64(),
        Some(reference.content_chunks as u64),
        "one token per content chunk"
    );
}

#[test]
fn a_stream_survives_its_worker_killed_mid_stream_byte_for_byte() {
    let file = model_dir().join("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !file.is_file() {
        prereq::missing(&file.display().to_string(), "run scripts/fetch-models.sh smollm2");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let key = create_key(&tmp.path().join("gw"));
    let gw = gateway(&tmp.path().join("gw"));
    let mut workers: Vec<Node> =
        (0..2).map(|i| worker(&tmp.path().join(format!("w{i}")), &gw)).collect();
    wait_for_workers(&gw, &key, 2, &workers.iter().collect::<Vec<_>>());
    killed_mid_stream_equals_reference(&gw, &key, &request(0.0), &mut workers);

    // Seeded sampling, with a fresh second worker beside the survivor.
    workers.retain_mut(|w| w.child.try_wait().ok().flatten().is_none());
    workers.push(worker(&tmp.path().join("w2"), &gw));
    wait_for_workers(&gw, &key, 2, &workers.iter().collect::<Vec<_>>());
    killed_mid_stream_equals_reference(&gw, &key, &request(0.8), &mut workers);
}
