//! netsim: fault injection over real `gcs-node` processes with history
//! checks (`run`), a load generator (`load`), and a discrete-event
//! simulation of claim contention and failure detection at 10–1000 nodes
//! over the real sans-IO lifecycle code (`scale`). See netsim/README.md.

pub mod adversary;
pub mod adversary_flood;
pub mod adversary_sybil;
pub mod adversary_trust;
pub mod batch;
pub mod checks;
pub mod client;
pub mod cluster;
pub mod history;
pub mod load;
pub mod netns;
pub mod report;
pub mod runner;
pub mod scale;
pub mod scenario;
pub mod series;
pub mod soak;

/// Why a run could not be carried out (as opposed to a failed check,
/// which is a result).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Filesystem, sockets, processes.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// A malformed scenario file.
    #[error("scenario: {0}")]
    Scenario(String),
    /// The topology could not be brought up.
    #[error("setup: {0}")]
    Setup(String),
    /// A malformed HTTP exchange.
    #[error("http: {0}")]
    Http(String),
}
