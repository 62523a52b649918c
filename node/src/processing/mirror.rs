//! Mirrors of a task's data on the tenant's other gateways (specs/batch.md,
//! "Mirrors"). The task record replicates everywhere, but its input chunks
//! and its workers' outputs are job-participant records. Held only by the
//! gateway that enqueued the task, no worker could fetch an input or hand
//! in an answer while that gateway was down, and a gateway lost with its
//! disk would lose them. Here each gateway the task's tenant admitted pulls what it
//! lacks of the tenant's tasks from the others ([`wanted`], [`answer`],
//! [`store`]): inputs as signed by the task's gateway, outputs under the
//! same rules as a worker's delivery (`chunks::accept_output`). A worker
//! then fetches from, and delivers to, any of them (`serve::NetSource`),
//! and the task's gateway pulls back what was delivered elsewhere.
//!
//! Nothing is cursor-based: what a node lacks is read from its store (the
//! chunk ids its task record names without an input here; those whose
//! accepted result names an output not here), so a pull that failed or a
//! page cut short is simply asked again.

use gcs_keyspace::{keys, Keyspace};
use gcs_protocol::NodeId;
use libp2p::PeerId;

use super::chunks::{self, ProcessingError, MAX_INPUT_BYTES};
use super::records::{self, TaskRecord};
pub use crate::jobs::wire::{MirrorPage, MirrorPull, MIRROR_VERSION};
use crate::tenants::TenantTrust;

/// Chunk ids one pull may name.
pub const MAX_PULL_CHUNKS: usize = 256;
/// Record bytes one answer carries at most (the job protocol refuses
/// answers over 10 MiB; one output is at most 1 MiB).
pub const PULL_BUDGET: usize = 4 << 20;

/// Chunk ids of one task whose input, and whose accepted output, this node
/// was found to hold: both only grow (an input is never replaced, an
/// accepted result never undone), so a round reads the rest only.
#[derive(Debug, Default)]
pub struct Held {
    inputs: std::collections::HashSet<String>,
    outputs: std::collections::HashSet<String>,
    manifest: bool,
}

/// Whether this node lacks the batch manifest of `task` (a task of a
/// batch); `held` remembers one found.
pub fn wants_manifest(
    ks: &Keyspace,
    task: &TaskRecord,
    held: &mut Held,
) -> Result<bool, ProcessingError> {
    if held.manifest || task.batch_id.is_none() {
        return Ok(false);
    }
    held.manifest = super::manifest::held(ks, task)?.is_some();
    Ok(!held.manifest)
}

/// What this node lacks of a task: chunk ids without an input here, and
/// chunk ids whose accepted result names an output not here. `held` is
/// what an earlier call found, and grows.
pub fn wanted(
    ks: &Keyspace,
    task_id: &str,
    now_ms: u64,
    held: &mut Held,
) -> Result<(Vec<String>, Vec<String>), ProcessingError> {
    let s = records::stored(ks, task_id)?.ok_or(ProcessingError::Unknown)?;
    let mut inputs = vec![];
    for c in s.task.subtasks.iter().flat_map(|st| &st.chunk_ids) {
        if held.inputs.contains(c) {
            continue;
        }
        if ks.get_bytes(&keys::processing_chunk(task_id, c))?.is_some() {
            held.inputs.insert(c.clone());
        } else {
            inputs.push(c.clone());
        }
    }
    let q = records::replay(&s, now_ms);
    let mut outputs = vec![];
    for sub in &s.task.subtasks {
        let Some(r) = q.result(task_id, &sub.subtask_id) else { continue };
        for (at, c) in sub.chunk_ids.iter().enumerate() {
            if held.outputs.contains(c) {
                continue;
            }
            if chunks::held_output(ks, task_id, c, r.chunk_hashes.get(at))?.is_some() {
                held.outputs.insert(c.clone());
            } else {
                outputs.push(c.clone());
            }
        }
    }
    Ok((inputs, outputs))
}

/// Whether `node` is a gateway `task`'s tenant admitted (a live
/// `tenant_gateway` certificate from the tenant's issuer this node trusts).
pub fn tenant_gateway(
    ks: &Keyspace,
    trust: &TenantTrust,
    task: &TaskRecord,
    node: &NodeId,
    now_ms: u64,
) -> bool {
    records::admitted_gateway(ks, trust, &task.tenant_id, node, now_ms).is_ok()
}

