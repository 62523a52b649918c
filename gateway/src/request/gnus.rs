//! The `gnus` extension object (26.15.4): routing, privacy, per-request
//! timeouts, exact continuation.

use gcs_protocol::{PrivacyLevel, RoutingMode};
use serde_json::{Map, Value};

use super::{present, uint, TimeoutOverrides};
use crate::error::ApiError;

fn parse_enum<T: Copy + std::fmt::Display>(all: &[T], s: &str) -> Option<T> {
    all.iter().copied().find(|v| v.to_string() == s)
}

/// `gnus.continuation`: whether a stream whose worker is lost after the
/// first token may continue, token for token, on another worker of the
/// same engine build and model file (specs/lifecycle.md "Exact
/// continuation"), or ends with `gnus_worker_lost`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ContinuationPolicy {
    /// Continue when a matching worker claims it (the default).
    #[default]
    Auto,
    /// Never: a lost worker after the first token is an error.
    Off,
}

impl ContinuationPolicy {
    /// The job's `limits.max_continuations`.
    pub fn max_continuations(self) -> u32 {
        match self {
            ContinuationPolicy::Auto => gcs_protocol::MAX_CONTINUATIONS,
            ContinuationPolicy::Off => 0,
        }
    }
}

type Extension = (RoutingMode, PrivacyLevel, TimeoutOverrides, ContinuationPolicy);

