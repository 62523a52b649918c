//! Real `gcs-node` processes on loopback: start, wait for health, kill -9,
//! SIGSTOP/SIGCONT, restart on the same ports and data directory, RSS.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::client::request_json;
use crate::scenario::{NodeSpec, Role};
use crate::Error;

/// Where the `gcs-node` binary is: the flag, `GCS_NODE_BIN`, next to this
/// executable (or one level up, for test executables in `deps/`), or the
/// shared target directory.
pub fn locate_gcs_node(flag: Option<&Path>) -> Result<PathBuf, Error> {
    if let Some(p) = flag {
        return Ok(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("GCS_NODE_BIN") {
        return Ok(PathBuf::from(p));
    }
    let mut candidates = vec![];
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            candidates.push(dir.join("gcs-node"));
            candidates.push(dir.join("../gcs-node"));
        }
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default().join(".cache/gcs/target")
    });
    candidates.push(target.join("debug/gcs-node"));
    candidates.push(target.join("release/gcs-node"));
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| Error::Setup("gcs-node not found: build it or pass --gcs-node".into()))
}

/// The model cache the nodes read (`GCS_MODEL_DIR` or `~/.cache/gcs/models`).
pub fn model_dir() -> PathBuf {
    std::env::var_os("GCS_MODEL_DIR").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default().join(".cache/gcs/models")
    })
}

/// Whether the chat model is present.
pub fn models_present() -> bool {
    model_dir().join("smollm2-135m-instruct").is_dir()
}