/// Every gateway `task`'s tenant admitted, as this node's store holds
/// their certificates; the task's own gateway first.
pub fn tenant_gateways(
    ks: &Keyspace,
    trust: &TenantTrust,
    task: &TaskRecord,
    now_ms: u64,
) -> Vec<NodeId> {
    let mut out = vec![task.gateway_node_id.clone()];
    let Some(issuer) = trust.with(|t| t.tenants.get(&task.tenant_id).cloned()) else {
        return out;
    };
    let scope = gcs_protocol::MembershipScope::TenantGateway;
    let prefix = keys::membership(issuer.as_str(), scope.as_str(), "");
    for (k, _) in ks.scan_prefix(&prefix).unwrap_or_default() {
        let Ok(node) = k[prefix.len()..].parse::<NodeId>() else { continue };
        if !out.contains(&node) && tenant_gateway(ks, trust, task, &node, now_ms) {
            out.push(node);
        }
    }
    out
}

/// The answer to a pull from `peer`: only to a gateway the task's tenant
/// admitted, only records of that task, within the budget.
pub fn answer(
    ks: &Keyspace,
    trust: &TenantTrust,
    peer: Option<PeerId>,
    p: &MirrorPull,
    now_ms: u64,
) -> Result<MirrorPage, ProcessingError> {
    if p.version != MIRROR_VERSION {
        return Err(ProcessingError::Mismatch("unsupported mirror request version"));
    }
    if p.inputs.len() + p.outputs.len() > MAX_PULL_CHUNKS {
        return Err(ProcessingError::TooLarge("chunk ids in one pull"));
    }
    if peer.is_some() && crate::jobs::peer_of(&p.asker) != peer {
        return Err(ProcessingError::NotHolder);
    }
    let s = records::stored(ks, &p.task_id)?.ok_or(ProcessingError::Unknown)?;
    records::admitted_gateway(ks, trust, &s.task.tenant_id, &p.asker, now_ms)?;
    let ids = chunks::chunk_ids(&s);
    let named = |c: &str| ids.contains(c);
    let mut page = MirrorPage::default();
    let mut bytes = 0usize;
    let mut room = |b: &[u8]| {
        let fits = bytes == 0 || bytes + b.len() <= PULL_BUDGET;
        bytes += b.len();
        fits
    };
    if p.manifest {
        if let Some(b) = super::manifest::held(ks, &s.task)? {
            room(&b);
            page.manifest = Some(serde_bytes::ByteBuf::from(b));
        }
    }
    for c in p.inputs.iter().filter(|c| named(c)) {
        if let Some(b) = ks.get_bytes(&keys::processing_chunk(&p.task_id, c))? {
            if !room(&b) {
                return Ok(page);
            }
            page.inputs.push(serde_bytes::ByteBuf::from(b));
        }
    }
    for c in p.outputs.iter().filter(|c| named(c)) {
        for (_, v) in ks.scan_prefix(&keys::processing_outputs_of_chunk(&p.task_id, c))? {
            let Some(b) = v.as_register().and_then(|r| r.value()) else { continue };
            if !room(b) {
                return Ok(page);
            }
            page.outputs.push(serde_bytes::ByteBuf::from(b.to_vec()));
        }
    }
    Ok(page)
}

/// Stores a page pulled for `task_id`: an input only if signed by the
/// task's gateway for this task, chunk and tenant (`chunks::check_input`);
/// an output only as a delivery would be (`chunks::accept_output`: the
/// lock's holder, before it expired, answering the stored input). Returns
/// how many of each were new here.
pub fn store(
    ks: &Keyspace,
    task_id: &str,
    page: &MirrorPage,
    now_ms: u64,
) -> Result<(usize, usize), ProcessingError> {
    let s = records::stored(ks, task_id)?.ok_or(ProcessingError::Unknown)?;
    let ids = chunks::chunk_ids(&s);
    let mut new = (0, 0);
    for b in &page.inputs {
        if b.len() > MAX_INPUT_BYTES {
            continue;
        }
        let c: chunks::InputChunk = chunks::decode(b, MAX_INPUT_BYTES)?;
        if !ids.contains(c.chunk_id.as_str()) {
            continue;
        }
        let c = chunks::check_input(&s.task, &c.chunk_id, b)?;
        let key = keys::processing_chunk(task_id, &c.chunk_id);
        if ks.get_bytes(&key)?.is_none() {
            ks.put(&key, b.to_vec(), now_ms)?;
            new.0 += 1;
        }
    }
    for b in &page.outputs {
        let o: chunks::OutputChunk = match chunks::decode(b, chunks::MAX_OUTPUT_BYTES + 4096) {
            Ok(o) => o,
            Err(_) => continue,
        };
        let key = keys::processing_output(task_id, &o.chunk_id, &o.lock_id);
        if o.task_id != task_id || ks.get_bytes(&key)?.is_some() {
            continue;
        }
        // An output its task's rules would refuse from a worker is
        // refused from a mirror too (another lock's late answer, say).
        if chunks::accept_output(ks, b, now_ms).is_ok() {
            new.1 += 1;
        }
    }
    Ok(new)
}

