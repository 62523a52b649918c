//! The HTTP edge's connection limits (`gcs_gateway::serve::serve_with`):
//! slowloris connections are closed after the header timeout, a silent TLS
//! client after the handshake timeout, an idle keep-alive connection after
//! the idle limit (a request in flight is never cut), connections beyond the
//! cap are closed at accept while the earlier ones stay usable, HTTP/2
//! advertises the stream limit, and TLS offers HTTP/2 (ALPN `h2`) beside
//! HTTP/1.1. Traffic goes to 127.0.0.1 only.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::routing::get;
use axum::Router;
use gcs_gateway::metrics::CONNECTIONS;
use gcs_gateway::serve::{serve_with, EdgeLimits, TlsAcceptor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A stand-in for the gateway's router: only the edge is under test.
fn app() -> Router {
    Router::new().route("/ok", get(|| async { "ok" })).route(
        "/slow",
        get(|| async {
            tokio::time::sleep(Duration::from_millis(1200)).await;
            "slow"
        }),
    )
}

fn limits() -> EdgeLimits {
    EdgeLimits {
        header_read_timeout: Duration::from_secs(10),
        tls_handshake_timeout: Duration::from_secs(10),
        keepalive_idle: Duration::from_secs(10),
        max_connections: 1024,
        h2_max_concurrent_streams: 100,
        // Every test client is 127.0.0.1: per-address limits are tested
        // in abuse.rs.
        max_connections_per_ip: 100_000,
        ..EdgeLimits::default()
    }
}

async fn start(limits: EdgeLimits, tls: Option<TlsAcceptor>) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve_with(listener, app(), tls, limits, std::future::pending()));
    addr
}

