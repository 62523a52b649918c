//! The per-job direct-stream protocol (`/gcs/job/1.0.0`): claims, leases,
//! chunks, results, renewals and cancellations travel between the gateway
//! and the worker as signed protocol envelopes, not as gossip.

use serde::{Deserialize, Serialize};

/// A request on the job protocol.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum JobRequest {
    /// A signed envelope (claim, chunk, result, renewal, cancellation).
    Envelope(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The lease holder fetches the request body (26.11.2 `gateway_ref`).
    FetchPayload {
        /// Job.
        job_id: String,
        /// The lease the fetcher holds.
        lease_id: String,
    },
}

/// The answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum JobResponse {
    /// Taken.
    Ack,
    /// A signed envelope in return (lease grant, claim rejection).
    Envelope(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The payload bytes.
    Payload(#[serde(with = "serde_bytes")] Vec<u8>),
    /// Refused, with the reason.
    Refused(String),
}