/// Stores the pulled batch manifest of `task_id` if it is its gateway's
/// (`manifest::check`); whether it was new.
pub fn store_manifest(
    ks: &Keyspace,
    task_id: &str,
    bytes: &[u8],
    now_ms: u64,
) -> Result<bool, ProcessingError> {
    let task = records::task(ks, task_id)?.ok_or(ProcessingError::Unknown)?;
    super::manifest::store(ks, &task, bytes, now_ms)
}

/// How often a gateway looks for what it lacks of its tenants' tasks.
pub const MIRROR_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// The running mirror of a gateway node.
#[allow(missing_debug_implementations)]
pub struct Mirror {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Mirror {
    /// Stops pulling, and waits until the loop has let go of the store (a
    /// node restarted in the same process opens it again at once). A pull
    /// waiting on a peer is given up.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// One task to pull for, and where from.
struct Want {
    task_id: String,
    inputs: Vec<String>,
    outputs: Vec<String>,
    manifest: bool,
    sources: Vec<NodeId>,
}

/// Tasks a round passes over, and until when: one with nothing more to
/// come (complete or cancelled, nothing lacking) while its records are
/// kept; one of a tenant that has not admitted this node, or admitted no
/// other gateway to pull from, for [`NOT_ADMITTED_SKIP_MS`] (a certificate
/// may come later).
type Skip = std::collections::HashMap<String, u64>;

/// How long a task of a tenant that has not admitted this node (or has
/// admitted no other gateway to pull from) is passed over.
const NOT_ADMITTED_SKIP_MS: u64 = 60_000;

/// The tasks this node should mirror and lacks something of.
fn round_plan(
    ks: &Keyspace,
    trust: &TenantTrust,
    me: &NodeId,
    (skip, held): &mut (Skip, std::collections::HashMap<String, Held>),
    now_ms: u64,
) -> Result<Vec<Want>, ProcessingError> {
    let mut out = vec![];
    skip.retain(|_, until| *until > now_ms);
    held.retain(|t, _| !skip.contains_key(t));
    for (key, v) in ks.scan_prefix(gcs_keyspace::Namespace::ProcessingTasks.prefix())? {
        let task_id = &key[gcs_keyspace::Namespace::ProcessingTasks.prefix().len()..];
        if skip.contains_key(task_id) {
            continue;
        }
        let Some(bytes) = v.as_register().and_then(|r| r.value()) else { continue };
        let Ok(t) = gcs_protocol::codec::from_cbor_bytes::<TaskRecord>(bytes) else { continue };
        if !tenant_gateway(ks, trust, &t, me, now_ms) {
            skip.insert(task_id.to_string(), now_ms + NOT_ADMITTED_SKIP_MS);
            continue;
        }
        let mut sources: Vec<NodeId> =
            tenant_gateways(ks, trust, &t, now_ms).into_iter().filter(|n| n != me).collect();
        if sources.is_empty() {
            // The tenant's only gateway: nothing to pull from (another may
            // be admitted later).
            skip.insert(task_id.to_string(), now_ms + NOT_ADMITTED_SKIP_MS);
            continue;
        }
        let h = held.entry(task_id.to_string()).or_default();
        let (inputs, outputs) = wanted(ks, task_id, now_ms, h)?;
        let manifest = wants_manifest(ks, &t, h)?;
        if inputs.is_empty() && outputs.is_empty() {
            let s = records::stored(ks, task_id)?.ok_or(ProcessingError::Unknown)?;
            let q = records::replay(&s, now_ms);
            // Nothing more will come of it: every subtask answered or bad,
            // or its gateway cancelled it.
            if q.is_complete(task_id) || q.cancelled(task_id) {
                // Until its records are compacted away (then it is gone).
                let kept = gcs_keyspace::Namespace::ProcessingTasks.retention_ms();
                skip.insert(task_id.to_string(), now_ms.saturating_add(kept.unwrap_or(u64::MAX)));
                continue;
            }
            if !manifest {
                continue;
            }
        }
        if !outputs.is_empty() {
            // Then the workers that signed its results: each keeps the
            // outputs it made (one its gateway lost before any mirror
            // pulled it is still there).
            for n in result_signers(ks, task_id)? {
                if n != *me && !sources.contains(&n) {
                    sources.push(n);
                }
            }
        }
        out.push(Want { task_id: task_id.to_string(), inputs, outputs, manifest, sources });
    }
    Ok(out)
}

/// The nodes that signed a result of `task_id` (the last segment of each
/// result key), in key order.
fn result_signers(ks: &Keyspace, task_id: &str) -> Result<Vec<NodeId>, ProcessingError> {
    let mut out: Vec<NodeId> = vec![];
    for (k, _) in ks.scan_prefix(&keys::processing_results(task_id))? {
        let Some(n) = k.rsplit('/').next().and_then(|n| n.parse::<NodeId>().ok()) else { continue };
        if !out.contains(&n) {
            out.push(n);
        }
    }
    Ok(out)
}

/// Starts pulling, every [`MIRROR_EVERY`], what this gateway lacks of the
/// tasks of the tenants that admitted it.
pub fn start(
    ks: std::sync::Arc<Keyspace>,
    trust: crate::tenants::TrustHandle,
    me: NodeId,
    network: crate::network::Network,
) -> Mirror {
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(async move {
        let mut state = (Skip::new(), std::collections::HashMap::new());
        let mut every = tokio::time::interval(MIRROR_EVERY);
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = stopped.changed() => break,
            }
            let (k, t, m) = (ks.clone(), trust.clone(), me.clone());
            let plan = tokio::task::spawn_blocking(move || {
                let r = round_plan(&k, &t, &m, &mut state, gcs_protocol::now_ms());
                (r, state)
            })
            .await;
            let (plan, s) = match plan {
                Ok(x) => x,
                Err(e) => {
                    // A panic in the round: start over, nothing known.
                    tracing::warn!(error = %e, "mirror round failed");
                    state = (Skip::new(), std::collections::HashMap::new());
                    continue;
                }
            };
            state = s;
            let plan = match plan {
                Ok(p) => p,
                Err(e) => {
                    tracing::debug!(error = %e, "mirror round not planned");
                    continue;
                }
            };
            for w in plan {
                if !pull(&ks, &me, &network, w, &mut stopped).await {
                    return;
                }
            }
        }
    });
    Mirror { stop, task }
}

