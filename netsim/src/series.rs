//! Many faulted streams in one topology: the exact-continuation proof
//! (issue 16) at a cost CI can pay. One cluster comes up; the scenario's
//! reference request is run uninterrupted once per distinct request
//! (greedy: once; seeded T=0.8: once per seed); then each faulted copy runs
//! alone: the scenario's first fault fires on its lease holder after a
//! token index drawn per stream, the topology is restored (a killed worker
//! restarted, a paused one continued, a cut healed), and the next stream
//! starts. Each stream must equal its reference byte for byte (text,
//! `finish_reason`, the usage object), end without an SSE error event and
//! pass the runner's universal checks; its fault must have fired and
//! started a continuation. A fault that landed only after the holder had
//! streamed every token (the stream ends `gnus_worker_lost` with all its
//! content: nothing is left to continue) is drawn again, earlier. The gateway's seam histogram
//! (`gcs_continuation_seam_seconds`) is read before and after each stream,
//! so the difference of its sums is that stream's seam, part by part.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::client::{self, progress, Record, Shared, Terminal};
use crate::cluster::{Cluster, ClusterOpts};
use crate::history::{Check, Entry};
use crate::runner::{self, FaultEvent};
use crate::scenario::{Action, Expect, FaultSpec, RequestSpec, Role, Scenario};
use crate::Error;

/// How many streams, and the seed every draw comes from.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// Greedy streams.
    pub greedy: u32,
    /// Seeded T=0.8 streams.
    pub seeded: u32,
    /// The base of every draw (`GCS_SEED`; printed, so a run replays).
    pub seed: u64,
}

/// One stream's draw.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Draw {
    /// Its place in the series.
    pub index: u32,
    /// The request's seed (T=0.8), or greedy.
    pub seed: Option<u64>,
    /// The fault fires once the client has this many content frames.
    pub after_tokens: u64,
}

/// splitmix64: a well-spread draw from a seed.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The streams of a plan, greedy and seeded alternating while both last
/// (a series cut short still has both kinds); each fault index in
/// 1..=max_tokens/2, so the holder is still generating when the fault
/// lands: the client sees token k some milliseconds after the worker made
/// it, and the runner fires the fault after its next poll (20 ms), while a
/// worker decodes 300 tokens a second on a fast machine.
pub fn draws(plan: &Plan, max_tokens: u32) -> Vec<Draw> {
    let span = u64::from(max_tokens / 2).max(1);
    let (mut g, mut s) = (plan.greedy, plan.seeded);
    let mut state = mix(plan.seed);
    let mut out = vec![];
    let mut index = 0;
    while g + s > 0 {
        let seeded = s > 0 && (g == 0 || index % 2 == 1);
        if seeded {
            s -= 1
        } else {
            g -= 1
        }
        state = mix(state);
        let after_tokens = 1 + state % span;
        state = mix(state);
        out.push(Draw { index, seed: seeded.then_some(state % 1_000_000), after_tokens });
        index += 1;
    }
    out
}

/// One stream's seam at the gateway, in ms (gateway clock), from the
/// difference of `gcs_continuation_seam_seconds` over the stream.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct SeamParts {
    /// The last chunk before the loss → the loss detected.
    pub detect_ms: f64,
    /// The loss → the continuation leased.
    pub claim_ms: f64,
    /// The lease → the first continued chunk forwarded.
    pub resume_ms: f64,
    /// The whole gap.
    pub total_ms: f64,
    /// Seams in the stream (1 for one fault; more if a lease also lapsed).
    pub count: u64,
}

/// One faulted stream and its verdicts.
#[derive(Clone, Debug, Serialize)]
pub struct Stream {
    /// What was drawn.
    pub draw: Draw,
    /// The fault as it fired (none: it never did, a failure).
    pub fault: Option<FaultEvent>,
    /// What the client saw, the usage record, and every check.
    pub entry: Entry,
    /// The seam's parts.
    pub seam: SeamParts,
    /// Continuations the gateway started during the stream.
    pub continuations: u64,
}

impl Stream {
    /// Every check passed.
    pub fn ok(&self) -> bool {
        self.entry.ok()
    }
}

