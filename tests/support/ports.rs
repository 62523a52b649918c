//! Ports for child processes to listen on (`#[path]`-included by the node
//! tests and by netsim).
//!
//! Binding port 0 and handing the number to a child races with every
//! outgoing connection on the machine: connects draw their local port from
//! the same ephemeral range, and in CI one took a port netsim had picked
//! before the node bound it ("Address already in use"). These ports come
//! from below the ephemeral range, each handed out once per process
//! (walking from an offset of the process id, so concurrent test processes
//! start far apart), and are checked bindable when handed out.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

static HANDED_OUT: AtomicU32 = AtomicU32::new(0);

/// Lowest port handed out.
const LOW: u32 = 10_000;

/// First port of the kernel's ephemeral range (Linux; 32768 elsewhere).
fn ephemeral_start() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A free local port no connect will take, for a child to listen on.
pub fn spare_port() -> u16 {
    let high = ephemeral_start().min(u32::from(u16::MAX) + 1);
    if high > LOW + 1_000 {
        let span = high - LOW;
        let start = std::process::id().wrapping_mul(7_919) % span;
        for _ in 0..span {
            let i = HANDED_OUT.fetch_add(1, Ordering::Relaxed);
            let port = (LOW + (start + i) % span) as u16;
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    // An ephemeral range reaching down to LOW: the kernel's pick.
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(0)
}
