//! The node's persistent identity: one ed25519 key that signs GCS envelopes
//! and is the libp2p identity, so PeerId and node id name the same key.

use std::path::Path;

use gcs_protocol::{NodeId, NodeKey};
use libp2p::identity::Keypair;
use libp2p::PeerId;

use crate::error::NodeError;

/// File name of the key inside the data directory.
pub const KEY_FILE: &str = "identity.key";

/// A node's keys.
#[derive(Debug)]
pub struct Identity {
    /// The GCS signing key.
    pub key: NodeKey,
    /// The same key as a libp2p keypair.
    pub keypair: Keypair,
}

impl Identity {
    /// The identity for a secret seed.
    pub fn from_seed(seed: [u8; 32]) -> Result<Self, NodeError> {
        let key = NodeKey::from_seed(seed);
        let mut bytes = seed;
        let keypair = Keypair::ed25519_from_bytes(&mut bytes)
            .map_err(|e| NodeError::Identity { path: "<seed>".into(), reason: e.to_string() })?;
        Ok(Self { key, keypair })
    }

    /// The GCS node id.
    pub fn node_id(&self) -> NodeId {
        self.key.node_id()
    }

    /// The libp2p peer id.
    pub fn peer_id(&self) -> PeerId {
        self.keypair.public().to_peer_id()
    }

    /// Loads the key from `data_dir`, creating it (mode 0600) on first start.
    pub fn load_or_create(data_dir: &Path) -> Result<Self, NodeError> {
        let path = data_dir.join(KEY_FILE);
        let err = |reason: String| NodeError::Identity { path: path.display().to_string(), reason };
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let mut seed = [0u8; 32];
                hex::decode_to_slice(text.trim(), &mut seed)
                    .map_err(|_| err("not 64 hex digits".into()))?;
                Self::from_seed(seed)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = NodeKey::generate()?;
                write_private(&path, &hex::encode(key.seed())).map_err(|e| err(e.to_string()))?;
                tracing::info!(path = %path.display(), "created a new node identity");
                Self::from_seed(key.seed())
            }
            Err(e) => Err(err(e.to_string())),
        }
    }
}

#[cfg(unix)]
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()
}

#[cfg(not(unix))]
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    std::fs::write(path, text)
}
