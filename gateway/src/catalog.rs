//! The model catalogue a gateway serves (`/v1/models`, admission): built
//! from what fresh registrations agree on, never from whoever sorts first,
//! and overridden by the models the gateway trusts (its build's catalogue,
//! or an operator's allow-list). A registration is a peer's self-description:
//! a lone outlier — `gnus-auto` with `context_tokens: 1`, or `gnus-auto`
//! mapped to another model — must not change what clients are told or what
//! admission checks against. Pure: registrations in, catalogue out.

use std::collections::{BTreeMap, BTreeSet};

use gcs_protocol::{ApiType, ModelInfo, NodeId, NodeRegistration, NodeStatus};

/// One model name the network serves now.
#[derive(Clone, Debug, PartialEq)]
pub struct Served {
    /// The model behind the name.
    pub info: ModelInfo,
    /// Distinct workers that advertise it as `info` says.
    pub workers: usize,
    /// The median of the decode speeds (tokens/s) those workers measured
    /// for it; 0 when none advertises one. A client's hint, and the length
    /// of a long request's default wall timeout (`admit::default_wall_ms`,
    /// capped), never an admission or routing input: a worker may lie, and
    /// the median needs a majority of liars to move.
    pub decode_tokens_per_s: f64,
}

/// Model names served now.
pub type Catalog = BTreeMap<String, Served>;

/// A model whose metadata the gateway does not take from peers.
#[derive(Clone, Debug, PartialEq)]
pub struct Trusted {
    /// Canonical id.
    pub model_id: String,
    /// Context in tokens: what admission checks against.
    pub context_tokens: u32,
    /// Aliases it answers to; empty: the aliases the network agrees on for
    /// this id (never a name another trusted model owns).
    pub aliases: Vec<String>,
    /// What it answers; empty: what the network agrees on for this id.
    pub tasks: Vec<ApiType>,
}

impl Trusted {
    /// A model of the build's own catalogue, trusted as it is.
    pub fn from_info(m: &ModelInfo) -> Self {
        Self {
            model_id: m.model_id.clone(),
            context_tokens: m.context_tokens,
            aliases: m.aliases.clone(),
            tasks: m.tasks.clone(),
        }
    }
}

/// Which model metadata the gateway takes from the network.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelPolicy {
    /// Models whose id, aliases, context and tasks come from here.
    pub trusted: Vec<Trusted>,
    /// Serve only the trusted models (an operator's `--models-allow`); when
    /// false, other models come from agreement among registrations.
    pub only_trusted: bool,
}

/// What one registration says a name is; the votes are counted on it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Variant {
    model_id: String,
    context_tokens: u32,
    quantization: String,
    backend: String,
    tasks: Vec<ApiType>,
    vocab_size: u32,
}

impl Variant {
    fn of(m: &ModelInfo) -> Self {
        let mut tasks = m.tasks.clone();
        tasks.sort();
        tasks.dedup();
        Self {
            model_id: m.model_id.clone(),
            context_tokens: m.context_tokens,
            quantization: m.quantization.clone(),
            backend: m.backend.clone(),
            tasks,
            vocab_size: m.vocab_size,
        }
    }
}

/// Votes for one name: variant → the distinct nodes that advertise it, and
/// an example of the advertised entry (for its aliases).
type Votes = BTreeMap<Variant, (BTreeSet<NodeId>, ModelInfo)>;

fn available(r: &NodeRegistration) -> bool {
    !matches!(r.status, NodeStatus::Offline | NodeStatus::Draining)
}

/// The catalogue of `regs` under `policy`.
///
/// Agreement: for each name (a model id or an alias) every available
/// registration has one vote (its first entry answering to the name); the
/// variant (model id, context, quantization, backend, tasks, vocabulary) with the most
/// distinct nodes wins. A tie goes to the larger context — the worker
/// refuses a prompt longer than its real context anyway, while a too small
/// one would make the gateway refuse every honest request — then to the
/// smaller model id, so the answer does not depend on arrival order.
///
/// Trusted models override agreement: their names are theirs (no vote maps
/// them to another model), their context and tasks are the trusted ones,
/// and their `workers` count only registrations that advertise the trusted
/// model id under that name.
pub fn build<'a>(
    regs: impl IntoIterator<Item = &'a NodeRegistration>,
    policy: &ModelPolicy,
) -> Catalog {
    let regs: Vec<&NodeRegistration> = regs.into_iter().filter(|r| available(r)).collect();
    let mut out = agree(&regs, policy);
    for (name, served) in out.iter_mut() {
        served.decode_tokens_per_s = median_rate(&regs, name, &served.info.model_id);
    }
    out
}

/// The median decode speed the workers counted for `name` (their entry
/// answering to it is `model_id`) advertise; 0 without any.
fn median_rate(regs: &[&NodeRegistration], name: &str, model_id: &str) -> f64 {
    let mut rates: Vec<f64> = regs
        .iter()
        .filter_map(|r| r.model(name))
        .filter(|m| m.model_id == model_id && m.decode_tokens_per_s > 0.0)
        .map(|m| m.decode_tokens_per_s)
        .collect();
    rates.sort_by(f64::total_cmp);
    match rates.len() {
        0 => 0.0,
        n if n % 2 == 1 => rates[n / 2],
        n => (rates[n / 2 - 1] + rates[n / 2]) / 2.0,
    }
}

