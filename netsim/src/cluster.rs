//! Real `gcs-node` processes on loopback (or one network namespace each):
//! start, wait for health, kill -9, SIGSTOP/SIGCONT, restart on the same
//! ports and data directory, cut and heal links, skew a clock, RSS.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::client::request_json;
use crate::netns::Netns;
use crate::scenario::{NetworkMode, NodeSpec, Role};
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
    find_built("gcs-node", &["debug", "release"])
        .ok_or_else(|| Error::Setup("gcs-node not found: build it or pass --gcs-node".into()))
}

/// Where the `netsim` binary is (it also runs the adversary): `NETSIM_BIN`,
/// this executable when it is netsim, next to a test executable in `deps/`,
/// or the shared target directory.
pub fn locate_netsim() -> Result<PathBuf, Error> {
    if let Some(p) = std::env::var_os("NETSIM_BIN") {
        return Ok(PathBuf::from(p));
    }
    if let Ok(exe) = std::env::current_exe() {
        if exe.file_name().is_some_and(|n| n == "netsim") {
            return Ok(exe);
        }
    }
    find_built("netsim", &["debug"])
        .ok_or_else(|| Error::Setup("netsim binary not found (set NETSIM_BIN)".into()))
}

/// The first file named `name` beside this executable, one level up from
/// it, or in the shared target directory under one of `profiles`.
fn find_built(name: &str, profiles: &[&str]) -> Option<PathBuf> {
    let mut candidates = vec![];
    if let Some(dir) = std::env::current_exe().ok().as_deref().and_then(Path::parent) {
        candidates.push(dir.join(name));
        candidates.push(dir.join("..").join(name));
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default().join(".cache/gcs/target")
    });
    candidates.extend(profiles.iter().map(|p| target.join(p).join(name)));
    candidates.into_iter().find(|p| p.is_file())
}

/// libfaketime's preload library, if installed.
pub fn faketime_lib() -> Option<PathBuf> {
    [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
        "/usr/local/lib/faketime/libfaketime.so.1",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.is_file())
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

#[path = "../../tests/support/ports.rs"]
mod ports;

fn free_port() -> Result<u16, Error> {
    match ports::spare_port() {
        0 => Err(Error::Setup("no free local port".into())),
        p => Ok(p),
    }
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
    /// libp2p address and TCP port.
    pub ip: IpAddr,
    /// libp2p TCP port.
    pub p2p: u16,
    /// Data directory.
    pub dir: PathBuf,
    args: Vec<String>,
    /// The network namespace it runs in (netns mode).
    pub netns: Option<String>,
    /// Wall-clock skew in seconds (libfaketime).
    pub clock_skew_s: Option<i64>,
    /// The program when it is not gcs-node (the adversary).
    pub program: Option<PathBuf>,
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
        let program = self.program.clone().unwrap_or_else(|| bin.to_path_buf());
        // `ip netns exec` enters the namespace and execs the program: the
        // child's pid is the node's, so kill and signals reach it.
        let mut cmd = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&program);
                c
            }
            None => Command::new(&program),
        };
        let listen = format!("/ip4/{}/tcp/{}", self.ip, self.p2p);
        if self.role == Role::Adversary {
            cmd.arg("adversary");
        }
        cmd.args(["--data-dir", &self.dir.to_string_lossy()]);
        if self.role == Role::Adversary {
            cmd.args(["--listen", &listen]);
        } else {
            cmd.args(["--no-mdns", "--role", self.role.as_str()]).args([
                "--http",
                &self.http.to_string(),
                "--listen",
                &listen,
            ]);
        }
        if let Some(skew) = self.clock_skew_s {
            let lib = faketime_lib().ok_or_else(|| {
                Error::Setup("clock skew needs libfaketime (apt-get install libfaketime)".into())
            })?;
            cmd.env("LD_PRELOAD", lib)
                .env("FAKETIME", format!("{skew:+}s"))
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
                .env("FAKETIME_NO_CACHE", "1");
        }
        let child = cmd
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
        let out = self.metrics_text()?;
        let prefix = format!("{name} ");
        let line = out.lines().find(|l| l.starts_with(&prefix))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    /// The whole `/metrics` text.
    pub fn metrics_text(&self) -> Option<String> {
        use std::io::{Read, Write};
        let mut s =
            std::net::TcpStream::connect_timeout(&self.http, Duration::from_secs(1)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out.contains("HTTP/1.1 200").then_some(out)
    }

    /// The GCS node id, from the identity key in its data directory.
    pub fn node_id(&self) -> Option<String> {
        let text = std::fs::read_to_string(self.dir.join("identity.key")).ok()?;
        let hex = text.trim();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .filter_map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
            .collect();
        let seed: [u8; 32] = bytes.try_into().ok()?;
        Some(gcs_protocol::NodeKey::from_seed(seed).node_id().as_str().to_string())
    }

    /// Every log the node wrote, over all its starts.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for e in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with("node.") && name.ends_with(".log") {
                out.push_str(&std::fs::read_to_string(e.path()).unwrap_or_default());
            }
        }
        out
    }

    /// The keyspace's anti-entropy digest and entry count per globally
    /// replicated namespace, from `/metrics`.
    pub fn keyspace_digests(&self) -> Option<BTreeMap<String, (String, u64)>> {
        let text = self.metrics_text()?;
        let label = |l: &str, k: &str| {
            let at = l.find(&format!("{k}=\""))? + k.len() + 2;
            Some(l[at..].split('"').next()?.to_string())
        };
        let mut out: BTreeMap<String, (String, u64)> = BTreeMap::new();
        for l in text.lines() {
            if l.starts_with("gcs_keyspace_digest_info{") {
                let (ns, d) = (label(l, "namespace")?, label(l, "digest")?);
                out.entry(ns).or_default().0 = d;
            } else if l.starts_with("gcs_keyspace_entries{") {
                let ns = label(l, "namespace")?;
                let n = l.split_whitespace().last()?.parse().ok()?;
                out.entry(ns).or_default().1 = n;
            }
        }
        Some(out)
    }
}