/// The `gnus` extension object (26.15.4).
pub(super) fn gnus_extension(body: &Map<String, Value>) -> Result<Extension, ApiError> {
    let mut out = (
        RoutingMode::Public,
        PrivacyLevel::Standard,
        TimeoutOverrides::default(),
        ContinuationPolicy::Auto,
    );
    let g = match body.get("gnus") {
        None | Some(Value::Null) => return Ok(out),
        Some(Value::Object(g)) => g,
        Some(_) => return Err(ApiError::invalid("gnus", "'gnus' must be an object")),
    };
    if let Some(n) = g.get("network").filter(|v| !v.is_null()) {
        let s = n.as_str().unwrap_or_default();
        out.0 = match s {
            "public" => RoutingMode::Public,
            "private" => RoutingMode::Private,
            "hybrid" => RoutingMode::Hybrid,
            "local" | "local_only" => RoutingMode::LocalOnly,
            // 26.11.3: only the gateway's own or attached workers.
            "gateway_local" => RoutingMode::GatewayLocal,
            _ => {
                return Err(ApiError::invalid(
                    "gnus.network",
                    "'gnus.network' must be public, private, hybrid, local_only or gateway_local",
                ))
            }
        };
    }
    if let Some(pm) = g.get("privacy_mode").filter(|v| !v.is_null()) {
        // One level per request: levels are not stacked (an encrypted
        // private job is `network: private` with `encrypted_payload`).
        let Some(s) = pm.as_str() else {
            return Err(ApiError::invalid(
                "gnus.privacy_mode",
                "'gnus.privacy_mode' must be one privacy mode (a string)",
            ));
        };
        out.1 = match s {
            // The spec's example calls the private-pool level "enterprise".
            "enterprise" => PrivacyLevel::PrivatePool,
            _ => parse_enum(PrivacyLevel::ALL, s).ok_or_else(|| {
                ApiError::invalid("gnus.privacy_mode", format!("unknown privacy mode '{s}'"))
            })?,
        };
        // `encrypted_payload` goes with every routing mode: the body is
        // sealed to whichever node wins the lease, whatever pool it came
        // from (specs/gateway.md "Privacy modes").
        // A minimized job names only a per-job tenant reference; private,
        // hybrid and local-only jobs go on their tenant's or swarm's topic
        // and are claimed by its members, which needs the name: refused,
        // never silently downgraded.
        if out.1 == PrivacyLevel::MetadataMinimized
            && !matches!(out.0, RoutingMode::Public | RoutingMode::GatewayLocal)
        {
            return Err(ApiError::unsupported(
                "gnus.privacy_mode",
                format!("privacy mode '{s}' cannot be honoured with '{}' routing", out.0),
            ));
        }
    }
    if let Some(r) = g.get("routing").and_then(Value::as_object) {
        if r.get("claim_policy").and_then(Value::as_str).is_some_and(|c| c != "first_valid_claim") {
            return Err(ApiError::unsupported(
                "gnus.routing.claim_policy",
                "only first_valid_claim is supported",
            ));
        }
        if r.get("replication_factor").is_some_and(|x| x.as_u64() != Some(1)) {
            return Err(ApiError::unsupported(
                "gnus.routing.replication_factor",
                "only replication_factor 1 is supported",
            ));
        }
        if r.get("verification_mode").and_then(Value::as_str).is_some_and(|c| c != "none") {
            return Err(ApiError::unsupported(
                "gnus.routing.verification_mode",
                "only verification_mode none is supported",
            ));
        }
    }
    if let Some(c) = g.get("continuation").filter(|v| !v.is_null()) {
        out.3 = match c.as_str() {
            Some("auto") => ContinuationPolicy::Auto,
            Some("off") => ContinuationPolicy::Off,
            _ => {
                return Err(ApiError::invalid(
                    "gnus.continuation",
                    "'gnus.continuation' must be \"auto\" or \"off\"",
                ))
            }
        };
    }
    if present(g, "retrieval") {
        return Err(ApiError::unsupported("gnus.retrieval", "no retrieval nodes are available"));
    }
    if let Some(l) = g.get("limits").and_then(Value::as_object) {
        let ms = |k: &str| {
            uint(l, k, 100, 3_600_000).map_err(|_| {
                ApiError::invalid(
                    &format!("gnus.limits.{k}"),
                    "must be milliseconds from 100 to 3600000",
                )
            })
        };
        out.2 = TimeoutOverrides {
            first_token_ms: ms("first_token_timeout_ms")?,
            idle_ms: ms("idle_stream_timeout_ms")?,
            wall_ms: ms("wall_timeout_ms")?,
        };
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn ext(gnus: Value) -> Result<Extension, ApiError> {
        let body = serde_json::json!({ "gnus": gnus });
        gnus_extension(body.as_object().unwrap())
    }

    #[test]
    fn encrypted_payload_goes_with_every_routing_mode() {
        for (network, mode) in [
            ("public", RoutingMode::Public),
            ("private", RoutingMode::Private),
            ("hybrid", RoutingMode::Hybrid),
            ("local_only", RoutingMode::LocalOnly),
        ] {
            let (r, p, _, _) =
                ext(serde_json::json!({"network": network, "privacy_mode": "encrypted_payload"}))
                    .unwrap();
            assert_eq!((r, p), (mode, PrivacyLevel::EncryptedPayload), "{network}");
        }
    }

    #[test]
    fn continuation_is_auto_or_off_and_anything_else_is_a_400() {
        assert_eq!(ext(serde_json::json!({})).unwrap().3, ContinuationPolicy::Auto);
        assert_eq!(ext(serde_json::json!({"continuation": null})).unwrap().3, ContinuationPolicy::Auto);
        let auto = ext(serde_json::json!({"continuation": "auto"})).unwrap().3;
        assert_eq!(auto.max_continuations(), gcs_protocol::MAX_CONTINUATIONS);
        let off = ext(serde_json::json!({"continuation": "off"})).unwrap().3;
        assert_eq!((off, off.max_continuations()), (ContinuationPolicy::Off, 0));
        for bad in [serde_json::json!("on"), serde_json::json!(true), serde_json::json!(0)] {
            let e = ext(serde_json::json!({"continuation": bad})).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{bad}");
            assert_eq!(e.param.as_deref(), Some("gnus.continuation"), "{bad}");
            assert_eq!(e.code, "invalid_value", "{bad}");
        }
    }

    #[test]
    fn stacked_or_unknown_privacy_modes_are_refused_by_name() {
        for bad in [
            serde_json::json!(["encrypted_payload", "private_pool"]),
            serde_json::json!({"mode": "encrypted_payload"}),
            serde_json::json!(1),
            serde_json::json!("encrypted"),
        ] {
            let e = ext(serde_json::json!({"privacy_mode": bad})).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("gnus.privacy_mode"), "{bad}");
        }
    }
}