fn free_port() -> Result<u16, Error> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// One node process and how to start it again.
#[derive(Debug)]
pub struct Node {
    /// Scenario name.
    pub name: String,
    /// What it runs.
    pub role: Role,
    /// HTTP address (gateway and all roles serve it).
    pub http: SocketAddr,
    /// libp2p TCP port.
    pub p2p: u16,
    /// Data directory.
    pub dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
    /// Restarts so far (log files are numbered by it).
    pub starts: u32,
    /// Stopped with SIGSTOP.
    pub stopped: bool,
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.stopped {
            let _ = self.signal("CONT");
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Node {
    /// Process id while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Starts (or restarts) the process with its recorded arguments.
    pub fn spawn(&mut self, bin: &Path) -> Result<(), Error> {
        let log = std::fs::File::create(self.dir.join(format!("node.{}.log", self.starts)))?;
        let out = std::fs::File::create(self.dir.join(format!("stdout.{}.log", self.starts)))?;
        let child = Command::new(bin)
            .args(["--data-dir", &self.dir.to_string_lossy(), "--no-mdns"])
            .args(["--role", self.role.as_str(), "--http", &self.http.to_string()])
            .args(["--listen", &format!("/ip4/127.0.0.1/tcp/{}", self.p2p)])
            .args(&self.args)
            .env("RUST_LOG", std::env::var("NETSIM_NODE_LOG").unwrap_or("info,libp2p=warn".into()))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        self.starts += 1;
        self.stopped = false;
        Ok(())
    }

    /// kill -9.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.stopped = false;
    }

    /// Sends a signal by name (STOP, CONT) with kill(1): no unsafe code here.
    pub fn signal(&mut self, sig: &str) -> Result<(), Error> {
        let pid =
            self.pid().ok_or_else(|| Error::Setup(format!("{} is not running", self.name)))?;
        let ok = Command::new("kill").args([format!("-{sig}"), pid.to_string()]).status()?;
        if !ok.success() {
            return Err(Error::Setup(format!("kill -{sig} {pid} failed")));
        }
        self.stopped = sig == "STOP";
        Ok(())
    }

    /// Resident set size in KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid()?)).ok()?;
        let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    /// Whether HTTP answers at all (any status).
    pub fn http_up(&self) -> bool {
        request_json(self.http, "GET", "/health", "", b"").is_ok()
    }

    /// Waits for `/health` to answer 200 (a capable worker is registered).
    pub fn wait_healthy(&self, timeout: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if matches!(request_json(self.http, "GET", "/health", "", b""), Ok((200, _))) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(Error::Setup(format!("{} never became healthy; see {}", self.name, self.dir.display())))
    }

    /// Jobs this node's worker runs now, from `/metrics` (role all only).
    pub fn active_jobs(&self) -> Option<u64> {
        self.metric("gcs_worker_active_jobs").map(|v| v as u64)
    }

    /// One unlabelled gauge or counter from `/metrics`.
    pub fn metric(&self, name: &str) -> Option<f64> {
        use std::io::{Read, Write};
        let mut s =
            std::net::TcpStream::connect_timeout(&self.http, Duration::from_secs(1)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        let prefix = format!("{name} ");
        let line = out.lines().find(|l| l.starts_with(&prefix))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }
}

/// Creates an API key in a gateway's data directory with `gcs-node keys create`.
pub fn create_key(bin: &Path, dir: &Path) -> Result<String, Error> {
    std::fs::create_dir_all(dir)?;
    let out = Command::new(bin)
        .args(["keys", "create", "--data-dir", &dir.to_string_lossy()])
        .args(["--tenant", "netsim", "--project", "netsim"])
        .output()?;
    if !out.status.success() {
        return Err(Error::Setup(String::from_utf8_lossy(&out.stderr).into_owned()));
    }
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    BufReader::new(text.as_bytes())
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.split_whitespace().find(|w| w.starts_with("gnus_")).map(str::to_string))
        .ok_or_else(|| Error::Setup("keys create printed no key".into()))
}

/// A running topology.
#[derive(Debug)]
pub struct Cluster {
    /// The gcs-node binary.
    pub bin: PathBuf,
    /// Nodes by scenario name, in start order.
    pub nodes: BTreeMap<String, Node>,
    /// An API key per node that serves HTTP.
    pub keys: BTreeMap<String, String>,
}

impl Cluster {
    /// Starts every node: nodes without `bootstrap` first, then the rest
    /// dialling them, then waits until every gateway is healthy.
    pub fn start(bin: &Path, root: &Path, specs: &[NodeSpec]) -> Result<Cluster, Error> {
        let mut c =
            Cluster { bin: bin.to_path_buf(), nodes: BTreeMap::new(), keys: BTreeMap::new() };
        for s in specs {
            let dir = root.join(&s.name);
            std::fs::create_dir_all(&dir)?;
            if s.role != Role::Worker {
                c.keys.insert(s.name.clone(), create_key(bin, &dir)?);
            }
            let mut args = s.args.clone();
            for b in &s.bootstrap {
                let peer = c.nodes.get(b).ok_or_else(|| {
                    Error::Setup(format!("{}: bootstrap {b} must come first", s.name))
                })?;
                args.extend(["--bootstrap".into(), format!("/ip4/127.0.0.1/tcp/{}", peer.p2p)]);
            }
            let http = SocketAddr::from(([127, 0, 0, 1], free_port()?));
            let mut n = Node {
                name: s.name.clone(),
                role: s.role,
                http,
                p2p: free_port()?,
                dir,
                args,
                child: None,
                starts: 0,
                stopped: false,
            };
            n.spawn(bin)?;
            c.nodes.insert(s.name.clone(), n);
        }
        for n in c.nodes.values().filter(|n| n.role != Role::Worker) {
            n.wait_healthy(Duration::from_secs(120))?;
        }
        // Health needs one worker; traffic aimed at a topology needs all of
        // them registered, and a gossip heartbeat (1 s) for the mesh.
        let workers = specs.iter().filter(|s| s.role != Role::Gateway).count();
        let deadline = Instant::now() + Duration::from_secs(60);
        for n in c.nodes.values().filter(|n| n.role == Role::Gateway) {
            while n.metric("gcs_fresh_registrations").unwrap_or(0.0) < workers as f64 {
                if Instant::now() > deadline {
                    return Err(Error::Setup(format!("{}: not every worker registered", n.name)));
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        std::thread::sleep(Duration::from_millis(1500));
        Ok(c)
    }

    /// A node by name.
    pub fn node(&mut self, name: &str) -> Result<&mut Node, Error> {
        self.nodes.get_mut(name).ok_or_else(|| Error::Setup(format!("no node {name}")))
    }

    /// Every node that runs a worker, with its active job count when it
    /// serves metrics.
    pub fn busy_workers(&self) -> Vec<String> {
        self.nodes
            .values()
            .filter(|n| n.role == Role::All && n.pid().is_some() && !n.stopped)
            .filter(|n| n.active_jobs().unwrap_or(0) > 0)
            .map(|n| n.name.clone())
            .collect()
    }
}
