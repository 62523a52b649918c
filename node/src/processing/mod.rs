//! The processing queue of 26.2 and 26.22 (specs/batch.md, "Processing
//! queue"): [`queue`] is its sans-IO core, [`records`] its signed records
//! in the keyspace under `/gcs/processing/*` with their authority rows and
//! the replay that rebuilds a task's state from them, [`chunks`] the
//! requests and answers a task carries (held by its gateway, served only to
//! lock holders), [`worker`] a worker's grab-run-result loop, [`serve`]
//! the job-protocol requests between a lock holder and the task's gateway,
//! [`shell`] the worker's processing slots in the running node, [`batch`]
//! the gateway's side of a batch (enqueue, collect, usage records),
//! [`release`] the records that end work early (a holder's release, a
//! gateway's cancel), [`mirror`] the copies of a task's data on the
//! tenant's other gateways, [`manifest`] what one of them needs to take a
//! batch over.

/// The `SignedMessage` accessors every processing record shares, for a
/// record whose signer is the field `$signer` (textual scope: the modules
/// below see it).
macro_rules! signed_common {
    ($signer:ident) => {
        fn signer(&self) -> &NodeId {
            &self.$signer
        }
        fn message_type(&self) -> MessageType {
            self.message_type
        }
        fn version(&self) -> u16 {
            self.version
        }
        fn signature(&self) -> Option<&Signature> {
            self.signature.as_ref()
        }
        fn set_signature(&mut self, sig: Option<Signature>) {
            self.signature = sig;
        }
        fn created_at_ms(&self) -> u64 {
            self.created_at_ms
        }
    };
}

pub mod batch;
pub mod chunks;
pub mod manifest;
pub mod mirror;
#[cfg(test)]
mod mirror_tests;
pub mod queue;
#[cfg(test)]
mod queue_tests;
pub mod records;
#[cfg(test)]
mod records_tests;
pub mod release;
#[cfg(test)]
mod release_tests;
pub mod replay;
#[cfg(test)]
mod replay_tests;
pub mod serve;
#[cfg(test)]
mod serve_tests;
pub mod shell;
pub mod task;
pub mod worker;
#[cfg(test)]
mod worker_tests;
