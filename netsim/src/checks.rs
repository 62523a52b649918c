//! Scenario checks that read what the attacks of `netsim adversary` must
//! not have changed, from the gateways' HTTP API and /metrics. Kept apart
//! from the attacks, so that the attackers and the judge of a run do not
//! import each other.

use crate::history::Check;

/// The scenario's checks of what the trust attacks must not change: each
/// gateway's description of the `models_as` names, and the `metrics` bounds.
pub fn trust(
    s: &crate::scenario::Scenario,
    cluster: &crate::cluster::Cluster,
) -> Vec<Check> {
    let mut out = vec![];
    let gateways: Vec<&String> =
        cluster.nodes.iter().filter(|(_, n)| n.role.serves_http()).map(|(name, _)| name).collect();
    for m in &s.checks.models_as {
        let mut bad = vec![];
        for g in &gateways {
            let v = cluster.get_json(g, &format!("/v1/models/{}", m.name));
            let got = v.as_ref().map(|v| {
                (
                    v["gnus"]["model_id"].as_str().unwrap_or("").to_string(),
                    v["gnus"]["context_tokens"].as_u64().unwrap_or(0),
                )
            });
            if got.as_ref() != Some(&(m.model_id.clone(), m.context_tokens)) {
                bad.push(format!("{g}: {got:?}"));
            }
        }
        let detail = if bad.is_empty() {
            format!(
                "{} is {} with {} tokens on {} gateways",
                m.name,
                m.model_id,
                m.context_tokens,
                gateways.len()
            )
        } else {
            bad.join(", ")
        };
        out.push(Check { name: "model_as", ok: bad.is_empty(), detail });
    }
    for b in &s.checks.metrics {
        let v = cluster.nodes.get(&b.node).and_then(|n| n.metric(&b.metric));
        let ok = v.is_some_and(|v| v >= b.min && v <= b.max);
        let detail = format!("{} {} = {v:?} (allowed {}..={})", b.node, b.metric, b.min, b.max);
        out.push(Check { name: "metric", ok, detail });
    }
    out
}

/// A gateway's data directory may grow this much in a scenario: RocksDB's
/// WAL and memtable flushes of honest traffic, and the quota's worth of
/// the flood — not the flood.
const MAX_DATA_DIR_BYTES: u64 = 64 << 20;

/// What the disk-fill attack must have achieved nothing against, read from
/// each honest gateway's /metrics and data directory: deltas were refused
/// by its quota, the jobs it stores are far fewer than the flood sent, and
/// its data directory stays small. `gateways`: (name, /metrics, data
/// directory bytes).
pub fn disk_fill(
    gateways: &[(String, Option<String>, u64)],
    sent: u64,
) -> Vec<Check> {
    let metric = |text: &str, name: &str| -> Option<u64> {
        text.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    if sent == 0 {
        return vec![]; // not run (the trust attacks); its absence is `adversary_injected`'s to report
    }
    gateways
        .iter()
        .map(|(name, text, disk)| {
            let text = text.as_deref().unwrap_or("");
            let refused = metric(text, "gcs_keyspace_deltas_refused_quota_total ").unwrap_or(0);
            let jobs = metric(text, "gcs_keyspace_entries{namespace=\"api.jobs\"} ").unwrap_or(u64::MAX);
            let busy = metric(text, "gcs_anti_entropy_busy_total ").unwrap_or(0);
            Check {
                name: "disk_fill_bounded",
                ok: refused > 0 && busy > 0 && jobs.saturating_mul(4) < sent && *disk < MAX_DATA_DIR_BYTES,
                detail: format!(
                    "{name}: {sent} job deltas sent, {jobs} jobs stored, {refused} refused by \
                     quota, {busy} anti-entropy requests answered busy, data dir {} KiB",
                    disk / 1024
                ),
            }
        })
        .collect()
}
