//! Runs a scenario: bring the topology up, take reference answers, start
//! the clients, fire the faults on their triggers, collect usage records,
//! and judge the history.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use crate::client::{self, progress, ChatRequest, Record, Shared, Terminal};
use crate::cluster::{Cluster, ClusterOpts};
use crate::history::Entry;
use crate::scenario::{Action, FaultSpec, NetworkMode, RequestSpec, Role, Scenario};
use crate::Error;

/// A fault as it happened.
#[derive(Clone, Debug, Serialize)]
pub struct FaultEvent {
    /// Milliseconds after traffic start.
    pub at_ms: u64,
    /// What.
    pub action: String,
    /// Resolved node.
    pub node: String,
    /// Content frames the triggering request had received when the node
    /// was frozen (for `after_tokens` triggers).
    pub frames_at_fault: Option<u64>,
}

/// The outcome of a scenario.
#[derive(Clone, Debug, Serialize)]
pub struct Outcome {
    /// Scenario name.
    pub scenario: String,
    /// Every request.
    pub entries: Vec<Entry>,
    /// Faults fired.
    pub faults: Vec<FaultEvent>,
    /// Faults that never fired (their trigger never came).
    pub unfired: Vec<String>,
    /// Peak RSS growth over the run's start, per HTTP node, in MiB.
    pub rss_growth_mib: BTreeMap<String, f64>,
    /// Run-level checks (faults fired, RSS bounded).
    pub run_checks: Vec<crate::history::Check>,
    /// Seconds the run took.
    pub seconds: f64,
    /// Why the scenario was not run (e.g. no network namespaces here).
    pub skipped: Option<String>,
}

impl Outcome {
    /// Every check passed (a skipped scenario passes nothing and fails
    /// nothing; the table and the JSON report say SKIPPED and why).
    pub fn ok(&self) -> bool {
        self.entries.iter().all(Entry::ok) && self.run_checks.iter().all(|c| c.ok)
    }

    fn skipped(s: &Scenario, why: String) -> Outcome {
        tracing::warn!(scenario = %s.name, reason = %why, "SKIPPED");
        Outcome {
            scenario: s.name.clone(),
            entries: vec![],
            faults: vec![],
            unfired: vec![],
            rss_growth_mib: BTreeMap::new(),
            run_checks: vec![],
            seconds: 0.0,
            skipped: Some(why),
        }
    }
}

/// Why this machine cannot run the scenario, if it cannot.
pub fn cannot_run(s: &Scenario) -> Option<String> {
    if s.network == NetworkMode::Netns {
        if let Err(e) = crate::netns::Netns::probe() {
            return Some(format!("needs network namespaces (root and iproute2): {e}"));
        }
    }
    if s.nodes.iter().any(|n| n.clock_skew_s.is_some()) && crate::cluster::faketime_lib().is_none()
    {
        return Some("needs libfaketime (apt-get install libfaketime)".into());
    }
    None
}

fn chat_request(s: &RequestSpec) -> ChatRequest {
    let filler = "word ".repeat(s.filler_words as usize);
    ChatRequest {
        prompt: format!("{filler}{}", s.prompt),
        max_tokens: s.max_tokens,
        stream: s.stream,
        ban_eos: s.ban_eos,
        include_usage: s.include_usage,
        read_bytes_per_s: s.read_bytes_per_s,
        rcvbuf: s.rcvbuf,
        vanish_after_frames: s.vanish_after_frames,
        timeout: Duration::from_secs(s.timeout_s),
    }
}

/// The usage record of one job on a gateway, if written yet.
pub fn usage_of(addr: SocketAddr, key: &str, job: &str) -> Option<Value> {
    let (status, v) = client::request_json(addr, "GET", "/v1/usage?limit=1000", key, b"").ok()?;
    if status != 200 {
        return None;
    }
    v["data"].as_array()?.iter().find(|u| u["job_id"].as_str() == Some(job)).cloned()
}

struct Running {
    group: usize,
    index: u32,
    shared: Shared,
    handle: JoinHandle<Record>,
}

struct PendingFault {
    spec: FaultSpec,
    fired: bool,
    resume_at: Option<(Instant, String)>,
}

type Views = Vec<(String, BTreeMap<String, (String, u64)>)>;

