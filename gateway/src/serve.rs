//! Serving the app over plain HTTP, or HTTPS with rustls when a certificate
//! and key are given (so `--http 0.0.0.0:443` works without an edge proxy).

use std::convert::Infallible;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_rustls::rustls::ServerConfig;
pub use tokio_rustls::TlsAcceptor;

/// PEM certificate chain and private key.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// Certificate chain (PEM).
    pub cert: PathBuf,
    /// Private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// A TLS setup problem.
#[derive(Debug, thiserror::Error)]
#[error("TLS: {0}")]
pub struct TlsError(String);

/// Loads the certificate and key into a rustls acceptor (ALPN: `h2`, then
/// `http/1.1`).
pub fn acceptor(files: &TlsFiles) -> Result<TlsAcceptor, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| TlsError(format!("{}: {e}", files.cert.display())))?
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError(format!("{}: {e}", files.cert.display())))?;
    if certs.is_empty() {
        return Err(TlsError(format!("{}: no certificate", files.cert.display())));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| TlsError(format!("{}: {e}", files.key.display())))?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsError(e.to_string()))?;
    // HTTP/2 first: a client offering both gets it (the connection builder
    // serves either, with the same limits as h2c).
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(cfg)))
}

/// Connection limits of the HTTP edge (specs/gateway.md, "Connection limits").
#[derive(Clone, Debug)]
pub struct EdgeLimits {
    /// Time a connection has to deliver a complete request head: from the
    /// start of the connection (after TLS) and, for HTTP/1, again from the
    /// end of each response (hyper restarts its header timer when a
    /// keep-alive connection goes idle). A connection that has not started
    /// its first request within this time (HTTP/2 included) is closed.
    pub header_read_timeout: Duration,
    /// Time a TLS handshake may take.
    pub tls_handshake_timeout: Duration,
    /// Time a connection may stay open with no request in flight, after
    /// its first request (for HTTP/1 the header timeout above is the
    /// tighter bound when it is shorter).
    pub keepalive_idle: Duration,
    /// Connections open at once; one more is closed at accept and counted
    /// in `gcs_http_connections_refused_total`.
    pub max_connections: usize,
    /// Concurrent streams per HTTP/2 connection.
    pub h2_max_concurrent_streams: u32,
    /// Connections open at once from one client address (an IPv6 client is
    /// its /64); one more is closed at accept and counted in
    /// `gcs_http_connections_refused_per_ip_total`.
    pub max_connections_per_ip: usize,
    /// Time a request body may take to arrive in full once its head is in;
    /// a slower one is answered 408 and its in-flight slot freed.
    pub body_read_timeout: Duration,
    /// Requests from one client address answered 401 per minute; beyond
    /// it, requests under `/v1/` from that address without a valid key are
    /// answered 429 (a valid key still passes: neighbours behind one NAT
    /// keep working, and telling them apart costs one hash).
    pub unauthenticated_per_ip_per_minute: u32,
}

impl Default for EdgeLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            tls_handshake_timeout: Duration::from_secs(10),
            keepalive_idle: Duration::from_secs(60),
            max_connections: 4096,
            h2_max_concurrent_streams: 100,
            max_connections_per_ip: 256,
            body_read_timeout: Duration::from_secs(30),
            unauthenticated_per_ip_per_minute: 60,
        }
    }
}

/// hyper's own per-connection write buffer: small, so that the bytes a slow
/// client has not taken stay in the stream's bounded queue, where they are
/// counted (hyper's default would hold ~400 KiB more per connection).
const HYPER_BUF: usize = 64 * 1024;

/// Kernel send buffer per connection (Linux doubles the value it is given).
const SEND_BUF: usize = 128 * 1024;

/// How long a connection closed for idleness may take to finish (an HTTP/2
/// GOAWAY, a flush) before it is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Serves `app` on `listener` (over TLS when `tls` is set) with the default
/// [`EdgeLimits`] until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<TlsAcceptor>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, app, tls, EdgeLimits::default(), shutdown).await
}

