//! Sealed payloads (`gnus.privacy_mode: "encrypted_payload"`, 26.20.3): a
//! body sealed to one node, bound to one job, one lease and both parties.
//!
//! The recipient's key is its identity: a node id *is* its ed25519 public
//! key, and its X25519 key is that key's Montgomery form (the secret half
//! is the ed25519 seed's expanded scalar), so a gateway can seal to any
//! lease holder with nothing but the signed lease, and no key is advertised
//! that could go stale or be swapped. The same key signing and doing DH is
//! sound for this pair (ePrint 2021/509); the HKDF label keeps the derived
//! keys apart from anything else.
//!
//! Format, version 1 (`SEAL_VERSION`):
//! `0x01 || ephemeral X25519 public key (32) || ChaCha20-Poly1305 ciphertext+tag`.
//! The AEAD key is HKDF-SHA256(salt = ephemeral public || recipient public,
//! ikm = X25519(ephemeral, recipient), info = "gcs seal v1"); the nonce is
//! 12 zero bytes (every key is fresh: one ephemeral per seal). The AAD is
//! [`SealBinding::aad`]: the version byte, the purpose and the job id,
//! lease id, sender and recipient node ids, each length-prefixed, so a box
//! opens only for the exact (job, lease, sender, recipient) it was made for.

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::ChaCha20Poly1305;
use curve25519_dalek::montgomery::MontgomeryPoint;
use ed25519_dalek::SigningKey;
use hkdf::Hkdf;
use sha2::Sha256;

use crate::crypto::{NodeId, NodeKey};

/// The sealed format's version byte.
pub const SEAL_VERSION: u8 = 1;
/// Version byte, ephemeral key and tag: what a seal adds to the plaintext.
pub const SEAL_OVERHEAD: usize = 1 + 32 + 16;
const HKDF_INFO: &[u8] = b"gcs seal v1";

/// Why a box was not made or not opened.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SealError {
    /// The first byte names a format this build does not know.
    #[error("unsupported sealed-payload version {0}")]
    UnsupportedVersion(u8),
    /// Shorter than the version byte, ephemeral key and tag.
    #[error("sealed payload truncated ({0} bytes)")]
    Truncated(usize),
    /// A node id that is not an ed25519 public key.
    #[error("the recipient id is not a valid key")]
    BadRecipient,
    /// The box is for another node than the one opening it.
    #[error("sealed to another node")]
    NotForMe,
    /// The ephemeral key is a low-order point (the shared secret is zero).
    #[error("sealed payload carries a degenerate ephemeral key")]
    DegenerateKey,
    /// Authentication failed: tampered bytes, another recipient's key, or
    /// another job, lease or sender than the box was made for (AEAD cannot
    /// tell these apart, and must not).
    #[error("sealed payload does not open: tampered, or made for another key, job or lease")]
    Tampered,
    /// No randomness for the ephemeral key.
    #[error("no randomness: {0}")]
    Random(String),
}

/// What a box is for. A box of one purpose never opens as another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SealPurpose {
    /// A job body sealed to its lease holder.
    Lease,
    /// A job body a gateway keeps sealed to itself until a lease exists.
    AtRest,
}

impl SealPurpose {
    fn label(self) -> &'static [u8] {
        match self {
            SealPurpose::Lease => b"lease",
            SealPurpose::AtRest => b"at-rest",
        }
    }
}

/// The context a box is bound to (its AAD).
#[derive(Clone, Copy, Debug)]
pub struct SealBinding<'a> {
    /// What the box is for.
    pub purpose: SealPurpose,
    /// The job.
    pub job_id: &'a str,
    /// The lease (empty for [`SealPurpose::AtRest`]).
    pub lease_id: &'a str,
    /// Who sealed it (the job's gateway).
    pub sender: &'a NodeId,
    /// Who may open it.
    pub recipient: &'a NodeId,
}

impl<'a> SealBinding<'a> {
    /// A body for `holder` under `lease_id` of `job_id`, from `gateway`.
    pub fn lease(
        job_id: &'a str,
        lease_id: &'a str,
        gateway: &'a NodeId,
        holder: &'a NodeId,
    ) -> Self {
        Self { purpose: SealPurpose::Lease, job_id, lease_id, sender: gateway, recipient: holder }
    }

    /// A body `gateway` keeps for itself.
    pub fn at_rest(job_id: &'a str, gateway: &'a NodeId) -> Self {
        Self {
            purpose: SealPurpose::AtRest,
            job_id,
            lease_id: "",
            sender: gateway,
            recipient: gateway,
        }
    }

