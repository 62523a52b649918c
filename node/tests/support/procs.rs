//! `gcs-node` processes for the integration tests that run the real binary
//! over TCP and libp2p (`#[path]`-included: each test is its own crate).
//! A [`Node`] is killed when dropped, so a failing assertion leaves no
//! process behind.

#![allow(dead_code)] // each test uses its own part

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_gcs-node");

#[path = "../../../tests/support/ports.rs"]
mod ports;
pub use ports::spare_port as free_port;

/// Where scripts/fetch-models.sh put the models (`GCS_MODEL_DIR` or the cache).
pub fn model_dir() -> PathBuf {
    std::env::var_os("GCS_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/gcs/models"))
}

/// A node process, killed when dropped.
pub struct Node {
    pub child: Child,
    pub http: u16,
    pub p2p: u16,
    pub log: PathBuf,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Node {
    /// Starts `gcs-node` on loopback ports with `dir` as its data dir,
    /// registrations every `heartbeat_ms`, and `args`; its log is
    /// `dir/node.log`.
    pub fn start(dir: &Path, heartbeat_ms: u64, args: &[&str]) -> Node {
        Self::start_with_env(dir, heartbeat_ms, args, &[])
    }

    /// [`Node::start`] with `env` set for the node alone (tests share a
    /// process: setting it there would reach their nodes too).
    pub fn start_with_env(
        dir: &Path,
        heartbeat_ms: u64,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Node {
        std::fs::create_dir_all(dir).unwrap();
        let (http, p2p) = (free_port(), free_port());
        let log = dir.join("node.log");
        let child = Command::new(BIN)
            .args(["--data-dir", dir.to_str().unwrap(), "--no-mdns"])
            .args(["--http", &format!("127.0.0.1:{http}")])
            .args(["--listen", &format!("/ip4/127.0.0.1/tcp/{p2p}")])
            .args(["--heartbeat-ms", &heartbeat_ms.to_string()])
            .args(args)
            .env("RUST_LOG", std::env::var("GCS_TEST_NODE_LOG").unwrap_or_else(|_| "info,libp2p=warn".into()))
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Node { child, http, p2p, log }
    }

    /// The multiaddr other nodes bootstrap from.
    pub fn bootstrap(&self) -> String {
        format!("/ip4/127.0.0.1/tcp/{}", self.p2p)
    }

    /// One HTTP/1.1 request: (status, body); (0, "") when nothing listens.
    pub fn request(&self, method: &str, path: &str, key: &str, body: &str) -> (u16, String) {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.http)) else {
            return (0, String::new());
        };
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
             Authorization: Bearer {key}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        (status, body)
    }

    /// A 200 answer's JSON body (panics with the node's log otherwise).
    pub fn json(&self, method: &str, path: &str, key: &str, body: &str) -> Value {
        let (status, text) = self.request(method, path, key, body);
        assert_eq!(status, 200, "{method} {path}: {text}\nlog: {}", tail(&self.log));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }
}

/// The last ~4 KB of a log.
pub fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let start = text.len().saturating_sub(4000);
    let start = (start..text.len()).find(|&i| text.is_char_boundary(i)).unwrap_or(0);
    text[start..].to_string()
}

/// A fresh API key of tenant `acme` in the gateway's data dir.
pub fn create_key(dir: &Path) -> String {
    let out = Command::new(BIN)
        .args(["keys", "create", "--data-dir", dir.to_str().unwrap()])
        .args(["--tenant", "acme", "--project", "tests"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The node id of the ed25519 seed (hex) in `file`.
pub fn id_of(file: &Path) -> String {
    let hex = std::fs::read_to_string(file).unwrap();
    let bytes: Vec<u8> =
        (0..64).step_by(2).map(|i| u8::from_str_radix(&hex.trim()[i..i + 2], 16).unwrap()).collect();
    gcs_protocol::NodeKey::from_seed(bytes.try_into().unwrap()).node_id().to_string()
}

/// Makes the gateway in `dir` (not started yet) a tenant gateway of
/// `acme` (specs/batch.md, "trust"): its identity, an API key (returned,
/// with the `--trust-tenant` value its workers take), and `tenants admit
/// --gateway` of it.
pub fn admitted_gateway(dir: &Path) -> (String, String) {
    std::fs::create_dir_all(dir).unwrap();
    let seed: String = (0..32u8).map(|i| format!("{:02x}", i.wrapping_mul(31).wrapping_add(7))).collect();
    std::fs::write(dir.join("identity.key"), seed).unwrap();
    let gw_id = id_of(&dir.join("identity.key"));
    let key = create_key(dir);
    let cert = dir.join("gw.cert");
    let out = Command::new(BIN)
        .args(["tenants", "admit", "--data-dir", dir.to_str().unwrap(), "--tenant", "acme"])
        .args(["--node", &gw_id, "--gateway", "--out", cert.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let issuer = id_of(&dir.join("tenants/tenant.acme.key"));
    (key, format!("acme={issuer}"))
}