/// Serves `app` on `listener` (over TLS when `tls` is set) under `limits`
/// until `shutdown` resolves; connections in progress finish on their own.
pub async fn serve_with(
    listener: TcpListener,
    app: Router,
    tls: Option<TlsAcceptor>,
    limits: EdgeLimits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    tokio::pin!(shutdown);
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let per_ip = Arc::new(crate::guard::PerIpConnections::new(limits.max_connections_per_ip));
    let limits = Arc::new(limits);
    let stats = &crate::metrics::CONNECTIONS;
    loop {
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => return Ok(()),
        };
        // At the cap: closed at once (dropping the socket), before any byte
        // is read or any task is spawned for it.
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%peer, "connection refused: at the connection cap");
            drop(tcp);
            continue;
        };
        let Some(ip_slot) = per_ip.acquire(peer.ip()) else {
            stats.refused_per_ip.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%peer, "connection refused: at the per-address cap");
            drop(tcp);
            continue;
        };
        let _ = tcp.set_nodelay(true);
        // A fixed send buffer (no kernel autotuning up to 4 MiB): what a
        // client does not read backs up into the stream's counted queue
        // within ~SEND_BUF, so a stalled client is noticed and its job
        // cancelled, instead of the kernel quietly absorbing megabytes.
        let _ = socket2::SockRef::from(&tcp).set_send_buffer_size(SEND_BUF);
        let (tls, app, limits) = (tls.clone(), app.clone(), limits.clone());
        let open = Open::new(permit);
        tokio::spawn(async move {
            let _open = (open, ip_slot);
            match tls {
                None => connection(TokioIo::new(tcp), app, peer, &limits).await,
                Some(tls) => {
                    match tokio::time::timeout(limits.tls_handshake_timeout, tls.accept(tcp)).await
                    {
                        Ok(Ok(s)) => connection(TokioIo::new(s), app, peer, &limits).await,
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => {
                            stats.timed_out.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(%peer, "TLS handshake timed out");
                        }
                    }
                }
            }
        });
    }
}

pub use crate::guard::ClientAddr;

/// One open connection: its permit and its place in the gauge.
struct Open {
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Open {
    fn new(permit: tokio::sync::OwnedSemaphorePermit) -> Self {
        crate::metrics::CONNECTIONS.open.fetch_add(1, Ordering::Relaxed);
        Self { _permit: permit }
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        crate::metrics::CONNECTIONS.open.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn connection<I>(io: I, app: Router, peer: std::net::SocketAddr, limits: &EdgeLimits)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    b.http1()
        .max_buf_size(HYPER_BUF)
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    b.http2().timer(TokioTimer::new()).max_concurrent_streams(limits.h2_max_concurrent_streams);
    let track = Arc::new(Track::new());
    let svc = TowerToHyperService::new(app);
    let t = track.clone();
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        let busy = Busy::begin(&t);
        req.extensions_mut().insert(ClientAddr(peer));
        let fut = hyper::service::Service::call(&svc, req);
        async move {
            let resp = fut.await?;
            Ok::<_, Infallible>(resp.map(|inner| Tracked { inner, _busy: busy }))
        }
    });
    let conn = b.serve_connection(io, service);
    tokio::pin!(conn);
    let r = tokio::select! {
        r = conn.as_mut() => r,
        () = idle(&track, limits) => {
            crate::metrics::CONNECTIONS.timed_out.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%peer, "connection closed: idle");
            conn.as_mut().graceful_shutdown();
            match tokio::time::timeout(CLOSE_GRACE, conn.as_mut()).await {
                Ok(r) => r,
                Err(_) => Ok(()),
            }
        }
    };
    if let Err(e) = r {
        let timeout = e.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_timeout);
        if timeout {
            crate::metrics::CONNECTIONS.timed_out.fetch_add(1, Ordering::Relaxed);
        }
        tracing::debug!(%peer, error = %e, timeout, "connection ended with an error");
    }
}

/// Requests in flight on one connection, and since when it has had none.
#[derive(Debug)]
struct Track(Mutex<TrackState>);

#[derive(Debug)]
struct TrackState {
    in_flight: usize,
    /// Any request seen on this connection.
    seen: bool,
    /// Connection start, or the end of its last request.
    since: Instant,
}

impl Track {
    fn new() -> Self {
        Self(Mutex::new(TrackState { in_flight: 0, seen: false, since: Instant::now() }))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, TrackState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Resolves when the connection has had no request in flight for its limit:
/// `header_read_timeout` before its first request, `keepalive_idle` after.
async fn idle(track: &Track, limits: &EdgeLimits) {
    loop {
        let (busy, deadline) = {
            let s = track.state();
            let limit = if s.seen { limits.keepalive_idle } else { limits.header_read_timeout };
            (s.in_flight > 0, s.since + limit)
        };
        if busy {
            // Re-checked after one period: a request that ends meanwhile
            // moves `since`, and the next round sleeps until its deadline.
            let limit = limits.keepalive_idle.min(limits.header_read_timeout);
            tokio::time::sleep(limit).await;
        } else if Instant::now() >= deadline {
            return;
        } else {
            tokio::time::sleep_until(deadline).await;
        }
    }
}

/// One request in flight, from its head until its response body is done.
#[derive(Debug)]
struct Busy(Arc<Track>);

impl Busy {
    fn begin(track: &Arc<Track>) -> Self {
        let mut s = track.state();
        s.in_flight += 1;
        s.seen = true;
        drop(s);
        Self(track.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut s = self.0.state();
        s.in_flight = s.in_flight.saturating_sub(1);
        s.since = Instant::now();
    }
}

/// A response body that holds its request's [`Busy`] until hyper drops it.
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