/// A whole series.
#[derive(Clone, Debug, Serialize)]
pub struct SeriesOutcome {
    /// The scenario.
    pub scenario: String,
    /// Every faulted stream in order.
    pub streams: Vec<Stream>,
    /// Seconds, topology start to the last stream's end.
    pub seconds: f64,
    /// Why it was not run (no network namespaces here...).
    pub skipped: Option<String>,
}

impl SeriesOutcome {
    /// Every stream passed.
    pub fn ok(&self) -> bool {
        self.streams.iter().all(Stream::ok)
    }
}

/// The gateway's continuation counters and seam sums, at one moment.
#[derive(Clone, Copy, Debug, Default)]
struct GwSeams {
    started: f64,
    count: f64,
    sums: [f64; 4],
}

const PARTS: [&str; 4] = ["detect", "claim", "resume", "total"];

fn read_seams(cluster: &Cluster, gateway: &str) -> GwSeams {
    let Some(n) = cluster.nodes.get(gateway) else { return GwSeams::default() };
    let get = |name: &str| n.metric(name).unwrap_or(0.0);
    let mut g = GwSeams {
        started: get("gcs_continuations_started_total"),
        count: get("gcs_continuation_seam_seconds_count{part=\"total\"}"),
        sums: [0.0; 4],
    };
    for (sum, part) in g.sums.iter_mut().zip(PARTS) {
        *sum = get(&format!("gcs_continuation_seam_seconds_sum{{part=\"{part}\"}}"));
    }
    g
}

/// Runs the series of `s` with `plan` in `workdir`.
pub fn run(s: &Scenario, plan: &Plan, bin: &Path, workdir: &Path) -> Result<SeriesOutcome, Error> {
    let started = Instant::now();
    let s = &s.as_series();
    let outcome = |streams, skipped| SeriesOutcome {
        scenario: s.name.clone(),
        streams,
        seconds: started.elapsed().as_secs_f64(),
        skipped,
    };
    if let Some(why) = runner::cannot_run(s) {
        return Ok(outcome(vec![], Some(why)));
    }
    let setup = |m: &str| Error::Setup(format!("{}: {m}", s.name));
    let mut template =
        s.requests.iter().find(|r| r.reference).cloned().ok_or(setup("no reference request"))?;
    if let Some(m) = s.series.as_ref().and_then(|x| x.max_tokens) {
        template.max_tokens = m;
    }
    let fault = s.faults.first().cloned().ok_or(setup("no fault"))?;
    let draws = draws(plan, template.max_tokens);
    let opts = ClusterOpts { network: s.network, netsim_bin: None };
    let mut cluster = Cluster::start_with(bin, workdir, &s.node_specs(), &opts)?;
    let references = take_references(&cluster, &template, &draws, workdir)?;
    tracing::info!(scenario = %s.name, references = references.len(), secs = started.elapsed().as_secs(), "references taken");
    let mut streams = vec![];
    for d in &draws {
        if let Some(killed) = streams.last().and_then(|st: &Stream| st.fault.as_ref()) {
            if killed.action == "kill" {
                wait_restarted(&cluster, &killed.node)?;
            }
        }
        wait_idle(&cluster);
        let spec = stream_spec(&template, d);
        let reference = references.get(&d.seed).ok_or(setup("a reference is missing"))?;
        let mut st = one_stream(&mut cluster, s, &spec, &fault, d, reference)?;
        let mut draw = *d;
        // A fault that landed after the holder had streamed every token
        // tests nothing this series is about (no engine continues past
        // max_tokens; the gateway ends it with `gnus_worker_lost`, as
        // `continuation_tests` pin): drawn again, earlier, at most twice.
        for _ in 0..2 {
            if !too_late(&st, reference) {
                break;
            }
            eprintln!("{} (void: the fault landed after the last token; drawn again)", line(&st));
            if let Some(f) = st.fault.as_ref().filter(|f| f.action == "kill") {
                wait_restarted(&cluster, &f.node)?;
            }
            wait_idle(&cluster);
            draw.after_tokens = (draw.after_tokens / 2).max(1);
            st = one_stream(&mut cluster, s, &spec, &fault, &draw, reference)?;
        }
        eprintln!("{}", line(&st));
        streams.push(st);
    }
    Ok(outcome(streams, None))
}

/// The request of one stream: the template, greedy or with its seed.
fn stream_spec(template: &RequestSpec, d: &Draw) -> RequestSpec {
    let mut spec = template.clone();
    (spec.temperature, spec.seed) = match d.seed {
        Some(seed) => (Some(0.8), Some(seed)),
        None => (None, None),
    };
    spec.expect = Expect::Complete;
    spec.reference = true;
    spec
}