    /// The additional authenticated data: version, purpose, job, lease,
    /// sender, recipient, each after its u16 big-endian length.
    pub fn aad(&self) -> Vec<u8> {
        let mut out = vec![SEAL_VERSION];
        for part in [
            self.purpose.label(),
            self.job_id.as_bytes(),
            self.lease_id.as_bytes(),
            self.sender.as_str().as_bytes(),
            self.recipient.as_str().as_bytes(),
        ] {
            // Ids are bounded far below 64 KiB by the protocol's field limits.
            let n = u16::try_from(part.len()).unwrap_or(u16::MAX);
            out.extend_from_slice(&n.to_be_bytes());
            out.extend_from_slice(&part[..usize::from(n)]);
        }
        out
    }
}

/// A node's X25519 public key, from its id.
pub fn x25519_public(node: &NodeId) -> Result<[u8; 32], SealError> {
    let vk = node.verifying_key().map_err(|_| SealError::BadRecipient)?;
    Ok(vk.to_montgomery().to_bytes())
}

/// This node's X25519 secret (clamped when used).
fn x25519_secret(key: &NodeKey) -> [u8; 32] {
    SigningKey::from_bytes(&key.seed()).to_scalar_bytes()
}

fn aead(
    shared: &MontgomeryPoint,
    eph: &[u8; 32],
    recipient: &[u8; 32],
) -> Result<ChaCha20Poly1305, SealError> {
    let shared = shared.to_bytes();
    // A low-order ephemeral key makes the shared secret all zeros: anyone
    // could compute it, so such a box is refused outright.
    if shared.iter().all(|b| *b == 0) {
        return Err(SealError::DegenerateKey);
    }
    let mut salt = [0u8; 64];
    salt[..32].copy_from_slice(eph);
    salt[32..].copy_from_slice(recipient);
    let mut okm = [0u8; 32];
    Hkdf::<Sha256>::new(Some(&salt), &shared)
        .expand(HKDF_INFO, &mut okm)
        .map_err(|_| SealError::Tampered)?;
    ChaCha20Poly1305::new_from_slice(&okm).map_err(|_| SealError::Tampered)
}

const NONCE: [u8; 12] = [0; 12];

/// Seals `plaintext` to `binding.recipient` with a fresh ephemeral key.
pub fn seal_to(plaintext: &[u8], binding: &SealBinding<'_>) -> Result<Vec<u8>, SealError> {
    seal_with_ephemeral(plaintext, binding, random32()?)
}

/// 32 bytes from the OS's randomness (ephemeral keys, commitment nonces).
pub fn random32() -> Result<[u8; 32], SealError> {
    let mut out = [0u8; 32];
    getrandom::getrandom(&mut out).map_err(|e| SealError::Random(e.to_string()))?;
    Ok(out)
}

/// [`seal_to`] with a given ephemeral secret: for test vectors only (a
/// reused ephemeral secret reuses the key and nonce).
pub fn seal_with_ephemeral(
    plaintext: &[u8],
    binding: &SealBinding<'_>,
    eph_secret: [u8; 32],
) -> Result<Vec<u8>, SealError> {
    let recipient = x25519_public(binding.recipient)?;
    let eph_public = MontgomeryPoint::mul_base_clamped(eph_secret).to_bytes();
    let shared = MontgomeryPoint(recipient).mul_clamped(eph_secret);
    let cipher = aead(&shared, &eph_public, &recipient)?;
    let aad = binding.aad();
    let ct = cipher
        .encrypt(&NONCE.into(), Payload { msg: plaintext, aad: &aad })
        .map_err(|_| SealError::Tampered)?;
    let mut out = Vec::with_capacity(SEAL_OVERHEAD + plaintext.len());
    out.push(SEAL_VERSION);
    out.extend_from_slice(&eph_public);
    out.extend_from_slice(&ct);
    Ok(out)
}

/// Opens a box sealed to `key`'s node under `binding`; the plaintext stays
/// in memory (the caller must not store it).
pub fn open_sealed(
    sealed: &[u8],
    key: &NodeKey,
    binding: &SealBinding<'_>,
) -> Result<Vec<u8>, SealError> {
    match sealed.first() {
        None => return Err(SealError::Truncated(0)),
        Some(&SEAL_VERSION) => {}
        Some(&v) => return Err(SealError::UnsupportedVersion(v)),
    }
    if sealed.len() < SEAL_OVERHEAD {
        return Err(SealError::Truncated(sealed.len()));
    }
    if binding.recipient != &key.node_id() {
        return Err(SealError::NotForMe);
    }
    let mut eph = [0u8; 32];
    eph.copy_from_slice(&sealed[1..33]);
    let recipient = x25519_public(binding.recipient)?;
    let shared = MontgomeryPoint(eph).mul_clamped(x25519_secret(key));
    let cipher = aead(&shared, &eph, &recipient)?;
    let aad = binding.aad();
    cipher
        .decrypt(&NONCE.into(), Payload { msg: &sealed[33..], aad: &aad })
        .map_err(|_| SealError::Tampered)
}

#[cfg(test)]
#[path = "seal_tests.rs"]
mod tests;
