//! The node's persistent identity: one ed25519 key that signs GCS envelopes
//! and is the libp2p identity, so PeerId and node id name the same key.

use std::path::Path;

use gcs_gateway::durable::create_atomic;
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
    /// An existing file that is not a key is an error, never replaced: it
    /// may be the only copy of this node's identity.
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
                // Complete and synced before the name appears (a kill leaves
                // no file or the whole key, never an empty one); a racing
                // second start keeps the first key.
                match create_atomic(&path, hex::encode(key.seed()).as_bytes()) {
                    Ok(()) => {
                        tracing::info!(path = %path.display(), "created a new node identity");
                        Self::from_seed(key.seed())
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                        Self::load_or_create(data_dir)
                    }
                    Err(e) => Err(err(e.to_string())),
                }
            }
            Err(e) => Err(err(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_key_is_created_once_and_reloaded() {
        let dir = tempfile::tempdir().unwrap();
        let a = Identity::load_or_create(dir.path()).unwrap();
        let b = Identity::load_or_create(dir.path()).unwrap();
        assert_eq!(a.node_id(), b.node_id());
        let names: Vec<_> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from(KEY_FILE)], "leftover temp files");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join(KEY_FILE)).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "key readable by others: {mode:o}");
        }
    }

    #[test]
    fn a_temp_file_left_by_a_kill_does_not_block_the_next_start() {
        let dir = tempfile::tempdir().unwrap();
        // What a kill between the temp file's create and its write leaves.
        std::fs::write(dir.path().join(format!("{KEY_FILE}.tmp.{}", std::process::id())), b"")
            .unwrap();
        let a = Identity::load_or_create(dir.path()).unwrap();
        let text = std::fs::read_to_string(dir.path().join(KEY_FILE)).unwrap();
        assert_eq!(text.trim(), hex::encode(a.key.seed()));
    }

    #[test]
    fn an_empty_key_file_is_a_typed_error_not_a_new_identity() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(KEY_FILE), b"").unwrap();
        assert!(matches!(Identity::load_or_create(dir.path()), Err(NodeError::Identity { .. })));
    }
}