/// A gateway's address and the API key `keys` holds for it (the traffic's
/// tenant or the reference tenant).
pub fn endpoint(
    cluster: &Cluster,
    keys: &BTreeMap<String, String>,
    gateway: &str,
) -> Result<(SocketAddr, String), Error> {
    let node = cluster.nodes.get(gateway).ok_or_else(|| Error::Setup(gateway.to_string()))?;
    Ok((node.http, keys.get(gateway).cloned().unwrap_or_default()))
}

/// Creates an API key of `tenant` in a gateway's data directory with
/// `gcs-node keys create`.
pub fn create_key(bin: &Path, dir: &Path, tenant: &str) -> Result<String, Error> {
    std::fs::create_dir_all(dir)?;
    let out = Command::new(bin)
        .args(["keys", "create", "--data-dir", &dir.to_string_lossy()])
        .args(["--tenant", tenant, "--project", "netsim"])
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

/// Issues `a` for the node of `dir` (its identity made now, as the node
/// would at start) from the tenant store of the gateway in `by`.
fn admit(by: &Path, dir: &Path, a: &crate::scenario::Admission, out: &Path) -> Result<(), Error> {
    use gcs_node::tenants::{Group, TenantError, TenantStore};
    let setup = |e: String| Error::Setup(format!("admission by {}: {e}", by.display()));
    let group = match (&a.tenant, &a.swarm) {
        (Some(t), None) => Group::Tenant(t.clone()),
        (None, Some(s)) => Group::Swarm(s.clone()),
        _ => return Err(setup("name one tenant or one swarm".into())),
    };
    let node = gcs_node::Identity::load_or_create(dir).map_err(|e| setup(e.to_string()))?.node_id();
    let store = TenantStore::new(by);
    match store.create(&group) {
        Ok(_) | Err(TenantError::Exists(_)) => {}
        Err(e) => return Err(setup(e.to_string())),
    }
    let (_, bytes) = store
        .admit(&group, &node, a.gateway, 3_600_000, gcs_node::now_ms())
        .map_err(|e| setup(e.to_string()))?;
    std::fs::write(out, bytes)?;
    Ok(())
}

/// The id of `tenant`'s membership key in the gateway data directory `by`
/// (made if missing): what a worker's `--trust-tenant` names.
fn tenant_issuer(by: &Path, tenant: &str) -> Result<String, Error> {
    use gcs_node::tenants::{Group, TenantError, TenantStore};
    let setup = |e: String| Error::Setup(format!("tenant {tenant} of {}: {e}", by.display()));
    let store = TenantStore::new(by);
    let group = Group::Tenant(tenant.into());
    match store.create(&group) {
        Ok(id) => Ok(id.to_string()),
        Err(TenantError::Exists(_)) => {
            Ok(store.key(&group).map_err(|e| setup(e.to_string()))?.node_id().to_string())
        }
        Err(e) => Err(setup(e.to_string())),
    }
}

/// The tenants every HTTP node of a cluster holds API keys of.
pub const SHARED_TENANTS: [&str; 2] = ["netsim", "netsim-reference"];

/// Where two or more nodes serve HTTP they are gateways of the same
/// tenants ([`SHARED_TENANTS`]), and a tenant's gateways take each other's
/// usage records only with the tenant's `tenant_gateway` certificate (issue
/// 14 §2). As an operator would: the first HTTP node's data directory makes
/// each tenant's key, every other HTTP node gets a copy (so it trusts the
/// same issuer and renews certificates), and each is admitted as the
/// tenant's gateway. Returns the `--membership` arguments per node.
fn share_tenants(
    root: &Path,
    specs: &[NodeSpec],
) -> Result<BTreeMap<String, Vec<String>>, Error> {
    use gcs_node::tenants::{Group, TenantError, TenantStore};
    let http: Vec<&NodeSpec> = specs.iter().filter(|s| s.role.serves_http()).collect();
    let mut out = BTreeMap::new();
    let Some(first) = http.first().filter(|_| http.len() > 1) else { return Ok(out) };
    let primary = root.join(&first.name);
    let store = TenantStore::new(&primary);
    for t in SHARED_TENANTS {
        match store.create(&Group::Tenant(t.into())) {
            Ok(_) | Err(TenantError::Exists(_)) => {}
            Err(e) => return Err(Error::Setup(format!("tenant {t}: {e}"))),
        }
    }
    for s in &http {
        let dir = root.join(&s.name);
        std::fs::create_dir_all(dir.join("tenants"))?;
        let mut args = vec![];
        for t in SHARED_TENANTS {
            let file = format!("tenants/tenant.{t}.key");
            if s.name != first.name {
                std::fs::copy(primary.join(&file), dir.join(&file))?;
                #[cfg(unix)]
                {
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(dir.join(&file), std::fs::Permissions::from_mode(0o600))?;
                }
            }
            let a = crate::scenario::Admission {
                by: first.name.clone(),
                tenant: Some(t.into()),
                swarm: None,
                gateway: true,
            };
            let cert = dir.join(format!("tenant-gateway-{t}.cert"));
            admit(&primary, &dir, &a, &cert)?;
            args.extend(["--membership".into(), cert.to_string_lossy().into_owned()]);
        }
        out.insert(s.name.clone(), args);
    }
    Ok(out)
}

/// How many of `specs` are workers that register with the gateways.
pub fn registering_workers(specs: &[NodeSpec]) -> usize {
    specs.iter().filter(|s| matches!(s.role, Role::Worker | Role::All) && s.registers).count()
}

/// Per running HTTP node: namespace → (anti-entropy digest, entries).
pub type Views = Vec<(String, BTreeMap<String, (String, u64)>)>;

/// A running topology.
#[derive(Debug)]
pub struct Cluster {
    /// The gcs-node binary.
    pub bin: PathBuf,
    /// Nodes by scenario name, in start order.
    pub nodes: BTreeMap<String, Node>,
    /// An API key per node that serves HTTP.
    pub keys: BTreeMap<String, String>,
    /// Per gateway: a key of another tenant for the unfaulted reference
    /// runs. The prefix cache is salted per tenant, so a reference run
    /// does not make the faulted run's prefill (the window a
    /// before-the-first-token fault aims at) a cache hit.
    pub reference_keys: BTreeMap<String, String>,
    /// Node index (for the namespaces) by name.
    pub index: BTreeMap<String, usize>,
    /// Nodes declared but not started yet (adversaries start after the
    /// reference answers).
    pub pending: Vec<NodeSpec>,
    /// The namespaces (netns mode). Declared last: dropped after the nodes
    /// are killed.
    pub netns: Option<Netns>,
}

/// How a cluster is laid out.
#[derive(Clone, Debug, Default)]
pub struct ClusterOpts {
    /// Loopback or namespaces.
    pub network: NetworkMode,
    /// The netsim binary (runs `adversary` nodes).
    pub netsim_bin: Option<PathBuf>,
}

impl Cluster {
    /// Starts every node: nodes without `bootstrap` first, then the rest
    /// dialling them, then waits until every gateway is healthy and knows
    /// every worker that registers. Adversary nodes are only prepared;
    /// [`Cluster::start_pending`] starts them.
    pub fn start(bin: &Path, root: &Path, specs: &[NodeSpec]) -> Result<Cluster, Error> {
        Self::start_with(bin, root, specs, &ClusterOpts::default())
    }

    /// [`Cluster::start`] with a layout.
    pub fn start_with(
        bin: &Path,
        root: &Path,
        specs: &[NodeSpec],
        opts: &ClusterOpts,
    ) -> Result<Cluster, Error> {
        let netns = match opts.network {
            NetworkMode::Loopback => None,
            NetworkMode::Netns => Some(Netns::create(specs.len())?),
        };
        let mut c = Cluster {
            bin: bin.to_path_buf(),
            nodes: BTreeMap::new(),
            keys: BTreeMap::new(),
            reference_keys: BTreeMap::new(),
            index: BTreeMap::new(),
            pending: vec![],
            netns,
        };
        let mut gateway_certs = share_tenants(root, specs)?;
        for (i, s) in specs.iter().enumerate() {
            c.index.insert(s.name.clone(), i);
            let dir = root.join(&s.name);
            std::fs::create_dir_all(&dir)?;
            if s.role.serves_http() {
                // Every gateway of the tenants takes the first one's API
                // keys, as an operator provisions them: a client may use
                // any of its tenant's gateways with one key.
                let first = specs.iter().find(|f| f.role.serves_http()).map(|f| root.join(&f.name));
                if let Some(first) = first.filter(|f| *f != dir) {
                    let file = first.join(gcs_gateway::keys::KEY_FILE);
                    if file.exists() {
                        std::fs::copy(&file, dir.join(gcs_gateway::keys::KEY_FILE))?;
                    }
                }
                c.keys.insert(s.name.clone(), create_key(bin, &dir, "netsim")?);
                c.reference_keys.insert(s.name.clone(), create_key(bin, &dir, "netsim-reference")?);
            }
            let mut args = s.args.clone();
            args.extend(gateway_certs.remove(&s.name).unwrap_or_default());
            for (k, a) in s.admitted.iter().enumerate() {
                let cert = dir.join(format!("membership-{k}.cert"));
                admit(&root.join(&a.by), &dir, a, &cert)?;
                args.extend(["--membership".into(), cert.to_string_lossy().into_owned()]);
            }
            for t in &s.trusts {
                let issuer = tenant_issuer(&root.join(&t.by), &t.tenant)?;
                args.extend(["--trust-tenant".into(), format!("{}={issuer}", t.tenant)]);
            }
            for b in &s.bootstrap {
                let peer = c.nodes.get(b).ok_or_else(|| {
                    Error::Setup(format!("{}: bootstrap {b} must come first", s.name))
                })?;
                args.extend(["--bootstrap".into(), format!("/ip4/{}/tcp/{}", peer.ip, peer.p2p)]);
            }
            // In a namespace every node has the whole port space to itself.
            let (ip, http_port, p2p, ns) = match &c.netns {
                Some(n) => (IpAddr::V4(n.addr(i)), 8080, 4001, Some(n.ns(i))),
                None => (IpAddr::V4(Ipv4Addr::LOCALHOST), free_port()?, free_port()?, None),
            };
            let program = if s.role == Role::Adversary {
                Some(opts.netsim_bin.clone().map_or_else(locate_netsim, Ok)?)
            } else {
                None
            };
            let mut n = Node {
                name: s.name.clone(),
                role: s.role,
                http: SocketAddr::new(ip, http_port),
                ip,
                p2p,
                dir,
                args,
                netns: ns,
                clock_skew_s: s.clock_skew_s,
                program,
                child: None,
                starts: 0,
                stopped: false,
            };
            if s.role == Role::Adversary {
                c.pending.push(s.clone());
            } else {
                n.spawn(bin)?;
            }
            c.nodes.insert(s.name.clone(), n);
        }
        for n in c.nodes.values().filter(|n| n.role.serves_http()) {
            n.wait_healthy(Duration::from_secs(120))?;
        }
        // Health needs one worker; traffic aimed at a topology needs all of
        // them registered, and a gossip heartbeat (1 s) for the mesh.
        c.wait_registrations(registering_workers(specs))?;
        std::thread::sleep(Duration::from_millis(1500));
        Ok(c)
    }

    /// Waits until every gateway knows `workers` fresh registrations.
    pub fn wait_registrations(&self, workers: usize) -> Result<(), Error> {
        let deadline = Instant::now() + Duration::from_secs(60);
        for n in self.nodes.values().filter(|n| n.role == Role::Gateway) {
            while n.metric("gcs_fresh_registrations").unwrap_or(0.0) < workers as f64 {
                if Instant::now() > deadline {
                    return Err(Error::Setup(format!("{}: not every worker registered", n.name)));
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        Ok(())
    }

    /// Starts the nodes held back by [`Cluster::start`] (adversaries).
    pub fn start_pending(&mut self) -> Result<usize, Error> {
        let bin = self.bin.clone();
        let pending = std::mem::take(&mut self.pending);
        for s in &pending {
            self.node(&s.name)?.spawn(&bin)?;
        }
        Ok(pending.len())
    }

    /// A node by name.
    pub fn node(&mut self, name: &str) -> Result<&mut Node, Error> {
        self.nodes.get_mut(name).ok_or_else(|| Error::Setup(format!("no node {name}")))
    }

    fn indices(&self, names: &[String]) -> Result<Vec<usize>, Error> {
        names
            .iter()
            .map(|n| self.index.get(n).copied().ok_or_else(|| Error::Setup(format!("no node {n}"))))
            .collect()
    }

    /// Cuts (or, with `heal`, restores) every link between two groups of nodes.
    pub fn cut(&mut self, a: &[String], b: &[String], heal: bool) -> Result<(), Error> {
        let (a, b) = (self.indices(a)?, self.indices(b)?);
        let n = self
            .netns
            .as_mut()
            .ok_or_else(|| Error::Setup("cutting links needs network = \"netns\"".into()))?;
        if heal {
            n.heal(&a, &b)
        } else {
            n.partition(&a, &b)
        }
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

    /// The HTTP nodes whose process runs now.
    pub fn live_http(&self) -> Vec<&str> {
        self.live_http_nodes().map(|n| n.name.as_str()).collect()
    }

    fn live_http_nodes(&self) -> impl Iterator<Item = &Node> {
        self.nodes.values().filter(|n| n.role.serves_http() && n.pid().is_some())
    }

    /// Every live HTTP node's digests of the namespaces `want`.
    pub fn digests(&self, want: &[String]) -> Views {
        self.live_http_nodes()
            .filter_map(|n| {
                let d = n.keyspace_digests()?;
                Some((n.name.clone(), d.into_iter().filter(|(k, _)| want.contains(k)).collect()))
            })
            .collect()
    }

    /// The model ids a gateway lists in `/v1/models`.
    pub fn model_ids(&self, node: &str) -> Option<Vec<String>> {
        let v = self.get_json(node, "/v1/models")?;
        let ids = v["data"].as_array()?.iter().filter_map(|m| m["id"].as_str());
        Some(ids.map(str::to_string).collect())
    }

    /// The GET body of `path` on an HTTP node, as JSON.
    pub fn get_json(&self, node: &str, path: &str) -> Option<serde_json::Value> {
        let n = self.nodes.get(node)?;
        let key = self.keys.get(node).cloned().unwrap_or_default();
        match request_json(n.http, "GET", path, &key, b"") {
            Ok((200, v)) => Some(v),
            _ => None,
        }
    }
}