/// The uninterrupted answer of every distinct request of the series, a
/// worker's worth at a time (more would wait past the queue timeout).
fn take_references(
    cluster: &Cluster,
    template: &RequestSpec,
    draws: &[Draw],
    workdir: &Path,
) -> Result<BTreeMap<Option<u64>, Record>, Error> {
    let (gw, key) = runner::endpoint(cluster, &cluster.reference_keys, &template.gateway)?;
    let mut wanted: Vec<Option<u64>> = draws.iter().map(|d| d.seed).collect();
    wanted.sort_unstable();
    wanted.dedup();
    let at_once = cluster
        .nodes
        .values()
        .filter(|n| matches!(n.role, Role::All | Role::Worker))
        .count()
        .max(1);
    let mut out = BTreeMap::new();
    for wave in wanted.chunks(at_once) {
        let handles: Vec<_> = wave
            .iter()
            .map(|seed| {
                let req = runner::chat_request(&stream_spec(
                    template,
                    &Draw { index: 0, seed: *seed, after_tokens: 0 },
                ));
                let key = key.clone();
                let seed = *seed;
                std::thread::spawn(move || {
                    (seed, client::chat(gw, &key, &req, &Shared::default(), &|| false))
                })
            })
            .collect();
        for h in handles {
            let (seed, rec) =
                h.join().map_err(|_| Error::Setup("a reference client panicked".into()))?;
            if rec.terminal != Terminal::Complete {
                let why = rec.error.map(|e| e.to_string()).unwrap_or_default();
                return Err(Error::Setup(format!(
                    "reference run (seed {seed:?}) ended {:?} {why}; logs in {}",
                    rec.terminal,
                    workdir.display()
                )));
            }
            out.insert(seed, rec);
        }
    }
    Ok(out)
}

