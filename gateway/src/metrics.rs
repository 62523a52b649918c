//! Gateway metrics in the Prometheus text format (`GET /metrics`).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

const BUCKETS: [f64; 14] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// A latency histogram in seconds.
#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    /// Sum in microseconds.
    sum_us: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, secs: f64) {
        for (i, b) in BUCKETS.iter().enumerate() {
            if secs <= *b {
                self.counts[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add((secs * 1e6) as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        self.render_series(out, name, "");
    }

    /// One series of a histogram family, its labels (`part="claim"`, or
    /// empty) on every line; the caller writes the family's HELP and TYPE
    /// once before its series.
    pub fn render_series(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (i, b) in BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {}",
                self.counts[i].load(Ordering::Relaxed)
            );
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {n}");
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let braced = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(out, "{name}_sum{braced} {sum}\n{name}_count{braced} {n}");
    }
}

/// The HTTP edge's connections (`serve`). Process-wide: the accept loop has
/// no handle on a router's state, and a node runs one HTTP listener.
#[derive(Debug)]
pub struct Connections {
    /// Connections open now.
    pub open: AtomicI64,
    /// Connections closed at accept because the cap was reached.
    pub refused: AtomicU64,
    /// Connections closed by a header, TLS-handshake or idle timeout.
    pub timed_out: AtomicU64,
    /// Connections closed at accept because their address was at its cap.
    pub refused_per_ip: AtomicU64,
}

/// The process's HTTP connection counters.
pub static CONNECTIONS: Connections = Connections {
    open: AtomicI64::new(0),
    refused: AtomicU64::new(0),
    timed_out: AtomicU64::new(0),
    refused_per_ip: AtomicU64::new(0),
};

/// Every gateway metric.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    errors: Mutex<BTreeMap<String, u64>>,
    cancellations: Mutex<BTreeMap<String, u64>>,
    /// Client-visible time to first token.
    pub ttft: Histogram,
    /// Time between consecutive streamed chunks.
    pub inter_token: Histogram,
    /// Publish to first lease (claim latency as the gateway sees it).
    pub claim: Histogram,
    /// Requeues observed (a second or later lease for one job).
    pub requeues: AtomicU64,
    /// Streams open now.
    pub active_streams: AtomicI64,
    /// Tokens the workers generated (metered).
    pub tokens_generated: AtomicU64,
    /// Tokens delivered to clients.
    pub tokens_delivered: AtomicU64,
    /// Handler panics answered 500.
    pub panics: AtomicU64,
    /// Requests answered 429 because their address failed authentication
    /// too often.
    pub unauthenticated_limited: AtomicU64,
    /// Requests answered 408: the body did not arrive in time.
    pub body_timeouts: AtomicU64,
    /// Batch runs (a resumption counts again) on the processing queue.
    pub batch_runs_processing: AtomicU64,
    /// Batch runs through the gateway's own handlers.
    pub batch_runs_gateway: AtomicU64,
}

/// Every error code the gateway and the network's tracker answer with.
pub const ERROR_CODES: &[&str] = &[
    "gateway_overloaded",
    "gnus_cancelled",
    "gnus_engine_error",
    "gnus_gateway_restarted",
    "gnus_idle_timeout",
    "gnus_internal",
    "gnus_invalid_request",
    "gnus_no_capable_nodes",
    "gnus_requeue_exhausted",
    "gnus_storage_unavailable",
    "gnus_stream_broken",
    "gnus_wall_timeout",
    "gnus_worker_failed",
    "gnus_worker_lost",
    "idempotency_key_reused",
    "insufficient_quota",
    "internal_error",
    "invalid_api_key",
    "invalid_json",
    "invalid_value",
    "method_not_allowed",
    "missing_required_parameter",
    "model_not_found",
    "model_not_supported",
    "permission_denied",
    "rate_limit_exceeded",
    "request_timeout",
    "request_too_large",
    "service_unavailable",
    "too_many_authentication_failures",
    "unknown_url",
    "unsupported_media_type",
    "unsupported_parameter",
];

/// The label value for an error code: itself if it is one of ours.
pub fn error_label(code: &str) -> &'static str {
    ERROR_CODES.iter().copied().find(|c| *c == code).unwrap_or("other")
}

fn bump<K: Ord>(m: &Mutex<BTreeMap<K, u64>>, k: K) {
    *m.lock().unwrap_or_else(|p| p.into_inner()).entry(k).or_default() += 1;
}

impl Metrics {
    /// One finished HTTP request.
    pub fn request(&self, endpoint: &str, status: u16) {
        bump(&self.requests, (endpoint.to_string(), status));
    }