/// Every running HTTP node's digests of the namespaces `want`.
fn digest_views(cluster: &Cluster, want: &[String]) -> Views {
    cluster
        .nodes
        .values()
        .filter(|n| n.role.serves_http() && n.pid().is_some())
        .filter_map(|n| {
            let d = n.keyspace_digests()?;
            Some((n.name.clone(), d.into_iter().filter(|(k, _)| want.contains(k)).collect()))
        })
        .collect()
}

/// The GCS node id of the node whose data directory is `dir`.
fn node_id_of(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("identity.key")).ok()?;
    let bytes: Vec<u8> = (0..text.trim().len())
        .step_by(2)
        .filter_map(|i| u8::from_str_radix(text.trim().get(i..i + 2)?, 16).ok())
        .collect();
    let seed: [u8; 32] = bytes.try_into().ok()?;
    Some(gcs_protocol::NodeKey::from_seed(seed).node_id().as_str().to_string())
}

/// Every log a node wrote (all its starts).
fn node_logs(dir: &Path) -> String {
    let mut out = String::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with("node.") && name.ends_with(".log") {
            out.push_str(&std::fs::read_to_string(e.path()).unwrap_or_default());
        }
    }
    out
}

/// The model ids a gateway lists.
fn model_ids(c: &Cluster, node: &str) -> Option<Vec<String>> {
    let v = c.get_json(node, "/v1/models")?;
    Some(
        v["data"].as_array()?.iter().filter_map(|m| m["id"].as_str().map(str::to_string)).collect(),
    )
}

