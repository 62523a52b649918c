//! Keys, node ids, signatures and hashes.
//!
//! A node id *is* its ed25519 public key (`gnusnode_` + 64 hex digits), so any
//! message naming a node can be verified without a lookup, and nobody can speak
//! for a node id without holding its key.

use std::fmt;
use std::str::FromStr;

use ed25519_dalek::{Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::ProtocolError;

/// Prefix of every node id.
pub const NODE_ID_PREFIX: &str = "gnusnode_";

macro_rules! fixed_bytes {
    ($(#[$m:meta])* $name:ident, $len:expr) => {
        $(#[$m])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub [u8; $len]);

        impl $name {
            /// `0x`-prefixed lowercase hex, the JSON form.
            pub fn to_hex(&self) -> String {
                format!("0x{}", hex::encode(self.0))
            }
            /// Parses the `0x`-prefixed (or bare) hex form.
            pub fn from_hex(s: &str) -> Result<Self, ProtocolError> {
                let s = s.strip_prefix("0x").unwrap_or(s);
                let mut out = [0u8; $len];
                hex::decode_to_slice(s, &mut out).map_err(|_| {
                    ProtocolError::Malformed(format!(
                        concat!("invalid ", stringify!($name), " hex ({} chars)"),
                        s.len()
                    ))
                })?;
                Ok(Self(out))
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self.to_hex())
            }
        }

        // Hex strings in JSON, raw byte strings in CBOR.
        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                if s.is_human_readable() {
                    s.serialize_str(&self.to_hex())
                } else {
                    s.serialize_bytes(&self.0)
                }
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl<'de> serde::de::Visitor<'de> for V {
                    type Value = $name;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        write!(f, concat!(stringify!($len), " bytes or a hex string"))
                    }
                    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<$name, E> {
                        $name::from_hex(v).map_err(E::custom)
                    }
                    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<$name, E> {
                        let arr: [u8; $len] = v.try_into().map_err(|_| {
                            E::custom(format!("expected {} bytes, got {}", $len, v.len()))
                        })?;
                        Ok($name(arr))
                    }
                }
                if d.is_human_readable() {
                    d.deserialize_str(V)
                } else {
                    d.deserialize_bytes(V)
                }
            }
        }
    };
}

fixed_bytes!(
    /// An ed25519 signature.
    Signature, 64
);
fixed_bytes!(
    /// A 32-byte ed25519 public key.
    PublicKey, 32
);
fixed_bytes!(
    /// A blake3 content hash.
    Hash32, 32
);

impl Hash32 {
    /// blake3 of `data`.
    pub fn of(data: &[u8]) -> Self {
        Self(*blake3::hash(data).as_bytes())
    }
}

/// A node identity: `gnusnode_` followed by the hex of its ed25519 public key.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct NodeId(String);

impl NodeId {
    /// The node id of a public key.
    pub fn from_public_key(pk: &PublicKey) -> Self {
        Self(format!("{NODE_ID_PREFIX}{}", hex::encode(pk.0)))
    }
    /// The public key this id encodes.
    pub fn public_key(&self) -> PublicKey {
        let mut out = [0u8; 32];
        // Validated on construction, so this cannot fail.
        let _ = hex::decode_to_slice(&self.0[NODE_ID_PREFIX.len()..], &mut out);
        PublicKey(out)
    }
    /// The ed25519 verifying key; fails if the 32 bytes are not a curve point.
    pub fn verifying_key(&self) -> Result<VerifyingKey, ProtocolError> {
        VerifyingKey::from_bytes(&self.public_key().0)
            .map_err(|_| ProtocolError::BadNodeId(self.0.clone()))
    }
    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for NodeId {
    type Err = ProtocolError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let hexpart =
            s.strip_prefix(NODE_ID_PREFIX).ok_or_else(|| ProtocolError::BadNodeId(s.to_owned()))?;
        if hexpart.len() != 64
            || !hexpart.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(ProtocolError::BadNodeId(s.to_owned()));
        }
        Ok(Self(s.to_owned()))
    }
}
impl TryFrom<String> for NodeId {
    type Error = ProtocolError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}
impl From<NodeId> for String {
    fn from(n: NodeId) -> String {
        n.0
    }
}

/// A node's signing key. The same key signs GCS envelopes and (later) is the
/// libp2p identity, so the PeerId and the node id name the same key.
pub struct NodeKey(SigningKey);

impl NodeKey {
    /// A fresh key from the OS random source.
    pub fn generate() -> Result<Self, ProtocolError> {
        let mut seed = [0u8; 32];
        getrandom::getrandom(&mut seed).map_err(|e| ProtocolError::Random(e.to_string()))?;
        Ok(Self::from_seed(seed))
    }
    /// The key for a 32-byte secret seed (deterministic: test vectors use this).
    pub fn from_seed(seed: [u8; 32]) -> Self {
        Self(SigningKey::from_bytes(&seed))
    }
    /// The secret seed, for persisting the key.
    pub fn seed(&self) -> [u8; 32] {
        self.0.to_bytes()
    }
    /// The public key.
    pub fn public_key(&self) -> PublicKey {
        PublicKey(self.0.verifying_key().to_bytes())
    }
    /// This key's node id.
    pub fn node_id(&self) -> NodeId {
        NodeId::from_public_key(&self.public_key())
    }
    /// Signs a 32-byte digest.
    pub(crate) fn sign_digest(&self, digest: &[u8; 32]) -> Signature {
        Signature(self.0.sign(digest).to_bytes())
    }
}

impl fmt::Debug for NodeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the secret.
        write!(f, "NodeKey({})", self.node_id())
    }
}

/// Verifies `sig` over `digest` with the key encoded in `signer`.
pub(crate) fn verify_digest(
    signer: &NodeId,
    digest: &[u8; 32],
    sig: &Signature,
) -> Result<(), ProtocolError> {
    let vk = signer.verifying_key()?;
    let sig = ed25519_dalek::Signature::from_bytes(&sig.0);
    vk.verify_strict(digest, &sig).map_err(|_| ProtocolError::BadSignature)
}

/// The digest a signature covers: blake3(domain tag, 0x00, payload). The
/// per-type tag stops a signature over one message type being replayed as
/// another type with the same bytes.
pub fn signing_digest(domain_tag: &str, payload: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(domain_tag.as_bytes());
    h.update(&[0]);
    h.update(payload);
    *h.finalize().as_bytes()
}

// `Verifier` is used through verify_strict's trait bound on older versions.
#[allow(unused_imports)]
use Verifier as _;
