//! The OpenAI-compatible API end to end, over real TCP, with the real
//! engine, driven by the official SDKs and plain wire-level clients:
//!
//! - node A: `--role all` (gateway + worker), the first-start key it prints,
//!   extra keys made with `gcs-node keys create` while it runs;
//! - node B: `--role gateway` joined to A over libp2p, small stream buffer
//!   (two-node streaming, nginx in front, a client reading 1 byte/s);
//! - node C: `--role gateway` with no worker anywhere (503);
//! - headless Chromium streaming with fetch() from a page.
//!
//! The checks live in tests/sdk/ (Python SDK, JavaScript SDK, raw SSE);
//! `scripts/test-deps.sh` installs what they need and the README's test
//! command exports GCS_PYTHON, GCS_JS_DIR, GCS_NGINX and GCS_CHROMIUM.
//! Without them (a bare `cargo test`) this test says SKIP; under `CI=true`
//! each missing one is a failure that names it (tests/support/prereq.rs).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/ports.rs"]
mod ports;
#[path = "../../tests/support/prereq.rs"]
mod prereq;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gcs-node");

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

use ports::spare_port as free_port;

/// A node process, killed when dropped.
struct Node {
    child: Child,
    http: u16,
    p2p: u16,
    dir: PathBuf,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Node {
    fn start(dir: &Path, args: &[&str]) -> Node {
        std::fs::create_dir_all(dir).unwrap();
        let (http, p2p) = (free_port(), free_port());
        let log = std::fs::File::create(dir.join("node.log")).unwrap();
        let child = Command::new(BIN)
            .args(["--data-dir", dir.to_str().unwrap(), "--no-mdns"])
            .args(["--http", &format!("127.0.0.1:{http}")])
            .args(["--listen", &format!("/ip4/127.0.0.1/tcp/{p2p}")])
            .args(args)
            .env("RUST_LOG", "info,libp2p=warn")
            .stdout(if args.contains(&"all") { Stdio::piped() } else { Stdio::null() })
            .stderr(log)
            .spawn()
            .unwrap();
        Node { child, http, p2p, dir: dir.to_path_buf() }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.http)
    }

    /// The key a first `--role all` start prints on stdout. stdout keeps
    /// being drained afterwards (a closed pipe would fail the node's prints).
    fn printed_key(&mut self) -> String {
        let out = self.child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Some(k) = line.split_whitespace().find(|w| w.starts_with("gnus_")) {
                    let _ = tx.try_send(k.to_string());
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| {
            panic!("the node printed no key; see {}", self.dir.join("node.log").display())
        })
    }

    fn get(&self, path: &str) -> (u16, String) {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.http)) else {
            return (0, String::new());
        };
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        (status, out)
    }

    fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(90);
        while Instant::now() < deadline {
            if self.get("/health").0 == 200 {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("node never became healthy; see {}", self.dir.join("node.log").display());
    }
}