/// Until no worker runs a job (a restarting one counts as idle), at most
/// 30 s: each stream must find the holder it faults by its busy gauge.
fn wait_idle(cluster: &Cluster) {
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until
        && cluster.nodes.values().any(|n| n.role == Role::All && n.active_jobs().unwrap_or(0) > 0)
    {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Until a killed worker started again is healthy (models loaded, its
/// registration published) and a gossip heartbeat (1 s) has carried that
/// registration to the gateway.
fn wait_restarted(cluster: &Cluster, node: &str) -> Result<(), Error> {
    let n = cluster.nodes.get(node).ok_or_else(|| Error::Setup(format!("no node {node}")))?;
    n.wait_healthy(Duration::from_secs(60))?;
    std::thread::sleep(Duration::from_millis(1500));
    Ok(())
}

/// A faulted holder's `cancelled` ends so far (its /metrics).
fn cancelled_ends(cluster: &Cluster, node: &str) -> Option<f64> {
    let n = cluster.nodes.get(node)?;
    Some(n.metric("gcs_worker_jobs_ended_total{termination=\"cancelled\"}").unwrap_or(0.0))
}

/// The fault of one stream as it played: what fired, and when its hold ends.
struct Played {
    event: Option<FaultEvent>,
    hold_until: Option<Instant>,
    resumed_at: Option<Instant>,
    cancelled_before: Option<f64>,
}

/// Fires `f` on the lease holder of the watched stream; like the runner's
/// faults, the holder is frozen before the client's progress is read.
fn fire(
    cluster: &mut Cluster,
    f: &FaultSpec,
    watched: &Shared,
    t0: Instant,
) -> Result<Played, Error> {
    let mut p = Played { event: None, hold_until: None, resumed_at: None, cancelled_before: None };
    let Some(node) = runner::lease_holder(cluster, Some(watched)) else { return Ok(p) };
    p.cancelled_before = cancelled_ends(cluster, &node);
    match f.action {
        Action::Isolate => {
            let others: Vec<String> =
                cluster.nodes.keys().filter(|n| **n != node).cloned().collect();
            cluster.cut(std::slice::from_ref(&node), &others, false)?;
        }
        Action::Kill | Action::Pause => cluster.node(&node)?.signal("STOP")?,
        other => return Err(Error::Scenario(format!("a series cannot play {other:?}"))),
    }
    std::thread::sleep(Duration::from_millis(50));
    let frames_at_fault = Some(progress(watched).content_frames);
    if f.action == Action::Kill {
        cluster.node(&node)?.kill();
    } else {
        p.hold_until = Some(Instant::now() + Duration::from_millis(f.hold_ms));
    }
    let at_ms = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);
    let action = format!("{:?}", f.action).to_lowercase();
    p.event = Some(FaultEvent { at_ms, action, node, frames_at_fault, subtask: None });
    Ok(p)
}

/// Ends a pause (SIGCONT) or a cut (heal).
fn end_hold(cluster: &mut Cluster, f: &FaultSpec, node: &str) -> Result<(), Error> {
    match f.action {
        Action::Pause => cluster.node(node)?.signal("CONT"),
        Action::Isolate => {
            let others: Vec<String> =
                cluster.nodes.keys().filter(|n| n.as_str() != node).cloned().collect();
            cluster.cut(&[node.to_string()], &others, true)
        }
        _ => Ok(()),
    }
}

fn one_stream(
    cluster: &mut Cluster,
    s: &Scenario,
    spec: &RequestSpec,
    fault: &FaultSpec,
    d: &Draw,
    reference: &Record,
) -> Result<Stream, Error> {
    let (gw, key) = runner::endpoint(cluster, &cluster.keys, &spec.gateway)?;
    let before = read_seams(cluster, &spec.gateway);
    let shared = Shared::default();
    let req = runner::chat_request(spec);
    let handle = {
        let (key, shared) = (key.clone(), shared.clone());
        std::thread::spawn(move || client::chat(gw, &key, &req, &shared, &|| false))
    };
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(spec.timeout_s + 30);
    let mut played: Option<Played> = None;
    loop {
        let p = progress(&shared).clone();
        if played.as_ref().is_none_or(|p| p.event.is_none())
            && p.accepted
            && !p.ended
            && p.content_frames >= d.after_tokens
        {
            played = Some(fire(cluster, fault, &shared, t0)?);
        }
        if let Some(pl) = played.as_mut() {
            if pl.hold_until.is_some_and(|t| Instant::now() >= t) {
                let node = pl.event.as_ref().map(|e| e.node.clone()).unwrap_or_default();
                end_hold(cluster, fault, &node)?;
                (pl.hold_until, pl.resumed_at) = (None, Some(Instant::now()));
            }
        }
        let holding = played.as_ref().is_some_and(|p| p.hold_until.is_some());
        if (p.ended && !holding) || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let record = handle.join().unwrap_or_else(|_| Record::lost("client thread panicked"));
    let mut entry = Entry {
        group: format!("{}-{}", if d.seed.is_some() { "seeded" } else { "greedy" }, d.index),
        index: d.index,
        record,
        usage: None,
        gateway_died: false,
        checks: vec![],
        notes: vec![],
    };
    entry.usage = wait_usage(gw, &key, entry.record.job_id.as_deref(), s.limits.usage_wait_s);
    entry.judge(spec, Some(reference.content.as_str()));
    entry.checks.push(same_ending(&entry.record, reference));
    let played = played.unwrap_or(Played {
        event: None,
        hold_until: None,
        resumed_at: None,
        cancelled_before: None,
    });
    entry.checks.push(Check {
        name: "fault_fired",
        ok: played.event.is_some(),
        detail: played.event.as_ref().map_or("never fired".into(), |e| {
            format!("{} {} at {} frames", e.action, e.node, e.frames_at_fault.unwrap_or(0))
        }),
    });
    let after = read_seams(cluster, &spec.gateway);
    let seam = seam_delta(&before, &after);
    let continuations = (after.started - before.started).max(0.0) as u64;
    entry.checks.push(Check {
        name: "continued",
        ok: continuations >= 1 && seam.count >= 1,
        detail: format!("{continuations} continuation(s), {} seam(s) timed", seam.count),
    });
    if let (Some(ev), Some(at)) = (&played.event, played.resumed_at) {
        entry.checks.push(holder_stopped(cluster, &ev.node, played.cancelled_before, at));
    }
    if let Some(ev) = played.event.as_ref().filter(|e| e.action == "kill") {
        // Back on the same ports, data and identity: the next stream waits
        // for it (`wait_restarted`), since an 80-token stream is shorter than
        // a worker's start, and two kills in a row would otherwise leave a
        // three-worker topology no one to continue on.
        let bin = cluster.bin.clone();
        cluster.node(&ev.node)?.spawn(&bin)?;
    }
    Ok(Stream { draw: *d, fault: played.event, entry, seam, continuations })
}

fn wait_usage(
    gw: std::net::SocketAddr,
    key: &str,
    job: Option<&str>,
    wait_s: u64,
) -> Option<serde_json::Value> {
    let job = job?;
    let until = Instant::now() + Duration::from_secs(wait_s);
    loop {
        if let Some(u) = runner::usage_of(gw, key, job) {
            return Some(u);
        }
        if Instant::now() > until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The usage object without `prompt_tokens_details.cached_tokens`: how
/// much of the prompt a worker's prefix cache held is its own state (the
/// reference ran under another tenant, whose cache is salted apart), not
/// part of the answer.
fn billed(usage: Option<&serde_json::Value>) -> Option<serde_json::Value> {
    let mut u = usage?.clone();
    if let Some(d) = u.get_mut("prompt_tokens_details").and_then(|d| d.as_object_mut()) {
        d.remove("cached_tokens");
    }
    Some(u)
}

/// Beyond the text (the runner's `reference` check): the same finish
/// reason and the same usage object (bar cached tokens) as the
/// uninterrupted run.
/// Whether a failed stream's fault came after its holder had streamed
/// every token: all of the reference's content arrived, no continuation
/// started, and the stream ended with `gnus_worker_lost`.
fn too_late(st: &Stream, reference: &Record) -> bool {
    let r = &st.entry.record;
    let code = r.error.as_ref().and_then(|e| e.get("code")).and_then(|c| c.as_str());
    !st.ok()
        && st.fault.is_some()
        && st.continuations == 0
        && r.content == reference.content
        && code == Some("gnus_worker_lost")
}

fn same_ending(got: &Record, reference: &Record) -> Check {
    let ok = got.finish_reason == reference.finish_reason
        && got.usage.is_some()
        && billed(got.usage.as_ref()) == billed(reference.usage.as_ref());
    let show = |r: &Record| {
        format!(
            "{:?} {}",
            r.finish_reason,
            r.usage.as_ref().map(|u| u.to_string()).unwrap_or_default()
        )
    };
    let detail =
        if ok { show(got) } else { format!("got {}, reference {}", show(got), show(reference)) };
    Check { name: "same_ending", ok, detail }
}

fn seam_delta(before: &GwSeams, after: &GwSeams) -> SeamParts {
    let ms = |i: usize| ((after.sums[i] - before.sums[i]) * 1000.0).max(0.0);
    SeamParts {
        detect_ms: ms(0),
        claim_ms: ms(1),
        resume_ms: ms(2),
        total_ms: ms(3),
        count: (after.count - before.count).max(0.0) as u64,
    }
}

/// The paused (or cut-off) holder, running again, heard the signed
/// cancellation of its revoked lease (or had its next chunk refused) and
/// stopped: its running-jobs gauge back to 0 and one more job ended
/// `cancelled`, not run to its end for nobody.
fn holder_stopped(cluster: &Cluster, node: &str, before: Option<f64>, resumed: Instant) -> Check {
    let name = "holder_stopped";
    let Some(before) = before else {
        return Check { name, ok: false, detail: format!("{node}: no /metrics before the fault") };
    };
    let until = resumed + Duration::from_secs(15);
    loop {
        let idle = cluster.nodes.get(node).and_then(|n| n.active_jobs()) == Some(0);
        let now = cancelled_ends(cluster, node).unwrap_or(before);
        if idle && now > before {
            let ms = resumed.elapsed().as_millis();
            let detail = format!(
                "{node}: idle and {} more cancelled end {ms} ms after it ran again",
                now - before
            );
            return Check { name, ok: true, detail };
        }
        if Instant::now() > until {
            let detail = format!(
                "{node}: 15 s after it ran again idle={idle}, cancelled ends {before} -> {now}"
            );
            return Check { name, ok: false, detail };
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One stream's line on stderr.
pub fn line(st: &Stream) -> String {
    let e = &st.entry;
    let verdict = if st.ok() { "ok" } else { "FAIL" };
    let mut l = format!(
        "  {:<12} {verdict:<4} after {:>3} tokens, {} frames, {:?}; seam detect {:.0} + claim {:.0} + resume {:.0} = {:.0} ms, client gap {} ms",
        e.group,
        st.draw.after_tokens,
        e.record.content_frames,
        e.record.terminal,
        st.seam.detect_ms,
        st.seam.claim_ms,
        st.seam.resume_ms,
        st.seam.total_ms,
        e.record.max_gap_ms
    );
    for c in &e.checks {
        if !c.ok || c.name == "holder_stopped" {
            l.push_str(&format!(
                "\n      {} {}: {}",
                c.name,
                if c.ok { "ok" } else { "FAIL" },
                c.detail
            ));
        }
    }
    l
}

fn pct(mut v: Vec<f64>, p: usize) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get((v.len() * p / 100).min(v.len().saturating_sub(1))).copied().unwrap_or(0.0)
}

/// The summary: equal streams per kind, faults fired, and p50/p99 of the
/// seam's parts (streams with exactly one seam) and of the client's gap.
pub fn summary(o: &SeriesOutcome) -> String {
    if let Some(why) = &o.skipped {
        return format!("series {} — SKIPPED: {why}\n", o.scenario);
    }
    let count = |seeded: bool| {
        let of: Vec<&Stream> =
            o.streams.iter().filter(|s| s.draw.seed.is_some() == seeded).collect();
        (of.iter().filter(|s| s.ok()).count(), of.len())
    };
    let ((g, gn), (sd, sn)) = (count(false), count(true));
    let fired = o.streams.iter().filter(|s| s.fault.is_some()).count();
    let mut t = format!(
        "series {} — {} in {:.1}s: greedy {g}/{gn} equal, seeded {sd}/{sn} equal, faults fired {fired}/{}\n",
        o.scenario,
        if o.ok() { "PASS" } else { "FAIL" },
        o.seconds,
        o.streams.len()
    );
    let single: Vec<&SeamParts> =
        o.streams.iter().map(|s| &s.seam).filter(|s| s.count == 1).collect();
    let parts: [(&str, fn(&SeamParts) -> f64); 4] = [
        ("detect", |s| s.detect_ms),
        ("claim", |s| s.claim_ms),
        ("resume", |s| s.resume_ms),
        ("total", |s| s.total_ms),
    ];
    for (name, get) in parts {
        let v: Vec<f64> = single.iter().map(|s| get(s)).collect();
        t.push_str(&format!(
            "  seam {name:<7} p50 {:>6.0} ms  p99 {:>6.0} ms  ({} streams)\n",
            pct(v.clone(), 50),
            pct(v, 99),
            single.len()
        ));
    }
    let gaps: Vec<f64> = o.streams.iter().map(|s| s.entry.record.max_gap_ms as f64).collect();
    t.push_str(&format!(
        "  client gap   p50 {:>6.0} ms  p99 {:>6.0} ms\n",
        pct(gaps.clone(), 50),
        pct(gaps, 99)
    ));
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_alternate_kinds_replay_from_the_seed_and_stay_in_range() {
        let plan = Plan { greedy: 20, seeded: 20, seed: 42 };
        let d = draws(&plan, 40);
        assert_eq!(d.len(), 40);
        assert_eq!(d.iter().filter(|x| x.seed.is_none()).count(), 20);
        assert!(d.iter().all(|x| (1..=20).contains(&x.after_tokens)), "{d:?}");
        assert!(d[..6].iter().step_by(2).all(|x| x.seed.is_none()));
        assert!(d[1..6].iter().step_by(2).all(|x| x.seed.is_some()));
        let again = draws(&plan, 40);
        assert!(d
            .iter()
            .zip(&again)
            .all(|(a, b)| (a.seed, a.after_tokens) == (b.seed, b.after_tokens)));
        let other = draws(&Plan { seed: 43, ..plan }, 40);
        assert!(d
            .iter()
            .zip(&other)
            .any(|(a, b)| (a.seed, a.after_tokens) != (b.seed, b.after_tokens)));
        let spread: std::collections::BTreeSet<u64> = d.iter().map(|x| x.after_tokens).collect();
        assert!(spread.len() > 8, "fault points spread out: {spread:?}");
        let uneven = draws(&Plan { greedy: 1, seeded: 3, seed: 1 }, 40);
        assert_eq!(uneven.iter().filter(|x| x.seed.is_some()).count(), 3);
    }

    #[test]
    fn a_series_plays_with_its_own_lease_and_hold() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
        let s = Scenario::load(&dir.join("worker_pause_past_lease_continues.toml")).unwrap();
        assert_eq!((s.lease_ms, s.faults[0].hold_ms), (None, 15_000));
        let x = s.as_series();
        assert_eq!((x.lease_ms, x.faults[0].hold_ms), (Some(2_000), 3_500));
        assert!(x.node_specs().iter().filter(|n| n.role.serves_http()).all(|n| n
            .args
            .windows(2)
            .any(|w| w == ["--lease-ms", "2000"])));
        let crash = Scenario::load(&dir.join("worker_crash_mid_stream_continues.toml")).unwrap();
        assert_eq!(crash.as_series().lease_ms, crash.lease_ms);
    }

    #[test]
    fn the_seam_is_the_difference_of_the_gateways_sums() {
        let before = GwSeams { started: 2.0, count: 2.0, sums: [1.0, 0.5, 0.25, 1.75] };
        let after = GwSeams { started: 3.0, count: 3.0, sums: [3.0, 0.6, 0.45, 4.05] };
        let s = seam_delta(&before, &after);
        assert_eq!(s.count, 1);
        assert!((s.detect_ms - 2000.0).abs() < 1e-6 && (s.claim_ms - 100.0).abs() < 1e-6);
        assert!((s.resume_ms - 200.0).abs() < 1e-6 && (s.total_ms - 2300.0).abs() < 1e-6);
    }

    #[test]
    fn only_a_fault_after_every_token_is_drawn_again() {
        let mut reference = Record::lost("");
        reference.content = "all eighty tokens".into();
        let mut got = reference.clone();
        got.error = Some(serde_json::json!({"code": "gnus_worker_lost"}));
        let fault = FaultEvent {
            at_ms: 369,
            action: "isolate".into(),
            node: "w1".into(),
            frames_at_fault: Some(80),
            subtask: None,
        };
        let entry = Entry {
            group: "seeded-17".into(),
            index: 17,
            record: got,
            usage: None,
            gateway_died: false,
            checks: vec![Check { name: "continued", ok: false, detail: String::new() }],
            notes: vec![],
        };
        let st = Stream {
            draw: Draw { index: 17, seed: Some(1), after_tokens: 34 },
            fault: Some(fault),
            entry,
            seam: SeamParts::default(),
            continuations: 0,
        };
        assert!(too_late(&st, &reference));
        let mut short = st.clone();
        short.entry.record.content = "all eighty".into();
        assert!(!too_late(&short, &reference), "a stream cut short is a failure, not a void draw");
        let mut continued = st.clone();
        continued.continuations = 1;
        assert!(!too_late(&continued, &reference));
        let mut other = st.clone();
        other.entry.record.error = Some(serde_json::json!({"code": "gnus_stream_broken"}));
        assert!(!too_late(&other, &reference));
        let mut passed = st.clone();
        passed.entry.checks[0].ok = true;
        assert!(!too_late(&passed, &reference));
    }

    #[test]
    fn a_different_finish_or_usage_is_not_the_same_ending() {
        let mut a = Record::lost("");
        a.finish_reason = Some("length".into());
        a.usage = Some(serde_json::json!({"completion_tokens": 40, "prompt_tokens": 20}));
        let b = a.clone();
        assert!(same_ending(&a, &b).ok);
        let mut c = a.clone();
        c.usage = Some(serde_json::json!({"completion_tokens": 41, "prompt_tokens": 20}));
        assert!(!same_ending(&c, &b).ok);
        // A prefix-cache hit is the worker's state, not the answer.
        let mut hit = a.clone();
        hit.usage = Some(serde_json::json!({"completion_tokens": 40, "prompt_tokens": 20,
            "prompt_tokens_details": {"cached_tokens": 16}}));
        let mut cold = a.clone();
        cold.usage = Some(serde_json::json!({"completion_tokens": 40, "prompt_tokens": 20,
            "prompt_tokens_details": {"cached_tokens": 0}}));
        assert!(same_ending(&hit, &cold).ok);
        c.usage = None;
        assert!(!same_ending(&c, &b).ok, "no usage chunk is not the same ending");
        let mut d = a.clone();
        d.finish_reason = Some("stop".into());
        assert!(!same_ending(&d, &b).ok);
    }
}
