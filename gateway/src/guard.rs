//! Per-client-address limits and the panic guard of the HTTP edge
//! (specs/gateway.md, "Connection limits"): a cap on connections per
//! address (taken in the accept loop, [`crate::serve`]), a per-address rate
//! of failed authentications beyond which unauthenticated requests are
//! answered 429 at once, and a layer that turns a handler's panic into a 500
//! envelope counted in `/metrics`.
//!
//! An address is an IPv4 address or an IPv6 /64 (one subscriber usually has a
//! whole /64, so a finer key would let one client rotate through 2^64 keys).

use std::collections::HashMap;
use std::net::IpAddr;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::FutureExt;

use crate::error::ApiError;
use crate::{now_ms, AppState};

/// The client's address, in every request's extensions (`serve` puts it
/// there; the per-address limits here read it; a router served some other
/// way has none, and those limits then do not apply).
#[derive(Clone, Copy, Debug)]
pub struct ClientAddr(pub std::net::SocketAddr);

/// A client address as the limits count it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum IpKey {
    /// An IPv4 address (IPv4-mapped IPv6 included).
    V4(u32),
    /// The /64 of an IPv6 address.
    V6(u64),
    /// Every address not tracked because the table is full: they share one
    /// budget, so a flood of fresh addresses cannot grow the table.
    Overflow,
}

impl IpKey {
    pub(crate) fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(a) => IpKey::V4(u32::from(a)),
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(v4) => IpKey::V4(u32::from(v4)),
                None => IpKey::V6((u128::from(a) >> 64) as u64),
            },
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Connections open per address. The table holds only addresses with an
/// open connection, so it is bounded by the global connection cap.
#[derive(Debug)]
pub(crate) struct PerIpConnections {
    max: usize,
    open: Arc<Mutex<HashMap<IpKey, usize>>>,
}

/// One connection's place in its address's count.
#[derive(Debug)]
pub(crate) struct IpSlot {
    key: IpKey,
    open: Arc<Mutex<HashMap<IpKey, usize>>>,
}

impl PerIpConnections {
    pub(crate) fn new(max: usize) -> Self {
        Self { max: max.max(1), open: Arc::default() }
    }

    /// A place for one more connection from `ip`, or `None` at its cap.
    pub(crate) fn acquire(&self, ip: IpAddr) -> Option<IpSlot> {
        let key = IpKey::of(ip);
        let mut open = lock(&self.open);
        let n = open.entry(key).or_default();
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(IpSlot { key, open: self.open.clone() })
    }
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut open = lock(&self.open);
        if let Some(n) = open.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.key);
            }
        }
    }
}

const WINDOW_MS: u64 = 60_000;

/// Addresses whose failed authentications are remembered; beyond it new
/// addresses share [`IpKey::Overflow`].
const MAX_TRACKED: usize = 65_536;

/// Failed authentications per address in fixed one-minute windows.
#[derive(Debug)]
pub(crate) struct AuthFailures {
    per_minute: u32,
    table: Mutex<HashMap<IpKey, (u64, u32)>>,
}

impl AuthFailures {
    pub(crate) fn new(per_minute: u32) -> Self {
        Self { per_minute: per_minute.max(1), table: Mutex::default() }
    }

    /// Seconds until `ip` may fail again, when it is at its limit now.
    pub(crate) fn over(&self, ip: IpKey, now: u64) -> Option<u64> {
        let t = lock(&self.table);
        let key = if t.contains_key(&ip) || t.len() < MAX_TRACKED { ip } else { IpKey::Overflow };
        let &(start, n) = t.get(&key)?;
        let end = start + WINDOW_MS;
        (now < end && n >= self.per_minute).then(|| (end - now).div_ceil(1000))
    }

    /// One more failed authentication from `ip` at `now`.
    pub(crate) fn record(&self, ip: IpKey, now: u64) {
        let mut t = lock(&self.table);
        let mut key = ip;
        if !t.contains_key(&ip) && t.len() >= MAX_TRACKED {
            t.retain(|_, (start, _)| now < *start + WINDOW_MS);
            if t.len() >= MAX_TRACKED {
                key = IpKey::Overflow;
            }
        }
        let e = t.entry(key).or_insert((now, 0));
        if now >= e.0 + WINDOW_MS {
            *e = (now, 0);
        }
        e.1 = e.1.saturating_add(1);
    }
}

