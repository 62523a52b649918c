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

use crate::batch;
use crate::client::{self, progress, ChatRequest, Record, Shared, Terminal};
pub(crate) use crate::cluster::endpoint;
use crate::cluster::{registering_workers, Cluster, ClusterOpts, Node, Views};
use crate::history::{Check, Entry};
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
    /// The processing subtask a `lock_holder` target held when it was hit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subtask: Option<String>,
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
    pub run_checks: Vec<Check>,
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

pub(crate) fn chat_request(s: &RequestSpec) -> ChatRequest {
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
        network: s.network.clone(),
        continuation: s.continuation.clone(),
        sampled: s.temperature.map(|t| (t, s.seed.unwrap_or(0))),
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

/// Runs one scenario in `workdir` with the given binary.
pub fn run(s: &Scenario, bin: &Path, workdir: &Path) -> Result<Outcome, Error> {
    let started = Instant::now();
    if let Some(why) = cannot_run(s) {
        return Ok(Outcome::skipped(s, why));
    }
    tracing::info!(scenario = %s.name, "starting the topology");
    let opts = ClusterOpts { network: s.network, netsim_bin: None };
    let mut cluster = Cluster::start_with(bin, workdir, &s.node_specs(), &opts)?;
    let references = take_references(s, &cluster, workdir)?;
    let batch_references = batch::references(s, &cluster)?;
    settle(&cluster, !references.is_empty() || !batch_references.is_empty());
    start_adversaries(s, &mut cluster)?;
    let mut rss = RssWatch::start(&cluster);
    let t0 = Instant::now();
    let running = start_clients(s, &cluster)?;
    let batches = batch::start(s, &cluster)?;
    let faults = play_faults(s, &mut cluster, (&running, &batches), &mut rss, t0)?;
    let traffic_end = Instant::now();
    let entries = collect_history(s, &cluster, running, &faults.died, &references)?;
    let mut run_checks = cluster_checks(s, &cluster, traffic_end, &entries);
    let killed: Vec<(String, String)> = faults
        .events
        .iter()
        .filter_map(|f| Some((f.node.clone(), f.subtask.clone()?)))
        .collect();
    run_checks.extend(batch::judge(s, &cluster, batches, &batch_references, &killed));
    run_checks.extend(faults.checks());
    let rss_growth_mib = rss.growth_mib();
    run_checks.push(rss_check(s, &rss_growth_mib));
    drop(cluster);
    Ok(Outcome {
        scenario: s.name.clone(),
        entries,
        unfired: faults.unfired(),
        faults: faults.events,
        rss_growth_mib,
        run_checks,
        seconds: started.elapsed().as_secs_f64(),
        skipped: None,
    })
}

/// The unfaulted answer of every group that asks for one, taken before
/// any fault: temperature 0 makes it what every faulted run must be a
/// prefix of.
fn take_references(
    s: &Scenario,
    cluster: &Cluster,
    workdir: &Path,
) -> Result<BTreeMap<String, String>, Error> {
    let mut references = BTreeMap::new();
    for r in s.requests.iter().filter(|r| r.reference) {
        let (gw, key) = endpoint(cluster, &cluster.reference_keys, &r.gateway)?;
        // The reference reads the whole answer at full speed, whatever the
        // group's own client does.
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
    Ok(references)
}

/// Lets the reference jobs' slots free before the traffic: a worker still
/// busy when a job is announced backlogs it, and its late claim can race
/// the requeue the scenario means to test (see README, known issues).
fn settle(cluster: &Cluster, took_references: bool) {
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until
        && cluster.nodes.values().any(|n| n.role == Role::All && n.active_jobs().unwrap_or(0) > 0)
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    if took_references {
        std::thread::sleep(Duration::from_millis(1000));
    }
}

/// Adversaries join only after the reference answers, so they cannot be
/// the ones that produce them. They register like workers: the traffic
/// waits until every gateway knows them.
fn start_adversaries(s: &Scenario, cluster: &mut Cluster) -> Result<(), Error> {
    let adversaries = cluster.start_pending()?;
    if adversaries > 0 {
        cluster.wait_registrations(registering_workers(&s.nodes) + adversaries)?;
        std::thread::sleep(Duration::from_millis(1000));
    }
    Ok(())
}

/// Peak resident memory of every HTTP node against what it used when the
/// traffic began: a gateway that buffers what slow clients leave unread
/// grows without bound.
struct RssWatch {
    nodes: Vec<String>,
    base: BTreeMap<String, u64>,
    peak: BTreeMap<String, u64>,
}

impl RssWatch {
    fn start(cluster: &Cluster) -> RssWatch {
        let nodes: Vec<String> = cluster
            .nodes
            .values()
            .filter(|n| n.role.serves_http())
            .map(|n| n.name.clone())
            .collect();
        let base: BTreeMap<String, u64> = nodes
            .iter()
            .filter_map(|n| Some((n.clone(), cluster.nodes.get(n)?.rss_kib()?)))
            .collect();
        RssWatch { nodes, peak: base.clone(), base }
    }

    fn sample(&mut self, cluster: &Cluster) {
        for n in &self.nodes {
            if let Some(kib) = cluster.nodes.get(n).and_then(|x| x.rss_kib()) {
                let p = self.peak.entry(n.clone()).or_insert(kib);
                *p = (*p).max(kib);
            }
        }
    }

    /// Per node, in MiB; a node first seen during the traffic grew by 0.
    fn growth_mib(&self) -> BTreeMap<String, f64> {
        self.peak
            .iter()
            .map(|(n, p)| {
                let base = self.base.get(n).copied().unwrap_or(*p);
                (n.clone(), p.saturating_sub(base) as f64 / 1024.0)
            })
            .collect()
    }
}

fn rss_check(s: &Scenario, growth_mib: &BTreeMap<String, f64>) -> Check {
    let worst = growth_mib.values().copied().fold(0.0, f64::max);
    let limit = s.limits.max_gateway_rss_growth_mib;
    Check {
        name: "gateway_rss",
        ok: worst <= limit as f64,
        detail: format!("peak growth {worst:.1} MiB (limit {limit})"),
    }
}

struct Running {
    group: usize,
    index: u32,
    shared: Shared,
    handle: JoinHandle<Record>,
}

/// Starts every request of every group on its own thread, each at its
/// offset from now.
fn start_clients(s: &Scenario, cluster: &Cluster) -> Result<Vec<Running>, Error> {
    let mut running = vec![];
    for (gi, r) in s.requests.iter().enumerate() {
        let (gw, key) = endpoint(cluster, &cluster.keys, &r.gateway)?;
        for i in 0..r.count {
            let shared = Shared::default();
            let delay = Duration::from_millis(r.start_ms + u64::from(i) * r.spacing_ms);
            let handle = spawn_client(gw, key.clone(), chat_request(r), shared.clone(), delay);
            running.push(Running { group: gi, index: i, shared, handle });
        }
    }
    Ok(running)
}

fn spawn_client(
    gw: SocketAddr,
    key: String,
    req: ChatRequest,
    shared: Shared,
    delay: Duration,
) -> JoinHandle<Record> {
    std::thread::spawn(move || {
        std::thread::sleep(delay);
        // A slow client stops reading once its job has a usage record: the
        // gateway has given up on it by then.
        let give_up = || {
            let job = progress(&shared).job_id.clone();
            job.is_some_and(|j| usage_of(gw, &key, &j).is_some())
        };
        client::chat(gw, &key, &req, &shared, &give_up)
    })
}

/// The clients and the batch pollers of a run.
type Traffic<'a> = (&'a [Running], &'a [batch::Running]);

/// Plays the fault schedule and samples memory while the clients run,
/// until every request and batch has ended and every hold is over, or the
/// longest timeout plus a minute has passed (a hung client must not hang
/// the run).
fn play_faults(
    s: &Scenario,
    cluster: &mut Cluster,
    traffic: Traffic<'_>,
    rss: &mut RssWatch,
    t0: Instant,
) -> Result<Faults, Error> {
    let mut faults = Faults::new(s);
    let longest = s.requests.iter().map(|r| r.timeout_s).max().unwrap_or(60);
    let hard_stop = t0 + Duration::from_secs(longest.max(batch::longest_s(s)) + 60);
    loop {
        let all_done = traffic.0.iter().all(|r| progress(&r.shared).ended)
            && traffic.1.iter().all(|b| b.progress().ended);
        if (all_done && !faults.holds_left()) || Instant::now() > hard_stop {
            break;
        }
        faults.step(cluster, s, traffic, t0)?;
        rss.sample(cluster);
        std::thread::sleep(Duration::from_millis(20));
    }
    // What the traffic outlived still ends: the cluster checks look at the
    // healed topology.
    faults.end_all_holds(cluster, s)?;
    Ok(faults)
}

/// The fault schedule as it plays out.
struct Faults {
    pending: Vec<PendingFault>,
    events: Vec<FaultEvent>,
    /// Nodes killed or restarted: a request whose gateway is among them
    /// may end with a closed connection.
    died: Vec<String>,
    /// The digests just before a partition heals (they must differ).
    at_heal: Option<Views>,
}

struct PendingFault {
    spec: FaultSpec,
    fired: bool,
    resume_at: Option<(Instant, String)>,
}

impl PendingFault {
    /// Marks it fired on `node` and schedules its end: a kill never ends,
    /// and neither does a cut without a hold (it lasts the run).
    fn fired_on(&mut self, node: &str) {
        self.fired = true;
        let heals = !matches!(self.spec.action, Action::Isolate | Action::Partition)
            || self.spec.hold_ms > 0;
        if self.spec.action != Action::Kill && heals {
            let when = Instant::now() + Duration::from_millis(self.spec.hold_ms);
            self.resume_at = Some((when, node.to_string()));
        }
    }

    /// Ends its hold if it has one, first taking the digests a partition
    /// leaves behind (the proof that the two sides diverged).
    fn end_hold(
        &mut self,
        cluster: &mut Cluster,
        s: &Scenario,
        at_heal: &mut Option<Views>,
    ) -> Result<(), Error> {
        let Some((_, node)) = self.resume_at.take() else { return Ok(()) };
        if self.spec.action == Action::Partition && !s.checks.converge.is_empty() {
            *at_heal = Some(cluster.digests(&s.checks.converge));
        }
        resume(cluster, &self.spec, &node)
    }
}

impl Faults {
    fn new(s: &Scenario) -> Faults {
        let pending = s
            .faults
            .iter()
            .map(|f| PendingFault { spec: f.clone(), fired: false, resume_at: None })
            .collect();
        Faults { pending, events: vec![], died: vec![], at_heal: None }
    }

    fn holds_left(&self) -> bool {
        self.pending.iter().any(|f| f.resume_at.is_some())
    }

    /// Ends the holds that are over, then fires what has come due.
    fn step(
        &mut self,
        cluster: &mut Cluster,
        s: &Scenario,
        traffic: Traffic<'_>,
        t0: Instant,
    ) -> Result<(), Error> {
        for f in self.pending.iter_mut() {
            if f.resume_at.as_ref().is_some_and(|(when, _)| Instant::now() >= *when) {
                f.end_hold(cluster, s, &mut self.at_heal)?;
            }
            if f.fired {
                continue;
            }
            let Some(ev) = try_fire(cluster, &f.spec, s, traffic, t0)? else { continue };
            f.fired_on(&ev.node);
            if matches!(f.spec.action, Action::Kill | Action::Restart) {
                self.died.push(ev.node.clone());
            }
            tracing::info!(action = %ev.action, node = %ev.node, at_ms = ev.at_ms, "fault");
            self.events.push(ev);
        }
        Ok(())
    }

    fn end_all_holds(&mut self, cluster: &mut Cluster, s: &Scenario) -> Result<(), Error> {
        for f in self.pending.iter_mut() {
            f.end_hold(cluster, s, &mut self.at_heal)?;
        }
        Ok(())
    }

    fn unfired(&self) -> Vec<String> {
        self.pending
            .iter()
            .filter(|f| !f.fired)
            .map(|f| format!("{:?} {}", f.spec.action, f.spec.target))
            .collect()
    }

    /// A partition must have let the sides diverge (else its convergence
    /// proves nothing), and every fault must have fired.
    fn checks(&self) -> Vec<Check> {
        let mut out = vec![];
        if let Some(v) = &self.at_heal {
            out.push(Check {
                name: "diverged",
                ok: v.windows(2).any(|w| w[0].1 != w[1].1),
                detail: format!("at the heal: {}", describe(v, |ns, _, c| format!("{ns}={c}"))),
            });
        }
        let unfired = self.unfired();
        out.push(Check {
            name: "faults_fired",
            ok: unfired.is_empty(),
            detail: format!("{} fired, {} never triggered", self.events.len(), unfired.len()),
        });
        out
    }
}

/// Per node, one `ns=…` item per namespace.
fn describe(views: &Views, item: impl Fn(&str, &str, u64) -> String) -> String {
    let nodes: Vec<String> = views
        .iter()
        .map(|(n, m)| {
            let per: Vec<String> = m.iter().map(|(ns, (d, c))| item(ns, d, *c)).collect();
            format!("{n}: {}", per.join(" "))
        })
        .collect();
    nodes.join("; ")
}

/// The history: what every client saw, the gateway's usage record of its
/// job, and the verdicts over both.
fn collect_history(
    s: &Scenario,
    cluster: &Cluster,
    running: Vec<Running>,
    died: &[String],
    references: &BTreeMap<String, String>,
) -> Result<Vec<Entry>, Error> {
    let mut entries: Vec<Entry> = running.into_iter().map(|r| join_client(s, r, died)).collect();
    fetch_usage(s, cluster, &mut entries)?;
    for e in &mut entries {
        if let Some(spec) = s.requests.iter().find(|r| r.name == e.group) {
            e.judge(spec, references.get(&e.group).map(String::as_str));
        }
    }
    Ok(entries)
}

fn join_client(s: &Scenario, r: Running, died: &[String]) -> Entry {
    let spec = &s.requests[r.group];
    let record = r.handle.join().unwrap_or_else(|_| Record::lost("client thread panicked"));
    Entry {
        group: spec.name.clone(),
        index: r.index,
        record,
        usage: None,
        gateway_died: died.contains(&spec.gateway),
        checks: vec![],
        notes: vec![],
    }
}

/// Polls for the usage record of every accepted job until each has one or
/// the wait is over: the gateway meters after the stream ends, and a
/// cut-off worker's tokens arrive later still.
fn fetch_usage(s: &Scenario, cluster: &Cluster, entries: &mut [Entry]) -> Result<(), Error> {
    let deadline = Instant::now() + Duration::from_secs(s.limits.usage_wait_s);
    let wanted = |e: &Entry| e.usage.is_none() || awaiting_late_metering(s, e);
    loop {
        let mut missing = 0;
        for e in entries.iter_mut().filter(|e| wanted(e) && e.record.status == 200) {
            let spec = s.requests.iter().find(|r| r.name == e.group);
            let (Some(spec), Some(job)) = (spec, e.record.job_id.clone()) else { continue };
            let (gw, key) = endpoint(cluster, &cluster.keys, &spec.gateway)?;
            e.usage = usage_of(gw, &key, &job);
            missing += usize::from(wanted(e));
        }
        if missing == 0 || Instant::now() > deadline {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// A record still waiting for the cut-off worker's late metering.
fn awaiting_late_metering(s: &Scenario, e: &Entry) -> bool {
    let late = s.requests.iter().any(|r| r.name == e.group && r.expect_late_metering);
    late && e.usage.as_ref().is_some_and(|u| {
        u["output_tokens_generated"].as_u64().unwrap_or(0)
            <= u["output_tokens_sent_to_client"].as_u64().unwrap_or(0)
    })
}

/// The scenario's cluster-wide checks: keyspace convergence, the models the
/// gateways list, who served the traffic, what the nodes logged, and what
/// the adversaries managed to inject.
fn cluster_checks(
    s: &Scenario,
    cluster: &Cluster,
    traffic_end: Instant,
    entries: &[Entry],
) -> Vec<Check> {
    let c = &s.checks;
    let http = cluster.live_http();
    let mut out = vec![];
    if !c.converge.is_empty() {
        out.push(converged(s, cluster, http.len(), traffic_end));
    }
    let models: Vec<(String, Vec<String>)> =
        http.iter().map(|n| (n.to_string(), cluster.model_ids(n).unwrap_or_default())).collect();
    if !c.forbidden_models.is_empty() {
        out.push(forbidden_models(s, &models));
    }
    if !c.required_models.is_empty() {
        out.push(required_models(s, &models));
    }
    if !c.served_by.is_empty() || !c.not_served_by.is_empty() {
        out.push(served_by(s, cluster, entries));
    }
    for l in &c.logs {
        let text = cluster.nodes.get(&l.node).map(Node::logs).unwrap_or_default();
        let hits = text.matches(l.contains.as_str()).count();
        out.push(Check {
            name: "log",
            ok: hits > 0,
            detail: format!("{}: {hits} lines with {:?}", l.node, l.contains),
        });
    }
    out.extend(crate::checks::trust(s, cluster));
    for n in cluster.nodes.values().filter(|n| n.role == Role::Adversary) {
        out.extend(adversary_checks(n));
        // The disk-fill identity's flood, as the honest gateways saw it.
        let sent = crate::adversary::read_report(&n.dir).get("disk_fill_delta").copied().unwrap_or(0);
        let gateways: Vec<(String, Option<String>, u64)> = cluster
            .nodes
            .iter()
            .filter(|(_, g)| g.role == Role::Gateway)
            .map(|(name, g)| {
                (name.clone(), g.metrics_text(), crate::adversary::dir_bytes(&g.dir))
            })
            .collect();
        out.extend(crate::checks::disk_fill(&gateways, sent));
    }
    out
}

/// Polls until the namespaces to converge have equal digests, each with
/// enough entries, on all `http_nodes` live HTTP nodes, or the time
/// allowed after the traffic is over.
fn converged(s: &Scenario, cluster: &Cluster, http_nodes: usize, traffic_end: Instant) -> Check {
    let want = &s.checks.converge;
    let deadline = traffic_end + Duration::from_secs(s.checks.converge_within_s);
    loop {
        let views = cluster.digests(want);
        let complete = views.len() == http_nodes
            && views.iter().all(|(_, v)| want.iter().all(|ns| v.contains_key(ns)));
        let same = complete && views.windows(2).all(|w| w[0].1 == w[1].1);
        let enough = views
            .iter()
            .all(|(_, v)| v.values().all(|(_, count)| *count >= s.checks.converge_min_entries));
        let detail = describe(&views, |ns, d, c| format!("{ns}={c}/{}", d.get(..8).unwrap_or("")));
        if same && enough {
            let after = traffic_end.elapsed().as_secs_f64();
            let detail = format!("equal {after:.1}s after the traffic: {detail}");
            return Check { name: "converged", ok: true, detail };
        }
        if Instant::now() > deadline {
            return Check { name: "converged", ok: false, detail };
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// No gateway lists a model that only a forged registration announced.
fn forbidden_models(s: &Scenario, models: &[(String, Vec<String>)]) -> Check {
    let forbidden = &s.checks.forbidden_models;
    let seen: Vec<String> = models
        .iter()
        .flat_map(|(n, ids)| {
            ids.iter().filter(|id| forbidden.contains(id)).map(move |id| format!("{id} at {n}"))
        })
        .collect();
    let detail = if seen.is_empty() {
        format!("none of {} listed by {} gateways", forbidden.len(), models.len())
    } else {
        seen.join(", ")
    };
    Check { name: "forbidden_models", ok: seen.is_empty(), detail }
}

/// Every gateway lists the honest workers' models (a refused forgery must
/// not have evicted them).
fn required_models(s: &Scenario, models: &[(String, Vec<String>)]) -> Check {
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
    let detail = if missing.is_empty() { "listed everywhere".into() } else { missing.join(", ") };
    Check { name: "required_models", ok: missing.is_empty(), detail }
}

/// Which nodes served the traffic, by the node id in its usage records.
fn served_by(s: &Scenario, cluster: &Cluster, entries: &[Entry]) -> Check {
    let mut served: BTreeMap<String, u64> = BTreeMap::new();
    for e in entries {
        if let Some(id) = e.usage.as_ref().and_then(|u| u["node_id"].as_str()) {
            *served.entry(id.to_string()).or_default() += 1;
        }
    }
    let count = |name: &str| {
        let id = cluster.nodes.get(name).and_then(Node::node_id).unwrap_or_default();
        served.get(&id).copied().unwrap_or(0)
    };
    let (mut bad, mut seen) = (vec![], vec![]);
    for n in &s.checks.served_by {
        let k = count(n);
        seen.push(format!("{n}={k}"));
        if k == 0 {
            bad.push(format!("{n} served nothing"));
        }
    }
    for n in &s.checks.not_served_by {
        let k = count(n);
        seen.push(format!("{n}={k}"));
        if k > 0 {
            bad.push(format!("{n} served {k}"));
        }
    }
    let detail = if bad.is_empty() { seen.join(" ") } else { bad.join(", ") };
    Check { name: "served_by", ok: bad.is_empty(), detail }
}

/// From an adversary's own report: it tried every attack it must
/// (`REQUIRED`), else the scenario proves nothing, and the gateway granted
/// none it must refuse (`FORBIDDEN`).
fn adversary_checks(n: &Node) -> Vec<Check> {
    let report = crate::adversary::read_report(&n.dir);
    let count = |k: &str| report.get(k).copied().unwrap_or(0);
    let mut out = vec![];
    let granted: Vec<&str> =
        crate::adversary::FORBIDDEN.iter().copied().filter(|k| count(k) > 0).collect();
    if !granted.is_empty() {
        out.push(Check {
            name: "adversary_refused",
            ok: false,
            detail: format!("the gateway granted: {}", granted.join(", ")),
        });
    }
    let mut missing: Vec<&str> = crate::adversary::required(&report)
        .iter()
        .chain(crate::adversary::disk_required(&report).iter())
        .copied()
        .filter(|k| count(k) == 0)
        .collect();
    missing.sort_unstable();
    let counts: Vec<String> = report.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let detail = if missing.is_empty() {
        counts.join(" ")
    } else {
        format!("never injected: {}; did: {}", missing.join(", "), counts.join(" "))
    };
    out.push(Check { name: "adversary_injected", ok: missing.is_empty(), detail });
    out
}

/// Fires a fault if its trigger has come; returns what happened.
fn try_fire(
    cluster: &mut Cluster,
    f: &FaultSpec,
    s: &Scenario,
    (running, batches): Traffic<'_>,
    t0: Instant,
) -> Result<Option<FaultEvent>, Error> {
    let at_ms = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);
    let t = &f.trigger;
    if let Some(l) = &t.log {
        let text = cluster.nodes.get(&l.node).map(Node::logs).unwrap_or_default();
        if !text.contains(l.contains.as_str()) {
            return Ok(None);
        }
    }
    let watched = t.request.as_ref().and_then(|name| {
        let gi = s.requests.iter().position(|r| &r.name == name)?;
        running.iter().find(|r| r.group == gi).map(|r| r.shared.clone())
    });
    if let Some(at) = t.at_ms {
        if at_ms < at {
            return Ok(None);
        }
    } else if let (Some(name), Some(k)) = (&t.batch, t.after_done) {
        let p = batches.iter().find(|b| &b.name == name).map(batch::Running::progress);
        if p.is_none_or(|p| p.done < k || p.ended) {
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
        let action = "partition".into();
        return Ok(Some(FaultEvent { at_ms, action, node, frames_at_fault, subtask: None }));
    }
    let (target, subtask) = match f.target.as_str() {
        "busy_worker" => (lease_holder(cluster, watched.as_ref()), None),
        "lock_holder" => batch::lock_holder(cluster).map_or((None, None), |(n, t)| (Some(n), Some(t))),
        _ => (Some(f.target.clone()), None),
    };
    let Some(node) = target else { return Ok(None) };
    if f.action == Action::Isolate {
        let others: Vec<String> = cluster.nodes.keys().filter(|n| **n != node).cloned().collect();
        cluster.cut(std::slice::from_ref(&node), &others, false)?;
        std::thread::sleep(Duration::from_millis(50));
        let frames_at_fault = watched.map(|w| progress(&w).content_frames);
        let action = "isolate".into();
        return Ok(Some(FaultEvent { at_ms, action, node, frames_at_fault, subtask }));
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
    Ok(Some(FaultEvent { at_ms, action, node, frames_at_fault, subtask }))
}

/// The worker holding the watched request's job, if one is busy. A worker
/// counts a job from the moment it claims it: one that lost the claim
/// frees the slot within milliseconds, the lease holder keeps it through
/// prefill. Before the first token, busy twice 250 ms apart is the holder;
/// once tokens flow the race is over.
pub(crate) fn lease_holder(cluster: &Cluster, watched: Option<&Shared>) -> Option<String> {
    let first = cluster.busy_workers();
    if first.is_empty() {
        return None;
    }
    if watched.is_none_or(|w| progress(w).content_frames == 0) {
        std::thread::sleep(Duration::from_millis(250));
    }
    cluster.busy_workers().into_iter().find(|n| first.contains(n))
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
