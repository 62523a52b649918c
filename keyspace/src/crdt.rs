//! The two CRDTs every key holds, and their join.
//!
//! Laws (property-tested in `tests/crdt_laws.rs`): for any states a, b, c of
//! one key, `join(a, b) == join(b, a)`, `join(join(a, b), c) == join(a,
//! join(b, c))` and `join(a, a) == a`. So replicas that receive the same
//! deltas, in any order, any number of times, end in identical states — and,
//! because states encode canonically, in identical bytes and digests.

use std::collections::BTreeMap;

use crdts::{CmRDT, CvRDT, LWWReg, VClock};
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::hlc::Hlc;
use crate::namespace::ValueKind;

/// Orders concurrent register writes: HLC first, then the writer's id, so
/// two writers never tie.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Marker {
    /// Write time.
    pub hlc: Hlc,
    /// Writer (node id).
    pub actor: String,
}

/// A last-writer-wins register; `None` is a deletion (a tombstone, so a
/// delete replicates like any write).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Register(pub LWWReg<Option<ByteBuf>, Marker>);

impl Register {
    /// A register written by `actor` at `hlc`.
    pub fn new(value: Option<Vec<u8>>, hlc: Hlc, actor: &str) -> Self {
        Register(LWWReg {
            val: value.map(ByteBuf::from),
            marker: Marker { hlc, actor: actor.into() },
        })
    }
    /// The value, or `None` if deleted.
    pub fn value(&self) -> Option<&[u8]> {
        self.0.val.as_ref().map(|b| b.as_slice())
    }
    /// When it was written.
    pub fn hlc(&self) -> Hlc {
        self.0.marker.hlc
    }
    fn join(&mut self, other: Register) {
        // crdts' LWWReg ignores an equal marker with a different value; a
        // correct writer never reuses a marker, but a buggy or hostile one
        // could, so break that tie by value to stay commutative.
        if self.0.validate_merge(&other.0).is_err() {
            if other.0.val > self.0.val {
                self.0.val = other.0.val;
            }
        } else {
            self.0.merge(other.0);
        }
    }
}

/// An add-wins observed-remove set (ORSWOT-style, state-based): an element
/// is present while it has a dot the other replica has not seen removed.
/// Concurrent add and remove of one element: the add wins.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AwSet {
    /// Causal context: every dot this state has seen.
    pub clock: VClock<String>,
    /// Element → its live dots (actor → counter; one per actor).
    pub entries: BTreeMap<ByteBuf, BTreeMap<String, u64>>,
    /// Latest write time seen (for retention).
    pub updated: Hlc,
}

impl AwSet {
    /// Adds `element` as `actor` at `hlc`, superseding the dots observed.
    pub fn add(&mut self, actor: &str, element: Vec<u8>, hlc: Hlc) {
        let dot = self.clock.inc(actor.to_string());
        self.clock.apply(dot.clone());
        let dots = BTreeMap::from([(dot.actor, dot.counter)]);
        self.entries.insert(ByteBuf::from(element), dots);
        self.updated = self.updated.max(hlc);
    }
    /// Removes `element` (the dots observed so far).
    pub fn remove(&mut self, element: &[u8], hlc: Hlc) {
        self.entries.remove(&ByteBuf::from(element.to_vec()));
        self.updated = self.updated.max(hlc);
    }
    /// Whether `element` is present.
    pub fn contains(&self, element: &[u8]) -> bool {
        self.entries.contains_key(&ByteBuf::from(element.to_vec()))
    }
    /// The elements, in byte order.
    pub fn elements(&self) -> impl Iterator<Item = &[u8]> {
        self.entries.keys().map(|k| k.as_slice())
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn join(&mut self, other: AwSet) {
        let seen =
            |clock: &VClock<String>, actor: &String, counter: u64| clock.get(actor) >= counter;
        let mut out = BTreeMap::new();
        let mut theirs = other.entries;
        for (elem, mine) in std::mem::take(&mut self.entries) {
            let other_dots = theirs.remove(&elem).unwrap_or_default();
            let mut keep = BTreeMap::new();
            for (a, c) in &mine {
                if other_dots.get(a) == Some(c) || !seen(&other.clock, a, *c) {
                    keep.insert(a.clone(), *c);
                }
            }
            for (a, c) in other_dots {
                if !seen(&self.clock, &a, c) {
                    keep.insert(a, c);
                }
            }
            if !keep.is_empty() {
                out.insert(elem, keep);
            }
        }
        for (elem, other_dots) in theirs {
            let keep: BTreeMap<_, _> =
                other_dots.into_iter().filter(|(a, c)| !seen(&self.clock, a, *c)).collect();
            if !keep.is_empty() {
                out.insert(elem, keep);
            }
        }
        self.entries = out;
        self.clock.merge(other.clock);
        self.updated = self.updated.max(other.updated);
    }
}

/// The value at one key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CrdtValue {
    /// A register.
    Register(Register),
    /// A set.
    Set(AwSet),
}

impl CrdtValue {
    /// Which kind.
    pub fn kind(&self) -> ValueKind {
        match self {
            CrdtValue::Register(_) => ValueKind::Register,
            CrdtValue::Set(_) => ValueKind::Set,
        }
    }
    /// Latest write time, for retention.
    pub fn updated(&self) -> Hlc {
        match self {
            CrdtValue::Register(r) => r.hlc(),
            CrdtValue::Set(s) => s.updated,
        }
    }
    /// The join. Kinds never mix within a namespace; a mismatch returns the
    /// other value unchanged as the error.
    pub fn join(&mut self, other: CrdtValue) -> Result<(), CrdtValue> {
        match (self, other) {
            (CrdtValue::Register(a), CrdtValue::Register(b)) => a.join(b),
            (CrdtValue::Set(a), CrdtValue::Set(b)) => a.join(b),
            (_, other) => return Err(other),
        }
        Ok(())
    }
    /// The register, if it is one.
    pub fn as_register(&self) -> Option<&Register> {
        match self {
            CrdtValue::Register(r) => Some(r),
            CrdtValue::Set(_) => None,
        }
    }
    /// The set, if it is one.
    pub fn as_set(&self) -> Option<&AwSet> {
        match self {
            CrdtValue::Set(s) => Some(s),
            CrdtValue::Register(_) => None,
        }
    }
}