    /// One error answered, by code. Codes may come from a worker's result,
    /// so only the gateway's own codes ([`ERROR_CODES`]) become label values
    /// and anything else counts as `other`: a peer cannot grow /metrics.
    pub fn error(&self, code: &str) {
        bump(&self.errors, error_label(code).to_string());
    }

    /// One job cancelled by the gateway, by reason.
    pub fn cancellation(&self, reason: &str) {
        bump(&self.cancellations, reason.to_string());
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str("# HELP gcs_http_requests_total HTTP requests by endpoint and status.\n");
        out.push_str("# TYPE gcs_http_requests_total counter\n");
        for ((e, s), n) in self.requests.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(out, "gcs_http_requests_total{{endpoint=\"{e}\",status=\"{s}\"}} {n}");
        }
        out.push_str("# HELP gcs_http_errors_total Errors answered, by code.\n");
        out.push_str("# TYPE gcs_http_errors_total counter\n");
        for (c, n) in self.errors.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(out, "gcs_http_errors_total{{code=\"{c}\"}} {n}");
        }
        out.push_str("# HELP gcs_cancellations_total Jobs cancelled by the gateway, by reason.\n");
        out.push_str("# TYPE gcs_cancellations_total counter\n");
        for (c, n) in self.cancellations.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(out, "gcs_cancellations_total{{reason=\"{c}\"}} {n}");
        }
        self.ttft.render(&mut out, "gcs_ttft_seconds", "Client-visible time to first token.");
        self.inter_token.render(
            &mut out,
            "gcs_inter_token_seconds",
            "Time between streamed chunks to the client.",
        );
        self.claim.render(&mut out, "gcs_claim_seconds", "Job publication to first lease.");
        let g = |out: &mut String, name: &str, kind: &str, help: &str, v: i64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed) as i64;
        out.push_str(
            "# HELP gcs_batch_runs_total Batch runs (a resumption counts again), by the path their requests took.\n\
             # TYPE gcs_batch_runs_total counter\n",
        );
        for (path, n) in
            [("processing", &self.batch_runs_processing), ("gateway", &self.batch_runs_gateway)]
        {
            let _ = writeln!(out, "gcs_batch_runs_total{{path=\"{path}\"}} {}", ld(n));
        }
        let c = &CONNECTIONS;
        for (name, kind, help, v) in [
            ("gcs_requeues_total", "counter", "Jobs moved to another worker.", ld(&self.requeues)),
            (
                "gcs_active_streams",
                "gauge",
                "SSE streams open now.",
                self.active_streams.load(Ordering::Relaxed),
            ),
            (
                "gcs_tokens_generated_total",
                "counter",
                "Tokens the workers generated.",
                ld(&self.tokens_generated),
            ),
            (
                "gcs_tokens_delivered_total",
                "counter",
                "Tokens delivered to clients.",
                ld(&self.tokens_delivered),
            ),
            (
                "gcs_http_connections_open",
                "gauge",
                "HTTP connections open now.",
                c.open.load(Ordering::Relaxed),
            ),
            (
                "gcs_http_connections_refused_total",
                "counter",
                "HTTP connections closed at accept: connection cap reached.",
                ld(&c.refused),
            ),
            (
                "gcs_http_connections_timed_out_total",
                "counter",
                "HTTP connections closed by a header, TLS-handshake or idle timeout.",
                ld(&c.timed_out),
            ),
            (
                "gcs_http_connections_refused_per_ip_total",
                "counter",
                "HTTP connections closed at accept: the client address was at its cap.",
                ld(&c.refused_per_ip),
            ),
            ("gcs_http_panics_total", "counter", "Handler panics answered 500.", ld(&self.panics)),
            (
                "gcs_http_unauthenticated_limited_total",
                "counter",
                "Requests answered 429: their address failed authentication too often.",
                ld(&self.unauthenticated_limited),
            ),
            (
                "gcs_http_body_timeouts_total",
                "counter",
                "Requests answered 408: the body did not arrive within the body-read timeout.",
                ld(&self.body_timeouts),
            ),
        ] {
            g(&mut out, name, kind, help, v);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_labels_come_from_a_fixed_set() {
        let m = Metrics::default();
        m.error("gnus_worker_lost");
        for i in 0..100 {
            m.error(&format!("worker_chosen_{i}"));
        }
        let text = m.render();
        assert!(text.contains("gcs_http_errors_total{code=\"gnus_worker_lost\"} 1"), "{text}");
        assert!(text.contains("gcs_http_errors_total{code=\"other\"} 100"), "{text}");
        assert!(!text.contains("worker_chosen"), "a peer's code became a label");
        let mut sorted = ERROR_CODES.to_vec();
        sorted.sort();
        assert_eq!(sorted, ERROR_CODES, "keep ERROR_CODES sorted");
    }
}