/// Asks each source in turn for (up to [`MAX_PULL_CHUNKS`] of) what `w`
/// lacks, and stores what comes back; `false` once the node stops.
async fn pull(
    ks: &std::sync::Arc<Keyspace>,
    me: &NodeId,
    network: &crate::network::Network,
    w: Want,
    stopped: &mut tokio::sync::watch::Receiver<bool>,
) -> bool {
    use crate::jobs::wire::{JobRequest, JobResponse};
    let inputs: Vec<String> = w.inputs.into_iter().take(MAX_PULL_CHUNKS).collect();
    let room = MAX_PULL_CHUNKS - inputs.len();
    let outputs: Vec<String> = w.outputs.into_iter().take(room).collect();
    for source in &w.sources {
        let Some(peer) = crate::jobs::peer_of(source) else { continue };
        let req = JobRequest::MirrorPull(Box::new(MirrorPull {
            version: MIRROR_VERSION,
            asker: me.clone(),
            task_id: w.task_id.clone(),
            inputs: inputs.clone(),
            outputs: outputs.clone(),
            manifest: w.manifest,
        }));
        let answer = tokio::select! {
            a = network.request(peer, req) => a,
            _ = stopped.changed() => return false,
        };
        let page = match answer {
            Ok(JobResponse::Mirror(p)) => p,
            Ok(other) => {
                tracing::debug!(%source, answer = ?std::mem::discriminant(&other), "mirror pull refused");
                continue;
            }
            Err(e) => {
                tracing::debug!(%source, error = %e, "mirror pull failed");
                continue;
            }
        };
        let (k, id) = (ks.clone(), w.task_id.clone());
        let stored = tokio::task::spawn_blocking(move || {
            let now = gcs_protocol::now_ms();
            let m = match &page.manifest {
                Some(b) => store_manifest(&k, &id, b, now)?,
                None => false,
            };
            store(&k, &id, &page, now).map(|(i, o)| (i, o, m))
        })
        .await;
        match stored {
            Ok(Ok((0, 0, false))) => continue,
            Ok(Ok((i, o, m))) => {
                tracing::info!(task_id = %w.task_id, %source, inputs = i, outputs = o, manifest = m, "task mirrored");
                return true;
            }
            Ok(Err(e)) => {
                tracing::debug!(task_id = %w.task_id, %source, error = %e, "mirror page refused")
            }
            Err(e) => tracing::warn!(task_id = %w.task_id, error = %e, "mirror page not stored"),
        }
    }
    true
}