/// The edge's guard around every route: an address at its failed-
/// authentication limit gets 429 for `/v1/` requests without a valid key
/// (one hash, no body read, no key-store write); a handler that panics gets
/// a 500 envelope (and the panic is logged and counted); every 401 counts
/// against its address.
pub(crate) async fn guard(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let ip = req.extensions().get::<ClientAddr>().map(|c| IpKey::of(c.0.ip()));
    let now = now_ms();
    if let Some(ip) = ip.filter(|_| req.uri().path().starts_with("/v1/")) {
        if let Some(retry) = state.auth_failures.over(ip, now) {
            if crate::handlers::authenticate(&state, req.headers()).is_err() {
                state.metrics.unauthenticated_limited.fetch_add(1, Ordering::Relaxed);
                let limit = state.config.edge.unauthenticated_per_ip_per_minute;
                let e = ApiError::rate_limited(
                    "too_many_authentication_failures",
                    format!(
                        "More than {limit} requests from this address failed authentication in \
                         the last minute."
                    ),
                    retry,
                );
                return e.into_response();
            }
        }
    }
    let r = match AssertUnwindSafe(next.run(req)).catch_unwind().await {
        Ok(r) => r,
        Err(panic) => {
            state.metrics.panics.fetch_add(1, Ordering::Relaxed);
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(panic = %what, "a request handler panicked");
            ApiError::internal("internal error; the gateway's log has the details").into_response()
        }
    };
    if r.status() == axum::http::StatusCode::UNAUTHORIZED {
        if let Some(ip) = ip {
            state.auth_failures.record(ip, now);
        }
    }
    r
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A network with nothing in it: the panic route never reaches it.
    #[derive(Debug)]
    struct Empty;

    impl crate::Backend for Empty {
        fn submit(
            &self,
            _: crate::JobSpec,
        ) -> crate::BoxFuture<
            '_,
            Result<(String, tokio::sync::mpsc::Receiver<crate::JobEvent>), crate::BackendError>,
        > {
            Box::pin(async { Err(crate::BackendError::Stopping) })
        }
        fn cancel(
            &self,
            _: String,
            _: gcs_protocol::CancellationReason,
        ) -> crate::BoxFuture<'_, ()> {
            Box::pin(async {})
        }
        fn registrations(&self) -> Vec<gcs_protocol::NodeRegistration> {
            vec![]
        }
        fn record_parent(
            &self,
            _: crate::ParentUsage,
        ) -> crate::BoxFuture<'_, Result<(), crate::BackendError>> {
            Box::pin(async { Ok(()) })
        }
        fn usage(
            &self,
            _: &str,
            _: u64,
            _: u64,
        ) -> Result<Vec<gcs_protocol::UsageRecord>, crate::BackendError> {
            Ok(vec![])
        }
    }

    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_handler_is_a_500_envelope_counted_in_metrics() {
        let dir = tempfile::tempdir().unwrap();
        let keys = Arc::new(crate::KeyStore::new(dir.path()));
        let app = crate::router(Arc::new(Empty), keys, crate::GatewayConfig::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(crate::serve(listener, app, None, std::future::pending()));
        for _ in 0..2 {
            let r = get(addr, "/v1/__panic").await;
            assert!(r.starts_with("HTTP/1.1 500"), "{r}");
            let body = r.split("\r\n\r\n").nth(1).unwrap();
            let v: serde_json::Value = serde_json::from_str(body).unwrap();
            assert_eq!(v["error"]["code"], "internal_error");
            assert!(!body.contains("a test panic"), "the panic text stays in the log");
        }
        // The server is still up, and counted both.
        let m = get(addr, "/metrics").await;
        assert!(m.contains("gcs_http_panics_total 2"), "{m}");
    }

    #[test]
    fn an_ipv6_client_is_its_64_and_a_mapped_ipv4_is_the_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(IpKey::of(a), IpKey::of(b));
        assert_ne!(IpKey::of(a), IpKey::of(c));
        let m: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(IpKey::of(m), IpKey::of("10.0.0.1".parse().unwrap()));
    }

    #[test]
    fn connections_per_address_are_capped_and_released() {
        let p = PerIpConnections::new(2);
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let (a, b) = (p.acquire(ip).unwrap(), p.acquire(ip).unwrap());
        assert!(p.acquire(ip).is_none());
        assert!(p.acquire("10.0.0.2".parse().unwrap()).is_some(), "another address is not held");
        drop(a);
        let _c = p.acquire(ip).unwrap();
        drop(b);
        drop(_c);
        assert!(lock(&p.open).is_empty(), "an address with no connection is forgotten");
    }

    #[test]
    fn failures_beyond_the_limit_are_refused_until_the_window_ends() {
        let f = AuthFailures::new(3);
        let ip = IpKey::V4(1);
        for t in 0..3 {
            assert_eq!(f.over(ip, t), None);
            f.record(ip, t);
        }
        assert_eq!(f.over(ip, 10_000), Some(50));
        assert_eq!(f.over(IpKey::V4(2), 10_000), None, "other addresses are not limited");
        assert_eq!(f.over(ip, 60_000), None, "a new window");
        f.record(ip, 60_000);
        assert_eq!(f.over(ip, 60_001), None);
    }

    #[test]
    fn a_full_table_puts_new_addresses_in_one_shared_budget() {
        let f = AuthFailures::new(2);
        for i in 0..MAX_TRACKED as u32 {
            f.record(IpKey::V4(i), 0);
        }
        let fresh = IpKey::V4(u32::MAX);
        f.record(fresh, 1);
        f.record(IpKey::V4(u32::MAX - 1), 1);
        assert_eq!(lock(&f.table).len(), MAX_TRACKED + 1, "the overflow key, no more");
        assert!(f.over(fresh, 2).is_some(), "two fresh addresses used the shared budget");
        // Once the old entries expire, a fresh address gets its own entry.
        f.record(fresh, WINDOW_MS + 5);
        assert_eq!(f.over(fresh, WINDOW_MS + 6), None);
        assert!(lock(&f.table).len() <= 2);
    }
}
