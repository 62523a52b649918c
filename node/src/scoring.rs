//! Gossipsub peer scoring (documented in specs/network.md).
//!
//! The one signal that matters here is P4, invalid message deliveries: every
//! envelope our validator rejects (bad signature, malformed, wrong topic)
//! costs its forwarder −100 per message (squared, decaying by half every
//! ~10 s), so a peer that forwards a handful of forgeries crosses the
//! graylist threshold and is ignored; honest peers that relay stale or
//! newer-version messages are *ignored*, not penalised.

use std::time::Duration;

use libp2p::gossipsub::{PeerScoreParams, PeerScoreThresholds, TopicScoreParams};

/// The parameters of every GCS topic (`topics::TABLE`), set on each topic
/// when the node joins it, so per-tenant and per-swarm topics are scored
/// like the fixed ones.
pub fn topic_params() -> TopicScoreParams {
    TopicScoreParams {
        topic_weight: 1.0,
        // P1/P2/P3 off: small networks have too few peers for delivery-rate
        // expectations to be meaningful.
        time_in_mesh_weight: 0.0,
        first_message_deliveries_weight: 0.0,
        mesh_message_deliveries_weight: 0.0,
        mesh_failure_penalty_weight: 0.0,
        invalid_message_deliveries_weight: -100.0,
        invalid_message_deliveries_decay: 0.5,
        ..TopicScoreParams::default()
    }
}

/// Score parameters (topics are added as they are joined) and thresholds.
pub fn peer_score() -> (PeerScoreParams, PeerScoreThresholds) {
    let params = PeerScoreParams {
        // Loopback tests run many peers on one IP: no IP colocation penalty.
        ip_colocation_factor_weight: 0.0,
        decay_interval: Duration::from_secs(1),
        ..PeerScoreParams::default()
    };
    let thresholds = PeerScoreThresholds {
        gossip_threshold: -100.0,
        publish_threshold: -500.0,
        graylist_threshold: -1000.0,
        accept_px_threshold: 10.0,
        opportunistic_graft_threshold: 5.0,
    };
    (params, thresholds)
}
