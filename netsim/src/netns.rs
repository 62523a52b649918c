//! Network namespaces for partition scenarios: every node gets its own
//! namespace (`gcsns-<pid>-<run>-<i>`, one `eth0` with `10.77.<s>.<i+1>/24`),
//! joined by a bridge in a hub namespace (`gcsns-<pid>-<run>-hub`); netsim itself
//! reaches the nodes' HTTP ports over one veth in its own namespace
//! (`gns<pid>r<run>`, `10.77.<s>.254`). A partition between two nodes is a pair of
//! blackhole routes (each node silently drops what it sends to the other,
//! so established TCP connections stall exactly as on a cut link); healing
//! deletes the routes. netsim's own link stays up, so it can still read
//! every node's metrics during a partition.
//!
//! Everything is created with `ip` (iproute2) and removed on drop (also on
//! a panic); namespaces left by a netsim that was killed are removed on the
//! next start (their pid no longer runs). Requires root; without it
//! [`Netns::probe`] says why and the scenario is reported as skipped.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::process::Command;

use crate::Error;

/// Prefix of every namespace netsim creates.
pub const PREFIX: &str = "gcsns-";

fn ip(args: &[&str]) -> Result<String, String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// The namespaces of one scenario run.
#[derive(Debug)]
pub struct Netns {
    pid: u32,
    /// Runs of this process so far (scenarios may run in parallel threads).
    run: u32,
    subnet: u8,
    nodes: usize,
    host_if: String,
    /// Blocked (from, to) node index pairs.
    blocked: BTreeSet<(usize, usize)>,
}

impl Netns {
    /// Whether namespaces can be created here; `Err` says why not.
    pub fn probe() -> Result<(), String> {
        let name = format!("{PREFIX}{}-probe", std::process::id());
        ip(&["netns", "add", &name])
            .map_err(|e| format!("cannot create a network namespace ({e})"))?;
        let r = ip(&["-n", &name, "link", "set", "lo", "up"]);
        let _ = ip(&["netns", "del", &name]);
        r.map(drop).map_err(|e| format!("cannot configure a network namespace ({e})"))
    }