/// Time until the server closes `s` (EOF or reset), reading and discarding
/// whatever it sends; `None` if it is still open after `bound`.
async fn closed_within(s: &mut TcpStream, bound: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(bound, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return t0.elapsed(),
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()
}

/// One keep-alive request on `s`; the body.
async fn get_on(s: &mut TcpStream, path: &str) -> String {
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let body = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before the response: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&got).to_string();
            if let Some(i) = text.find("\r\n\r\n") {
                let len: usize = text[..i]
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse().unwrap())
                    })
                    .unwrap();
                if text.len() >= i + 4 + len {
                    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
                    return text[i + 4..i + 4 + len].to_string();
                }
            }
        }
    })
    .await
    .expect("response within 5 s");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_connections_are_closed_after_the_header_timeout() {
    let header = Duration::from_millis(500);
    let addr = start(EdgeLimits { header_read_timeout: header, ..limits() }, None).await;
    let timed_out = CONNECTIONS.timed_out.load(Ordering::Relaxed);
    const N: usize = 20;
    let started = Instant::now();
    let mut conns = Vec::new();
    for i in 0..N {
        let mut s = TcpStream::connect(addr).await.unwrap();
        // Half send a request line and one header line, then nothing; the
        // other half send nothing at all.
        if i % 2 == 0 {
            s.write_all(b"GET /ok HTTP/1.1\r\nHost: 127.0.0.1\r\n").await.unwrap();
        }
        conns.push(s);
    }
    let mut waits = Vec::new();
    for (i, s) in conns.iter_mut().enumerate() {
        let t = closed_within(s, Duration::from_secs(3)).await;
        assert!(t.is_some(), "connection {i} still open 3 s after its last byte");
        waits.push(started.elapsed());
    }
    let latest = waits.iter().max().copied().unwrap();
    let earliest = waits.iter().min().copied().unwrap();
    eprintln!("{N} slowloris connections closed after {earliest:?}..{latest:?} (header timeout {header:?})");
    assert!(
        earliest >= header - Duration::from_millis(50),
        "closed before the timeout: {earliest:?}"
    );
    assert!(latest <= header + Duration::from_millis(1500), "closed too late: {latest:?}");
    assert!(CONNECTIONS.timed_out.load(Ordering::Relaxed) >= timed_out + N as u64);
    // The server still serves.
    let mut s = TcpStream::connect(addr).await.unwrap();
    assert_eq!(get_on(&mut s, "/ok").await, "ok");
    let text = gcs_gateway::metrics::Metrics::default().render();
    assert!(text.contains("gcs_http_connections_timed_out_total "), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keepalive_is_closed_but_a_request_in_flight_is_not() {
    let idle = Duration::from_millis(300);
    let addr = start(
        EdgeLimits {
            header_read_timeout: Duration::from_millis(500),
            keepalive_idle: idle,
            ..limits()
        },
        None,
    )
    .await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    // 1.2 s in the handler: longer than both limits, not cut.
    assert_eq!(get_on(&mut s, "/slow").await, "slow");
    let t = closed_within(&mut s, Duration::from_secs(3)).await.expect("idle connection closed");
    eprintln!("idle keep-alive connection closed {t:?} after its response (idle limit {idle:?})");
    // Measured by the client, whose clock starts after the server's.
    assert!(t >= idle / 2 && t <= idle + Duration::from_millis(1000), "{t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_closed_at_accept() {
    const CAP: usize = 4;
    let addr = start(EdgeLimits { max_connections: CAP, ..limits() }, None).await;
    let refused = CONNECTIONS.refused.load(Ordering::Relaxed);
    let mut held = Vec::new();
    for _ in 0..CAP {
        let mut s = TcpStream::connect(addr).await.unwrap();
        assert_eq!(get_on(&mut s, "/ok").await, "ok");
        held.push(s);
    }
    for i in 0..3 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let t = closed_within(&mut s, Duration::from_secs(1)).await;
        let t =
            t.unwrap_or_else(|| panic!("connection {} over the cap still open after 1 s", CAP + i));
        eprintln!("connection over the cap closed after {t:?}");
    }
    assert!(CONNECTIONS.refused.load(Ordering::Relaxed) >= refused + 3);
    for s in &mut held {
        assert_eq!(get_on(s, "/ok").await, "ok");
    }
    // A closed connection gives its place back.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /ok HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 256];
        match tokio::time::timeout(Duration::from_secs(1), s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => {
                assert!(buf.starts_with(b"HTTP/1.1 200"));
                break;
            }
            _ => assert!(Instant::now() < deadline, "no place after a connection closed"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let text = gcs_gateway::metrics::Metrics::default().render();
    assert!(text.contains("gcs_http_connections_refused_total "), "{text}");
    assert!(text.contains("gcs_http_connections_open "), "{text}");
}

/// A self-signed certificate for `localhost`, and the gateway's acceptor
/// for it (its files live in the returned directory).
fn self_signed() -> (rcgen::CertifiedKey, TlsAcceptor, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let files = gcs_gateway::TlsFiles {
        cert: dir.path().join("cert.pem"),
        key: dir.path().join("key.pem"),
    };
    std::fs::write(&files.cert, ck.cert.pem()).unwrap();
    std::fs::write(&files.key, ck.key_pair.serialize_pem()).unwrap();
    let tls = gcs_gateway::serve::acceptor(&files).unwrap();
    (ck, tls, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_tls_client_is_closed_after_the_handshake_timeout() {
    let (_ck, tls, _dir) = self_signed();
    let handshake = Duration::from_millis(500);
    let addr = start(EdgeLimits { tls_handshake_timeout: handshake, ..limits() }, Some(tls)).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let t = closed_within(&mut s, Duration::from_secs(3)).await.expect("silent TLS client closed");
    eprintln!("silent TLS client closed after {t:?} (handshake timeout {handshake:?})");
    assert!(
        t >= handshake - Duration::from_millis(50) && t <= handshake + Duration::from_millis(1500)
    );
}

/// One HTTP/2 frame: (type, flags, stream, payload).
async fn read_frame<S: AsyncReadExt + Unpin>(s: &mut S) -> (u8, u8, u32, Vec<u8>) {
    let mut head = [0u8; 9];
    tokio::time::timeout(Duration::from_secs(3), s.read_exact(&mut head)).await.unwrap().unwrap();
    let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).await.unwrap();
    (head[3], head[4], stream, payload)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_offers_http2_and_serves_a_request_over_it() {
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};
    let (ck, tls, _dir) = self_signed();
    let addr = start(limits(), Some(tls)).await;
    let mut roots = RootCertStore::empty();
    roots.add(ck.cert.der().clone()).unwrap();
    let provider = std::sync::Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let connect = |alpn: Vec<Vec<u8>>| {
        let mut cfg = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots.clone())
            .with_no_client_auth();
        cfg.alpn_protocols = alpn;
        let c = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg));
        async move {
            let tcp = TcpStream::connect(addr).await.unwrap();
            c.connect("localhost".try_into().unwrap(), tcp).await.unwrap()
        }
    };
    // A client offering both is given HTTP/2, and served over it.
    let mut s = connect(vec![b"h2".to_vec(), b"http/1.1".to_vec()]).await;
    assert_eq!(s.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
    s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap();
    // GET /ok (HPACK: :method GET, :scheme https, :path and :authority
    // as literals with indexed names), END_STREAM | END_HEADERS.
    let mut block = vec![0x82, 0x87, 0x44, 3];
    block.extend_from_slice(b"/ok");
    block.extend_from_slice(&[0x41, 9]);
    block.extend_from_slice(b"localhost");
    let mut frame = vec![0, 0, block.len() as u8, 1, 0x5, 0, 0, 0, 1];
    frame.extend_from_slice(&block);
    s.write_all(&frame).await.unwrap();
    let (mut status, mut body) = (None, Vec::new());
    while status.is_none() || body.is_empty() {
        match read_frame(&mut s).await {
            // SETTINGS from the server: acknowledged.
            (4, 0, 0, _) => s.write_all(&[0, 0, 0, 4, 1, 0, 0, 0, 0]).await.unwrap(),
            (1, _, 1, block) => status = block.first().copied(),
            (0, _, 1, data) => body.extend_from_slice(&data),
            _ => {}
        }
    }
    // 0x88 is HPACK's static entry `:status 200`.
    assert_eq!((status, body.as_slice()), (Some(0x88), &b"ok"[..]));
    // A client offering only HTTP/1.1 keeps it.
    let mut s = connect(vec![b"http/1.1".to_vec()]).await;
    assert_eq!(s.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    s.write_all(b"GET /ok HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n").await.unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("ok"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_advertises_the_stream_limit_and_an_idle_h2_connection_is_closed() {
    let header = Duration::from_millis(500);
    let addr = start(
        EdgeLimits { header_read_timeout: header, h2_max_concurrent_streams: 7, ..limits() },
        None,
    )
    .await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    // Prior-knowledge preface and an empty SETTINGS frame.
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
    s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap();
    let mut head = [0u8; 9];
    tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut head)).await.unwrap().unwrap();
    assert_eq!(head[3], 4, "first server frame is SETTINGS");
    let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).await.unwrap();
    let max_streams = payload.chunks(6).find_map(|e| {
        (u16::from_be_bytes([e[0], e[1]]) == 3)
            .then(|| u32::from_be_bytes([e[2], e[3], e[4], e[5]]))
    });
    assert_eq!(max_streams, Some(7));
    // No request follows: closed after the header timeout.
    let t = closed_within(&mut s, Duration::from_secs(3)).await.expect("idle h2 connection closed");
    eprintln!("h2c connection with no request closed {t:?} after its SETTINGS");
    // The header timeout, then at most the close grace (1 s: the GOAWAY's
    // PING is not answered by this client).
    assert!(t >= header - Duration::from_millis(50), "{t:?}");
}