/// Agreement and trust, without the decode speeds ([`build`]).
fn agree(regs: &[&NodeRegistration], policy: &ModelPolicy) -> Catalog {
    let mut votes: BTreeMap<String, Votes> = BTreeMap::new();
    for r in regs {
        let mut voted: BTreeSet<&str> = BTreeSet::new();
        for m in &r.models {
            for name in std::iter::once(&m.model_id).chain(&m.aliases) {
                if !voted.insert(name.as_str()) {
                    continue; // one vote per node and name
                }
                let v = votes.entry(name.clone()).or_default();
                let e = v.entry(Variant::of(m)).or_insert_with(|| (BTreeSet::new(), m.clone()));
                e.0.insert(r.node_id.clone());
            }
        }
    }
    let mut out = Catalog::new();
    let owned: BTreeSet<&str> = policy
        .trusted
        .iter()
        .flat_map(|t| std::iter::once(&t.model_id).chain(&t.aliases))
        .map(String::as_str)
        .collect();
    for t in &policy.trusted {
        trusted_entries(t, &votes, &owned, &mut out);
    }
    if policy.only_trusted {
        return out;
    }
    for (name, v) in &votes {
        if owned.contains(name.as_str()) || out.contains_key(name) {
            continue;
        }
        if let Some((variant, (nodes, example))) = v.iter().max_by(|a, b| {
            let (va, vb) = (a.0, b.0);
            (a.1 .0.len(), va.context_tokens, std::cmp::Reverse(&va.model_id))
                .cmp(&(b.1 .0.len(), vb.context_tokens, std::cmp::Reverse(&vb.model_id)))
        }) {
            let info = ModelInfo {
                model_id: variant.model_id.clone(),
                aliases: example.aliases.clone(),
                context_tokens: variant.context_tokens,
                quantization: variant.quantization.clone(),
                backend: variant.backend.clone(),
                tasks: variant.tasks.clone(),
                vocab_size: variant.vocab_size,
                // Per worker, not per catalogue entry: the tracker reads
                // them from each registration.
                ..Default::default()
            };
            out.insert(
                name.clone(),
                Served { info, workers: nodes.len(), decode_tokens_per_s: 0.0 },
            );
        }
    }
    out
}

/// The names of one trusted model that some registration serves now.
fn trusted_entries(
    t: &Trusted,
    votes: &BTreeMap<String, Votes>,
    owned: &BTreeSet<&str>,
    out: &mut Catalog,
) {
    // What the network says of this id under its own name: the fields the
    // trusted entry leaves open.
    let of_id = |name: &str| -> Vec<(&Variant, &(BTreeSet<NodeId>, ModelInfo))> {
        votes
            .get(name)
            .map(|v| v.iter().filter(|(k, _)| k.model_id == t.model_id).collect())
            .unwrap_or_default()
    };
    let agreed = of_id(&t.model_id).into_iter().max_by_key(|(_, (n, _))| n.len());
    let aliases: Vec<String> = if t.aliases.is_empty() {
        let theirs = agreed.map(|(_, (_, m))| m.aliases.clone()).unwrap_or_default();
        // An open alias list never takes a name another trusted model owns.
        let others: BTreeSet<&str> = owned.iter().copied().collect();
        theirs.into_iter().filter(|a| !others.contains(a.as_str())).collect()
    } else {
        t.aliases.clone()
    };
    let tasks = if t.tasks.is_empty() {
        agreed.map(|(v, _)| v.tasks.clone()).unwrap_or_default()
    } else {
        t.tasks.clone()
    };
    // The vocabulary is the agreed one for this id (0, unchecked at the
    // edge, when none agrees): it only lets the edge refuse a logit_bias id
    // early; the worker checks against its own weights either way.
    let (quantization, backend, vocab_size) = agreed
        .map(|(v, _)| (v.quantization.clone(), v.backend.clone(), v.vocab_size))
        .unwrap_or_default();
    let info = ModelInfo {
        model_id: t.model_id.clone(),
        aliases: aliases.clone(),
        context_tokens: t.context_tokens,
        quantization,
        backend,
        tasks,
        vocab_size,
        ..Default::default()
    };
    for name in std::iter::once(&t.model_id).chain(&aliases) {
        let workers: BTreeSet<&NodeId> =
            of_id(name).into_iter().flat_map(|(_, (n, _))| n.iter()).collect();
        if !workers.is_empty() {
            let served =
                Served { info: info.clone(), workers: workers.len(), decode_tokens_per_s: 0.0 };
            out.insert(name.clone(), served);
        }
    }
}

/// Most model names remembered as "served once" (a 503 rather than a 404
/// when nobody serves them now): sybil registrations minting names must
/// not grow the memory without bound.
pub const MAX_SEEN: usize = 1024;
/// How long a name stays remembered after it was last served.
pub const SEEN_TTL_MS: u64 = 24 * 3_600_000;

/// Model names the network served recently, bounded by [`MAX_SEEN`] (the
/// least recently served is forgotten first) and [`SEEN_TTL_MS`].
#[derive(Debug, Default)]
pub struct SeenModels {
    last: BTreeMap<String, u64>,
}

impl SeenModels {
    /// `names` are served at `now_ms`.
    pub fn note<'a>(&mut self, names: impl IntoIterator<Item = &'a String>, now_ms: u64) {
        for n in names {
            self.last.insert(n.clone(), now_ms);
        }
        self.last.retain(|_, t| now_ms.saturating_sub(*t) <= SEEN_TTL_MS);
        if self.last.len() > MAX_SEEN {
            let mut by_age: Vec<(u64, String)> =
                self.last.iter().map(|(n, t)| (*t, n.clone())).collect();
            by_age.sort();
            for (_, n) in by_age.into_iter().take(self.last.len() - MAX_SEEN) {
                self.last.remove(&n);
            }
        }
    }

    /// Whether `name` was served recently.
    pub fn contains(&self, name: &str) -> bool {
        self.last.contains_key(name)
    }

    /// Names remembered.
    pub fn len(&self) -> usize {
        self.last.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }
}

#[cfg(test)]
#[path = "catalog_tests.rs"]
mod tests;