    /// Removes namespaces (and the host-side veth) of netsim runs whose
    /// process is gone.
    pub fn remove_stale() {
        let Ok(list) = ip(&["netns", "list"]) else { return };
        for line in list.lines() {
            let name = line.split_whitespace().next().unwrap_or("");
            let Some(rest) = name.strip_prefix(PREFIX) else { continue };
            let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let _ = ip(&["netns", "del", name]);
                let run = rest.split('-').nth(1).unwrap_or("0");
                let _ = ip(&["link", "del", &format!("gns{pid}r{run}")]);
                tracing::info!(namespace = name, "removed a stale netsim namespace");
            }
        }
    }

    fn hub(&self) -> String {
        format!("{PREFIX}{}-{}-hub", self.pid, self.run)
    }

    /// The namespace of node `i`.
    pub fn ns(&self, i: usize) -> String {
        format!("{PREFIX}{}-{}-{i}", self.pid, self.run)
    }

    /// The address of node `i`.
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, self.subnet, u8::try_from(i + 1).unwrap_or(250))
    }

    /// Creates the hub, `n` node namespaces and netsim's own link.
    pub fn create(n: usize) -> Result<Netns, Error> {
        if n > 200 {
            return Err(Error::Setup("at most 200 nodes in netns mode".into()));
        }
        static RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        static CREATE: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one_at_a_time = CREATE.lock().unwrap_or_else(|p| p.into_inner());
        Self::remove_stale();
        let pid = std::process::id();
        let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // A /24 in 10.77.0.0/16 that no interface or route here uses yet.
        let used = ip(&["-4", "route", "show"]).unwrap_or_default()
            + &ip(&["-4", "addr", "show"]).unwrap_or_default();
        let subnet = (0..250u32)
            .map(|k| ((pid + k) % 250 + 1) as u8)
            .find(|s| !used.contains(&format!("10.77.{s}.")))
            .ok_or_else(|| Error::Setup("no free 10.77.x.0/24 subnet".into()))?;
        let mut me = Netns {
            pid,
            run,
            subnet,
            nodes: 0,
            host_if: format!("gns{pid}r{run}"),
            blocked: BTreeSet::new(),
        };
        let setup = |e: String| Error::Setup(format!("netns: {e}"));
        let hub = me.hub();
        ip(&["netns", "add", &hub]).map_err(setup)?;
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"]).map_err(setup)?;
        ip(&["-n", &hub, "link", "set", "br0", "up"]).map_err(setup)?;
        // netsim's own link into the hub (it runs the HTTP clients).
        ip(&["link", "add", &me.host_if, "type", "veth", "peer", "name", "h0", "netns", &hub])
            .map_err(setup)?;
        ip(&["-n", &hub, "link", "set", "h0", "master", "br0", "up"]).map_err(setup)?;
        let host_addr = format!("10.77.{subnet}.254/24");
        ip(&["addr", "add", &host_addr, "dev", &me.host_if]).map_err(setup)?;
        ip(&["link", "set", &me.host_if, "up"]).map_err(setup)?;
        for i in 0..n {
            let ns = me.ns(i);
            ip(&["netns", "add", &ns]).map_err(setup)?;
            me.nodes = i + 1;
            let port = format!("v{i}");
            ip(&[
                "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &port,
                "netns", &hub,
            ])
            .map_err(setup)?;
            ip(&["-n", &hub, "link", "set", &port, "master", "br0", "up"]).map_err(setup)?;
            let a = format!("{}/24", me.addr(i));
            ip(&["-n", &ns, "addr", "add", &a, "dev", "eth0"]).map_err(setup)?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"]).map_err(setup)?;
            ip(&["-n", &ns, "link", "set", "lo", "up"]).map_err(setup)?;
        }
        tracing::info!(subnet = %format!("10.77.{subnet}.0/24"), nodes = n, "network namespaces up");
        Ok(me)
    }

    /// Node `from` drops everything it sends to node `to`.
    fn block_one(&mut self, from: usize, to: usize) -> Result<(), Error> {
        if self.blocked.insert((from, to)) {
            let dst = format!("{}/32", self.addr(to));
            ip(&["-n", &self.ns(from), "route", "add", "blackhole", &dst])
                .map_err(|e| Error::Setup(format!("partition: {e}")))?;
        }
        Ok(())
    }

    fn unblock_one(&mut self, from: usize, to: usize) -> Result<(), Error> {
        if self.blocked.remove(&(from, to)) {
            let dst = format!("{}/32", self.addr(to));
            ip(&["-n", &self.ns(from), "route", "del", "blackhole", &dst])
                .map_err(|e| Error::Setup(format!("heal: {e}")))?;
        }
        Ok(())
    }

    /// Cuts every link between a node of `a` and a node of `b`, both ways.
    pub fn partition(&mut self, a: &[usize], b: &[usize]) -> Result<(), Error> {
        for &x in a {
            for &y in b {
                if x != y {
                    self.block_one(x, y)?;
                    self.block_one(y, x)?;
                }
            }
        }
        Ok(())
    }

    /// Restores every link cut by [`Netns::partition`] between `a` and `b`.
    pub fn heal(&mut self, a: &[usize], b: &[usize]) -> Result<(), Error> {
        for &x in a {
            for &y in b {
                self.unblock_one(x, y)?;
                self.unblock_one(y, x)?;
            }
        }
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting a namespace destroys its veth ends, and with them their
        // peers (the host-side link included).
        for i in 0..self.nodes {
            let _ = ip(&["netns", "del", &self.ns(i)]);
        }
        let _ = ip(&["netns", "del", &self.hub()]);
        let _ = ip(&["link", "del", &self.host_if]);
    }
}