/// Runs one scenario in `workdir` with the given binary.
pub fn run(s: &Scenario, bin: &Path, workdir: &Path) -> Result<Outcome, Error> {
    let started = Instant::now();
    if let Some(why) = cannot_run(s) {
        return Ok(Outcome::skipped(s, why));
    }
    tracing::info!(scenario = %s.name, "starting the topology");
    let opts = ClusterOpts { network: s.network, netsim_bin: None };
    let mut cluster = Cluster::start_with(bin, workdir, &s.nodes, &opts)?;
    let addr = |c: &Cluster, n: &str| c.nodes.get(n).map(|x| x.http);
    let mut references = BTreeMap::new();
    for r in s.requests.iter().filter(|r| r.reference) {
        let gw = addr(&cluster, &r.gateway).ok_or_else(|| Error::Setup(r.gateway.clone()))?;
        let key = cluster.reference_keys.get(&r.gateway).cloned().unwrap_or_default();
        let mut req = chat_request(r);
        req.read_bytes_per_s = None;
        req.vanish_after_frames = None;
        let rec = client::chat(gw, &key, &req, &Shared::default(), &|| false);
        if rec.terminal != Terminal::Complete {
            let why = rec.error.map(|e| e.to_string()).unwrap_or_default();
            return Err(Error::Setup(format!(
                "reference run of {} ended {:?} {why}; logs in {}",
                r.name,
                rec.terminal,
                workdir.display()
            )));
        }
        tracing::info!(group = %r.name, chars = rec.content.len(), "reference answer taken");
        references.insert(r.name.clone(), rec.content);
    }
    // Let the reference jobs' slots free before the traffic: a worker still
    // busy when a job is announced backlogs it, and its late claim can race
    // the requeue the scenario means to test (see README, known issues).
    let settle = Instant::now() + Duration::from_secs(10);
    while Instant::now() < settle
        && cluster.nodes.values().any(|n| n.role == Role::All && n.active_jobs().unwrap_or(0) > 0)
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    if !references.is_empty() {
        std::thread::sleep(Duration::from_millis(1000));
    }
    // Adversaries join now, after the reference answers: they must not be
    // the ones that produce them. They register like workers.
    let adversaries = cluster.start_pending()?;
    if adversaries > 0 {
        let workers = s
            .nodes
            .iter()
            .filter(|n| matches!(n.role, Role::Worker | Role::All) && n.registers)
            .count();
        cluster.wait_registrations(workers + adversaries)?;
        std::thread::sleep(Duration::from_millis(1000));
    }
    let http_nodes: Vec<String> =
        cluster.nodes.values().filter(|n| n.role.serves_http()).map(|n| n.name.clone()).collect();
    let base_rss: BTreeMap<String, u64> = http_nodes
        .iter()
        .filter_map(|n| Some((n.clone(), cluster.nodes.get(n)?.rss_kib()?)))
        .collect();
    let mut peak_rss = base_rss.clone();

    // Clients.
    let t0 = Instant::now();
    let mut running = vec![];
    for (gi, r) in s.requests.iter().enumerate() {
        let gw = addr(&cluster, &r.gateway).ok_or_else(|| Error::Setup(r.gateway.clone()))?;
        let key = cluster.keys.get(&r.gateway).cloned().unwrap_or_default();
        for i in 0..r.count {
            let shared = Shared::default();
            let (req, key2, sh) = (chat_request(r), key.clone(), shared.clone());
            let delay = Duration::from_millis(r.start_ms + u64::from(i) * r.spacing_ms);
            let handle = std::thread::spawn(move || {
                std::thread::sleep(delay);
                // A slow client stops reading once its job has a usage
                // record: the gateway has given up on it by then.
                let give_up = || {
                    let job = progress(&sh).job_id.clone();
                    job.is_some_and(|j| usage_of(gw, &key2, &j).is_some())
                };
                client::chat(gw, &key2, &req, &sh, &give_up)
            });
            running.push(Running { group: gi, index: i, shared, handle });
        }
    }

    // Faults.
    let mut faults: Vec<PendingFault> = s
        .faults
        .iter()
        .map(|f| PendingFault { spec: f.clone(), fired: false, resume_at: None })
        .collect();
    let mut events = vec![];
    let mut died: Vec<(String, Instant)> = vec![];
    // The digests just before a partition heals (they must differ).
    let mut at_heal: Option<Views> = None;
    let hard_stop =
        t0 + Duration::from_secs(s.requests.iter().map(|r| r.timeout_s).max().unwrap_or(60) + 60);
    loop {
        let all_done = running.iter().all(|r| progress(&r.shared).ended);
        let resumes_left = faults.iter().any(|f| f.resume_at.is_some());
        if (all_done && !resumes_left) || Instant::now() > hard_stop {
            break;
        }
        for f in faults.iter_mut() {
            if let Some((when, node)) = f.resume_at.clone() {
                if Instant::now() >= when {
                    if f.spec.action == Action::Partition && !s.checks.converge.is_empty() {
                        at_heal = Some(digest_views(&cluster, &s.checks.converge));
                    }
                    resume(&mut cluster, &f.spec, &node)?;
                    f.resume_at = None;
                }
            }
            if f.fired {
                continue;
            }
            let Some(ev) = try_fire(&mut cluster, &f.spec, s, &running, t0)? else { continue };
            f.fired = true;
            let heals =
                !matches!(f.spec.action, Action::Isolate | Action::Partition) || f.spec.hold_ms > 0;
            if f.spec.action != Action::Kill && heals {
                let when = Instant::now() + Duration::from_millis(f.spec.hold_ms);
                f.resume_at = Some((when, ev.node.clone()));
            }
            if matches!(f.spec.action, Action::Kill | Action::Restart) {
                died.push((ev.node.clone(), Instant::now()));
            }
            tracing::info!(action = %ev.action, node = %ev.node, at_ms = ev.at_ms, "fault");
            events.push(ev);
        }
        for n in &http_nodes {
            if let Some(kib) = cluster.nodes.get(n).and_then(|x| x.rss_kib()) {
                let p = peak_rss.entry(n.clone()).or_insert(kib);
                *p = (*p).max(kib);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for f in faults.iter_mut() {
        if let Some((_, node)) = f.resume_at.take() {
            if f.spec.action == Action::Partition && !s.checks.converge.is_empty() {
                at_heal = Some(digest_views(&cluster, &s.checks.converge));
            }
            resume(&mut cluster, &f.spec, &node)?;
        }
    }
    let traffic_end = Instant::now();

    // History.
    let mut entries = vec![];
    for r in running {
        let spec = &s.requests[r.group];
        let record = r.handle.join().unwrap_or_else(|_| Record::lost("client thread panicked"));
        let gateway_died = died.iter().any(|(n, _)| n == &spec.gateway);
        entries.push(Entry {
            group: spec.name.clone(),
            index: r.index,
            record,
            usage: None,
            gateway_died,
            checks: vec![],
            notes: vec![],
        });
    }
    let deadline = Instant::now() + Duration::from_secs(s.limits.usage_wait_s);
    // A record still waiting for the cut-off worker's late metering.
    let unmetered = |e: &Entry| {
        let late = s.requests.iter().any(|r| r.name == e.group && r.expect_late_metering);
        late && e.usage.as_ref().is_some_and(|u| {
            u["output_tokens_generated"].as_u64().unwrap_or(0)
                <= u["output_tokens_sent_to_client"].as_u64().unwrap_or(0)
        })
    };
    loop {
        let mut missing = 0;
        for e in entries
            .iter_mut()
            .filter(|e| (e.usage.is_none() || unmetered(e)) && e.record.status == 200)
        {
            let spec = s.requests.iter().find(|r| r.name == e.group);
            let (Some(spec), Some(job)) = (spec, e.record.job_id.clone()) else { continue };
            let gw =
                addr(&cluster, &spec.gateway).ok_or_else(|| Error::Setup(spec.gateway.clone()))?;
            let key = cluster.keys.get(&spec.gateway).cloned().unwrap_or_default();
            e.usage = usage_of(gw, &key, &job);
            missing += usize::from(e.usage.is_none() || unmetered(e));
        }
        if missing == 0 || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    for e in &mut entries {
        if let Some(spec) = s.requests.iter().find(|r| r.name == e.group) {
            e.judge(spec, references.get(&e.group).map(String::as_str));
        }
    }

    let mut run_checks = cluster_checks(s, &cluster, traffic_end, &entries);
    if let Some(v) = at_heal {
        let differ = v.windows(2).any(|w| w[0].1 != w[1].1);
        let detail: Vec<String> = v
            .iter()
            .map(|(n, m)| {
                let per: Vec<String> = m.iter().map(|(ns, (_, c))| format!("{ns}={c}")).collect();
                format!("{n}: {}", per.join(" "))
            })
            .collect();
        run_checks.push(crate::history::Check {
            name: "diverged",
            ok: differ,
            detail: format!("at the heal: {}", detail.join("; ")),
        });
    }
    let unfired: Vec<String> = faults
        .iter()
        .filter(|f| !f.fired)
        .map(|f| format!("{:?} {}", f.spec.action, f.spec.target))
        .collect();
    run_checks.push(crate::history::Check {
        name: "faults_fired",
        ok: unfired.is_empty(),
        detail: format!("{} fired, {} never triggered", events.len(), unfired.len()),
    });
    let rss_growth_mib: BTreeMap<String, f64> = peak_rss
        .iter()
        .map(|(n, p)| {
            (n.clone(), p.saturating_sub(base_rss.get(n).copied().unwrap_or(*p)) as f64 / 1024.0)
        })
        .collect();
    let worst = rss_growth_mib.values().copied().fold(0.0, f64::max);
    run_checks.push(crate::history::Check {
        name: "gateway_rss",
        ok: worst <= s.limits.max_gateway_rss_growth_mib as f64,
        detail: format!(
            "peak growth {worst:.1} MiB (limit {})",
            s.limits.max_gateway_rss_growth_mib
        ),
    });
    drop(cluster);
    Ok(Outcome {
        scenario: s.name.clone(),
        entries,
        faults: events,
        unfired,
        rss_growth_mib,
        run_checks,
        seconds: started.elapsed().as_secs_f64(),
        skipped: None,
    })
}

/// The scenario's cluster-wide checks: keyspace convergence, the models the
/// gateways list, and what the adversaries managed to inject.
fn cluster_checks(
    s: &Scenario,
    cluster: &Cluster,
    traffic_end: Instant,
    entries: &[Entry],
) -> Vec<crate::history::Check> {
    use crate::history::Check;
    let mut out = vec![];
    let http: Vec<&str> = cluster
        .nodes
        .values()
        .filter(|n| n.role.serves_http() && n.pid().is_some())
        .map(|n| n.name.as_str())
        .collect();
    let want = &s.checks.converge;
    if !want.is_empty() {
        let deadline = traffic_end + Duration::from_secs(s.checks.converge_within_s);
        let mut detail;
        let ok = loop {
            let views = digest_views(cluster, want);
            let complete = views.len() == http.len()
                && views.iter().all(|(_, v)| want.iter().all(|ns| v.contains_key(ns)));
            let same = complete && views.windows(2).all(|w| w[0].1 == w[1].1);
            let enough = views
                .iter()
                .all(|(_, v)| v.values().all(|(_, count)| *count >= s.checks.converge_min_entries));
            detail = views
                .iter()
                .map(|(n, v)| {
                    let per: Vec<String> = v
                        .iter()
                        .map(|(ns, (d, c))| format!("{ns}={c}/{}", d.get(..8).unwrap_or("")))
                        .collect();
                    format!("{n}: {}", per.join(" "))
                })
                .collect::<Vec<_>>()
                .join("; ");
            if same && enough {
                let after = traffic_end.elapsed().as_secs_f64();
                detail = format!("equal {after:.1}s after the traffic: {detail}");
                break true;
            }
            if Instant::now() > deadline {
                break false;
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        out.push(Check { name: "converged", ok, detail });
    }
    let models: Vec<(String, Vec<String>)> =
        http.iter().map(|n| (n.to_string(), model_ids(cluster, n).unwrap_or_default())).collect();
    if !s.checks.forbidden_models.is_empty() {
        let seen: Vec<String> = models
            .iter()
            .flat_map(|(n, ids)| {
                ids.iter()
                    .filter(|id| s.checks.forbidden_models.contains(id))
                    .map(move |id| format!("{id} at {n}"))
            })
            .collect();
        let detail = if seen.is_empty() {
            format!("none of {} listed by {} gateways", s.checks.forbidden_models.len(), http.len())
        } else {
            seen.join(", ")
        };
        out.push(Check { name: "forbidden_models", ok: seen.is_empty(), detail });
    }
    if !s.checks.required_models.is_empty() {
        let missing: Vec<String> = models
            .iter()
            .flat_map(|(n, ids)| {
                s.checks
                    .required_models
                    .iter()
                    .filter(|m| !ids.contains(m))
                    .map(move |m| format!("{m} missing at {n}"))
            })
            .collect();
        let detail =
            if missing.is_empty() { "listed everywhere".into() } else { missing.join(", ") };
        out.push(Check { name: "required_models", ok: missing.is_empty(), detail });
    }
    let c = &s.checks;
    if !c.served_by.is_empty() || !c.not_served_by.is_empty() {
        let mut served: BTreeMap<String, u64> = BTreeMap::new();
        for e in entries {
            if let Some(id) = e.usage.as_ref().and_then(|u| u["node_id"].as_str()) {
                *served.entry(id.to_string()).or_default() += 1;
            }
        }
        let count = |name: &str| {
            let id = cluster.nodes.get(name).and_then(|n| node_id_of(&n.dir)).unwrap_or_default();
            served.get(&id).copied().unwrap_or(0)
        };
        let mut bad = vec![];
        let mut seen = vec![];
        for n in &c.served_by {
            let k = count(n);
            seen.push(format!("{n}={k}"));
            if k == 0 {
                bad.push(format!("{n} served nothing"));
            }
        }
        for n in &c.not_served_by {
            let k = count(n);
            seen.push(format!("{n}={k}"));
            if k > 0 {
                bad.push(format!("{n} served {k}"));
            }
        }
        let detail = if bad.is_empty() { seen.join(" ") } else { bad.join(", ") };
        out.push(Check { name: "served_by", ok: bad.is_empty(), detail });
    }
    for l in &c.logs {
        let text = cluster.nodes.get(&l.node).map(|n| node_logs(&n.dir)).unwrap_or_default();
        let hits = text.matches(l.contains.as_str()).count();
        out.push(Check {
            name: "log",
            ok: hits > 0,
            detail: format!("{}: {hits} lines with {:?}", l.node, l.contains),
        });
    }
    for n in cluster.nodes.values().filter(|n| n.role == Role::Adversary) {
        let report = crate::adversary::read_report(&n.dir);
        let mut missing: Vec<&str> = crate::adversary::REQUIRED
            .iter()
            .copied()
            .filter(|k| report.get(*k).copied().unwrap_or(0) == 0)
            .collect();
        let granted: Vec<&str> = crate::adversary::FORBIDDEN
            .iter()
            .copied()
            .filter(|k| report.get(*k).copied().unwrap_or(0) > 0)
            .collect();
        if !granted.is_empty() {
            out.push(Check {
                name: "adversary_refused",
                ok: false,
                detail: format!("the gateway granted: {}", granted.join(", ")),
            });
        }
        missing.sort_unstable();
        let counts: Vec<String> = report.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let detail = if missing.is_empty() {
            counts.join(" ")
        } else {
            format!("never injected: {}; did: {}", missing.join(", "), counts.join(" "))
        };
        out.push(Check { name: "adversary_injected", ok: missing.is_empty(), detail });
    }
    out
}

/// Fires a fault if its trigger has come; returns what happened.
fn try_fire(
    cluster: &mut Cluster,
    f: &FaultSpec,
    s: &Scenario,
    running: &[Running],
    t0: Instant,
) -> Result<Option<FaultEvent>, Error> {
    let at_ms = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);
    let t = &f.trigger;
    let watched = t.request.as_ref().and_then(|name| {
        let gi = s.requests.iter().position(|r| &r.name == name)?;
        running.iter().find(|r| r.group == gi).map(|r| r.shared.clone())
    });
    if let Some(at) = t.at_ms {
        if at_ms < at {
            return Ok(None);
        }
    } else {
        let (Some(w), Some(k)) = (&watched, t.after_tokens) else { return Ok(None) };
        let p = progress(w).clone();
        if !p.accepted || p.content_frames < k || p.ended {
            return Ok(None);
        }
    }
    if f.action == Action::Partition {
        let (a, b) = (&f.sides[0], &f.sides[1]);
        cluster.cut(a, b, false)?;
        let node = format!("{}|{}", a.join(","), b.join(","));
        let frames_at_fault = watched.map(|w| progress(&w).content_frames);
        return Ok(Some(FaultEvent { at_ms, action: "partition".into(), node, frames_at_fault }));
    }
    let node = if f.target == "busy_worker" {
        // A worker counts a job from the moment it claims it: one that lost
        // the claim frees the slot within milliseconds, the lease holder
        // keeps it through prefill. Before the first token, busy twice
        // 250 ms apart is the holder; once tokens flow the race is over.
        let first = cluster.busy_workers();
        if first.is_empty() {
            return Ok(None);
        }
        if watched.as_ref().is_none_or(|w| progress(w).content_frames == 0) {
            std::thread::sleep(Duration::from_millis(250));
        }
        match cluster.busy_workers().into_iter().find(|n| first.contains(n)) {
            Some(n) => n,
            None => return Ok(None),
        }
    } else {
        f.target.clone()
    };
    if f.action == Action::Isolate {
        let others: Vec<String> = cluster.nodes.keys().filter(|n| **n != node).cloned().collect();
        cluster.cut(std::slice::from_ref(&node), &others, false)?;
        std::thread::sleep(Duration::from_millis(50));
        let frames_at_fault = watched.map(|w| progress(&w).content_frames);
        return Ok(Some(FaultEvent { at_ms, action: "isolate".into(), node, frames_at_fault }));
    }
    // Freeze first, then read the client's progress: what it had when the
    // node stopped is what the fault "landed after".
    let n = cluster.node(&node)?;
    n.signal("STOP")?;
    std::thread::sleep(Duration::from_millis(50));
    let frames_at_fault = watched.map(|w| progress(&w).content_frames);
    match f.action {
        Action::Kill | Action::Restart => n.kill(),
        _ => {}
    }
    let action = format!("{:?}", f.action).to_lowercase();
    Ok(Some(FaultEvent { at_ms, action, node, frames_at_fault }))
}

/// Ends a pause (SIGCONT), a restart's down time (start again), or a cut
/// (heal).
fn resume(cluster: &mut Cluster, f: &FaultSpec, node: &str) -> Result<(), Error> {
    let bin = cluster.bin.clone();
    match f.action {
        Action::Pause => cluster.node(node)?.signal("CONT")?,
        Action::Restart => {
            let n = cluster.node(node)?;
            n.spawn(&bin)?;
            let deadline = Instant::now() + Duration::from_secs(60);
            while !n.http_up() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Action::Isolate => {
            let others: Vec<String> =
                cluster.nodes.keys().filter(|n| n.as_str() != node).cloned().collect();
            cluster.cut(&[node.to_string()], &others, true)?;
        }
        Action::Partition => cluster.cut(&f.sides[0], &f.sides[1], true)?,
        Action::Kill => {}
    }
    tracing::info!(node, action = ?f.action, "resumed");
    Ok(())
}

/// Shared handle type re-exported for the load generator.
pub type SharedRecords = Arc<Mutex<Vec<Record>>>;
