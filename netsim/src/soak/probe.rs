//! The soak's clients, written on raw sockets so that every way a stream
//! can end is seen as it is: one streamed chat read to its end, one
//! /health probe, and slowloris connections.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Keeps `n` connections open that each send one more header line every
/// `every`, never finishing the head; one the edge closes is reopened.
/// Returns how many the edge closed.
pub fn slowloris(addr: SocketAddr, n: usize, every: Duration, stop: &AtomicBool) -> u64 {
    let open = |s: &mut Option<TcpStream>| {
        *s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok().and_then(|mut t| {
            t.set_write_timeout(Some(Duration::from_millis(200))).ok()?;
            t.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n").ok()?;
            Some(t)
        });
    };
    let mut conns: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    conns.iter_mut().for_each(open);
    let mut closed = 0;
    while !stop.load(Ordering::Relaxed) {
        let round = Instant::now();
        for c in conns.iter_mut() {
            let alive = c.as_mut().is_some_and(|t| t.write_all(b"X-Slow: 1\r\n").is_ok());
            if !alive {
                closed += 1;
                open(c);
            }
        }
        while round.elapsed() < every && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    closed
}

/// How one stream ended.
#[derive(Clone, Debug, PartialEq)]
pub enum End {
    /// 200 and `data: [DONE]`.
    Complete,
    /// An HTTP error status with a JSON envelope, or an SSE error event.
    CleanError(u16),
    /// Cut, garbled or hung.
    Unclean(String),
}

impl End {
    /// The report's key for this end.
    pub fn kind(&self) -> String {
        match self {
            End::Complete => "complete".into(),
            End::CleanError(s) => format!("clean_error_{s}"),
            End::Unclean(_) => "unclean".into(),
        }
    }
}

/// One streamed chat request, read to its end: how it ended and the
/// milliseconds to its first content chunk.
pub fn stream(addr: SocketAddr, key: &str, max_tokens: u32) -> (End, Option<u64>) {
    let body = serde_json::json!({"model": "gnus-auto", "stream": true, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]})
    .to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let t0 = Instant::now();
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) else {
        return (End::Unclean("connect".into()), None);
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    if s.write_all(req.as_bytes()).is_err() {
        return (End::Unclean("send".into()), None);
    }
    let (mut got, mut buf, mut ttft) = (Vec::new(), [0u8; 8192], None);
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return (End::Unclean(format!("read: {e}")), ttft),
        }
        let text = String::from_utf8_lossy(&got);
        if ttft.is_none() && text.contains("\"content\":\"") {
            ttft = Some(t0.elapsed().as_millis() as u64);
        }
        if text.contains("data: [DONE]") {
            return (End::Complete, ttft);
        }
        if t0.elapsed() > Duration::from_secs(180) {
            return (End::Unclean("no end within 180 s".into()), ttft);
        }
    }
    let text = String::from_utf8_lossy(&got);
    let status: u16 = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    if text.contains("\"error\"") && (status >= 400 || text.contains("data: {\"error\"")) {
        return (End::CleanError(status), ttft);
    }
    (End::Unclean(format!("closed without an end (status {status})")), ttft)
}

/// One GET /health: milliseconds to the whole answer, and its status.
pub fn health(addr: SocketAddr) -> (u64, u16) {
    let t0 = Instant::now();
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return (t0.elapsed().as_millis() as u64, 0);
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (t0.elapsed().as_millis() as u64, status)
}