fn create_key(dir: &Path, extra: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(["keys", "create", "--data-dir", dir.to_str().unwrap()])
        .args(["--tenant", "acme", "--project", "tests"])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn run(what: &str, cmd: &mut Command) {
    let t = Instant::now();
    let status = cmd.current_dir(root()).status().unwrap();
    assert!(status.success(), "{what} failed ({status})");
    eprintln!("{what}: ok in {:.1}s", t.elapsed().as_secs_f64());
}

#[test]
fn openai_sdks_curl_nginx_and_slow_clients_against_real_nodes() {
    const DEPS: &str = "run `bash scripts/test.sh` (scripts/test-deps.sh installs it)";
    let Some(python) = prereq::env("GCS_PYTHON", DEPS) else { return };
    let Some(js_dir) = prereq::env("GCS_JS_DIR", DEPS) else { return };
    let Some(nginx) = prereq::env("GCS_NGINX", DEPS) else { return };
    let Some(chromium) = prereq::env("GCS_CHROMIUM", DEPS) else { return };
    for prog in [python.as_str(), "node", "curl", "openssl", nginx.as_str(), chromium.as_str()] {
        if !prereq::program(prog, DEPS) {
            return;
        }
    }
    let models = std::env::var_os("GCS_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| dirs_home().join(".cache/gcs/models"));
    if !models.join("smollm2-135m-instruct").is_dir() {
        let what = format!("models in {}", models.display());
        prereq::missing(&what, "run scripts/fetch-models.sh");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (da, db, dc) = (tmp.path().join("a"), tmp.path().join("b"), tmp.path().join("c"));

    // C: a gateway alone. B: a gateway that will join A. Keys made before start.
    std::fs::create_dir_all(&db).unwrap();
    std::fs::create_dir_all(&dc).unwrap();
    let key_b = create_key(&db, &[]);
    let key_c = create_key(&dc, &[]);
    // large_response streams 2000 tokens: ~75 s of decode at this context
    // on a quiet 2-core machine, so the default 120 s wall clock would make
    // the check depend on the machine's load rather than on the stream.
    let mut a = Node::start(
        &da,
        &["--role", "all", "--keepalive-ms", "300", "--wall-timeout-ms", "300000"],
    );
    let key_a = a.printed_key();
    a.wait_healthy();
    // Keys created while A runs are picked up without a restart.
    let key_embed = create_key(&da, &["--models", "gnus-embed"]);
    let key_rpm1 = create_key(&da, &["--rpm", "1"]);
    let c = Node::start(&dc, &["--role", "gateway"]);
    let bootstrap = format!("/ip4/127.0.0.1/tcp/{}", a.p2p);
    let b = Node::start(
        &db,
        &["--role", "gateway", "--bootstrap", &bootstrap, "--stream-buffer-bytes", "16384"],
    );
    b.wait_healthy();
    // No key text anywhere in the data directories.
    for d in [&da, &db, &dc] {
        for k in [&key_a, &key_b, &key_c, &key_embed, &key_rpm1] {
            let f = std::fs::read_to_string(d.join("api_keys.json")).unwrap();
            assert!(!f.contains(&k[5..]), "key text stored in {}", d.display());
        }
    }
    let env = |cmd: &mut Command| {
        cmd.env("GCS_BASE_URL", a.url())
            .env("GCS_KEY", &key_a)
            .env("GCS_KEY_EMBED", &key_embed)
            .env("GCS_KEY_RPM1", &key_rpm1)
            .env("GCS_BASE_URL_EMPTY", c.url())
            .env("GCS_KEY_EMPTY", &key_c)
            .env("GCS_BASE_URL_GW", b.url())
            .env("GCS_KEY_GW", &key_b)
            .env("GCS_GW_PID", b.child.id().to_string())
            .env("GCS_JS_DIR", &js_dir);
    };
    let mut py = Command::new(&python);
    py.arg("tests/sdk/openai_python.py");
    env(&mut py);
    run("OpenAI Python SDK", &mut py);
    let mut batch = Command::new(&python);
    batch.arg("tests/sdk/openai_batch.py");
    env(&mut batch);
    // The 1,000-line files, chat and embeddings (~90 s here).
    batch.env("GCS_BATCH_CHAT_LINES", "1000").env("GCS_BATCH_EMBED_LINES", "1000");
    run("OpenAI Python SDK: Files and Batches", &mut batch);
    let mut node = Command::new("node");
    node.arg("tests/sdk/openai_js.mjs");
    env(&mut node);
    run("OpenAI JavaScript SDK", &mut node);
    let mut raw = Command::new(&python);
    raw.args(["tests/sdk/streaming.py", "curl", "two_node", "slow_client", "nginx"]);
    raw.env("GCS_NGINX", &nginx);
    env(&mut raw);
    run("SSE on the wire (curl, two nodes, slow client, nginx)", &mut raw);
    let mut page = Command::new("node");
    page.arg("tests/sdk/browser.mjs").env("GCS_CHROMIUM", &chromium);
    env(&mut page);
    run("headless Chromium fetch streaming", &mut page);
    // HTTPS without an edge proxy: a self-signed certificate, curl -k.
    let cert = tmp.path().join("cert.pem");
    let pkey = tmp.path().join("key.pem");
    let out = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"])
        .args(["-nodes", "-days", "1", "-subj", "/CN=localhost"])
        .arg("-keyout")
        .arg(&pkey)
        .arg("-out")
        .arg(&cert)
        .output()
        .unwrap();
    assert!(out.status.success(), "openssl req: {}", String::from_utf8_lossy(&out.stderr));
    let dt = tmp.path().join("tls");
    let mut t = Node::start(
        &dt,
        &[
            "--role",
            "gateway",
            "--bootstrap",
            &bootstrap,
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            pkey.to_str().unwrap(),
        ],
    );
    let key_t = create_key(&dt, &[]);
    let url = format!("https://127.0.0.1:{}/v1/models", t.http);
    let https_models = || {
        let out = Command::new("curl")
            .args(["-sk", "--max-time", "10", "-H", &format!("Authorization: Bearer {key_t}")])
            .arg(&url)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let body = loop {
        let body = https_models();
        if body.contains("gnus-auto") || Instant::now() > deadline {
            break body;
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(body.contains("\"gnus-auto\""), "HTTPS /v1/models: {body}");
    // Plain HTTP to the TLS port is not answered as HTTP: the port accepts
    // the connection (the node is up) but no HTTP status line comes back,
    // and the node still answers HTTPS afterwards.
    let mut plain = TcpStream::connect(("127.0.0.1", t.http)).expect("the TLS port accepts TCP");
    plain.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    plain.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut answer = vec![];
    let _ = plain.read_to_end(&mut answer);
    assert!(
        !answer.starts_with(b"HTTP/"),
        "plain HTTP answered on the TLS port: {}",
        String::from_utf8_lossy(&answer)
    );
    assert!(t.child.try_wait().unwrap().is_none(), "the TLS gateway exited");
    assert!(https_models().contains("\"gnus-auto\""), "HTTPS after a plain-HTTP request");
    // A client offering HTTP/2 (ALPN h2) is served over it.
    let out = Command::new("curl")
        .args(["-sk", "--http2", "--max-time", "10", "-o", "/dev/null", "-w", "%{http_version}"])
        .args(["-H", &format!("Authorization: Bearer {key_t}")])
        .arg(&url)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "2", "HTTPS /v1/models over HTTP/2");
    eprintln!("HTTPS gateway: ok");
    let (status, metrics) = a.get("/metrics");
    assert_eq!(status, 200);
    for m in ["gcs_ttft_seconds_count", "gcs_tokens_generated_total", "gcs_worker_active_jobs 0"] {
        assert!(metrics.contains(m), "{m} missing from /metrics");
    }
}

fn dirs_home() -> PathBuf {
    std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default()
}
