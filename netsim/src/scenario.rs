//! The scenario file: a topology, client requests, a fault schedule, and
//! what the scenario expects beyond the universal checks. TOML, see
//! netsim/README.md for the format and netsim/scenarios/ for examples.

use std::path::Path;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::Error;

/// A whole scenario.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Short name (report file names use it).
    pub name: String,
    /// What it shows.
    #[serde(default)]
    pub description: String,
    /// Nodes, started in order; `bootstrap` names earlier nodes.
    pub nodes: Vec<NodeSpec>,
    /// Client requests.
    #[serde(default)]
    pub requests: Vec<RequestSpec>,
    /// Batches (`/v1/files` + `/v1/batches`), run beside the requests.
    #[serde(default)]
    pub batches: Vec<BatchSpec>,
    /// Faults.
    #[serde(default)]
    pub faults: Vec<FaultSpec>,
    /// Whole-run limits.
    #[serde(default)]
    pub limits: RunLimits,
    /// Where the nodes run: loopback (default) or one network namespace each.
    #[serde(default)]
    pub network: NetworkMode,
    /// Checks over the whole cluster after the traffic.
    #[serde(default)]
    pub checks: ClusterChecks,
    /// The lease term every HTTP node grants (`--lease-ms`; default the
    /// gateway's 10 s): a paused or cut-off holder is replaced after it.
    #[serde(default)]
    pub lease_ms: Option<u64>,
    /// Many faulted streams in this one topology (`series::run`) instead
    /// of one run of the traffic as written.
    #[serde(default)]
    pub series: Option<SeriesSpec>,
}

/// The fewest tokens a series stream may ask for: its fault lands at a
/// token index drawn in 1..=max_tokens-12, leaving time to freeze the
/// holder before the stream could end.
pub const SERIES_MIN_TOKENS: u32 = 16;

/// The faulted streams of a series: each a copy of the scenario's
/// reference request, compared with its own uninterrupted run, its first
/// fault moved to a token index drawn per stream.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeriesSpec {
    /// Greedy streams.
    pub greedy: u32,
    /// Seeded streams (temperature 0.8, a seed drawn per stream).
    pub seeded: u32,
    /// `max_tokens` of every stream (default: the request's).
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// The scenario's `lease_ms` while it plays as a series: a pause or a
    /// cut is detected at the lease's end, and 40 streams cannot each wait
    /// out the single run's 10 s.
    #[serde(default)]
    pub lease_ms: Option<u64>,
    /// The first fault's `hold_ms` while it plays as a series (past the
    /// series' lease, so the holder is lost before it runs again).
    #[serde(default)]
    pub hold_ms: Option<u64>,
}

impl Scenario {
    /// The scenario as its series plays it: the series' lease and hold in
    /// place of the single run's.
    pub fn as_series(&self) -> Scenario {
        let mut s = self.clone();
        let Some(spec) = &self.series else { return s };
        if spec.lease_ms.is_some() {
            s.lease_ms = spec.lease_ms;
        }
        if let (Some(ms), Some(f)) = (spec.hold_ms, s.faults.first_mut()) {
            f.hold_ms = ms;
        }
        s
    }
}

/// Where the nodes run.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum NetworkMode {
    /// 127.0.0.1, one port pair per node.
    #[default]
    Loopback,
    /// One network namespace per node on a bridge (`10.77.x.0/24`), so links
    /// can be cut (`partition`, `isolate`). Needs root; without it the
    /// scenario is reported as skipped, with the reason.
    Netns,
}

/// Checks over the whole cluster after the traffic.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterChecks {
    /// Keyspace namespaces (column family names, e.g. `api.jobs`) whose
    /// anti-entropy digests must become equal on every HTTP node.
    #[serde(default)]
    pub converge: Vec<String>,
    /// How long they may take, counted from the end of the traffic.
    #[serde(default = "default_converge")]
    pub converge_within_s: u64,
    /// Least entries each converged namespace must hold (proves both sides'
    /// writes are in it).
    #[serde(default)]
    pub converge_min_entries: u64,
    /// Model ids that must not appear in any gateway's `/v1/models`.
    #[serde(default)]
    pub forbidden_models: Vec<String>,
    /// Model ids that must appear in every gateway's `/v1/models`.
    #[serde(default)]
    pub required_models: Vec<String>,
    /// Nodes that must have served at least one request (the `node_id` of
    /// a usage record of the traffic).
    #[serde(default)]
    pub served_by: Vec<String>,
    /// Nodes that must have served none.
    #[serde(default)]
    pub not_served_by: Vec<String>,
    /// Text a node's log must contain (evidence of what it refused).
    #[serde(default)]
    pub logs: Vec<LogCheck>,
    /// What every gateway's `/v1/models/{name}` must say of a name (a
    /// poisoned catalogue must not change it).
    #[serde(default)]
    pub models_as: Vec<ModelAs>,
    /// Bounds on a node's `/metrics` values, read after the traffic.
    #[serde(default)]
    pub metrics: Vec<MetricBound>,
}

/// A model name as a gateway must describe it.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelAs {
    /// The name asked for (an id or alias).
    pub name: String,
    /// The model id behind it.
    pub model_id: String,
    /// Its context in tokens.
    pub context_tokens: u64,
}

/// A metric of one node within `[min, max]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricBound {
    /// Node name (an HTTP node).
    pub node: String,
    /// A metric, with its labels as /metrics writes them
    /// (`name{label="v"}`).
    pub metric: String,
    /// Least value.
    #[serde(default)]
    pub min: f64,
    /// Largest value.
    pub max: f64,
}

/// A line a node must have logged.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogCheck {
    /// Node name.
    pub node: String,
    /// Substring.
    pub contains: String,
}

/// What a node runs.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Gateway only (serves HTTP).
    Gateway,
    /// Worker only (no HTTP).
    Worker,
    /// Both; fault targets that must find "the worker holding the job"
    /// need this, because only HTTP nodes expose `gcs_worker_active_jobs`.
    All,
    /// A misbehaving peer (`netsim adversary`): joins over libp2p and
    /// injects forged, replayed, duplicated and reordered messages. Started
    /// after the reference answers are taken.
    Adversary,
}

impl Role {
    /// The `--role` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Gateway => "gateway",
            Role::Worker => "worker",
            Role::All => "all",
            Role::Adversary => "adversary",
        }
    }

    /// Whether it is a gcs-node that serves HTTP.
    pub fn serves_http(self) -> bool {
        matches!(self, Role::Gateway | Role::All)
    }
}

/// One node.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    /// Name used by requests and faults.
    pub name: String,
    /// Role.
    pub role: Role,
    /// Earlier nodes to dial.
    #[serde(default)]
    pub bootstrap: Vec<String>,
    /// Extra `gcs-node` flags.
    #[serde(default)]
    pub args: Vec<String>,
    /// Run the node with its wall clock skewed by this many seconds
    /// (libfaketime; the monotonic clock is left alone).
    #[serde(default)]
    pub clock_skew_s: Option<i64>,
    /// Whether the gateways must know this worker's registration before the
    /// traffic (false for a worker whose clock is skewed past the tolerance).
    #[serde(default = "yes")]
    pub registers: bool,
    /// Membership certificates to start with: each is issued by an earlier
    /// gateway's tenant or swarm key (`gcs-node tenants`) for this node and
    /// given as `--membership`.
    #[serde(default)]
    pub admitted: Vec<Admission>,
    /// Tenants whose processing tasks this worker takes.
    #[serde(default)]
    pub trusts: Vec<TrustSpec>,
}

/// One admission of a node by a tenant's or swarm's key.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Admission {
    /// The gateway whose data directory holds the key (made if missing).
    pub by: String,
    /// The tenant (the gateways' API keys are of tenant `netsim`).
    #[serde(default)]
    pub tenant: Option<String>,
    /// Or the swarm.
    #[serde(default)]
    pub swarm: Option<String>,
    /// A tenant-gateway certificate instead of a member's.
    #[serde(default)]
    pub gateway: bool,
}

/// A tenant whose gateways' processing tasks a worker takes
/// (`--trust-tenant TENANT=ISSUER`, the issuer being the tenant key that
/// gateway `by` holds, made if missing).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustSpec {
    /// The gateway whose data directory holds the tenant's key.
    pub by: String,
    /// The tenant.
    pub tenant: String,
}

/// What a request group must end as, beyond the universal checks.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Expect {
    /// Any well-formed terminal outcome.
    #[default]
    Any,
    /// A complete answer.
    Complete,
    /// An error event after some content (never a silent switch).
    ErrorAfterPartial,
    /// An error event or a closed connection (the gateway died).
    ErrorOrClosed,
    /// Either complete, or an error event after partial output.
    CompleteOrErrorAfterPartial,
}

/// A group of identical requests.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestSpec {
    /// Group name (faults trigger on it).
    pub name: String,
    /// The node whose HTTP API receives them.
    pub gateway: String,
    /// How many.
    #[serde(default = "one")]
    pub count: u32,
    /// Start offset from the beginning of traffic.
    #[serde(default)]
    pub start_ms: u64,
    /// Gap between starts within the group.
    #[serde(default)]
    pub spacing_ms: u64,
    /// User message.
    #[serde(default = "default_prompt")]
    pub prompt: String,
    /// `gnus.network` routing (`private`, `hybrid`, `local_only`; default
    /// public).
    #[serde(default)]
    pub network: Option<String>,
    /// Words of filler placed before the prompt: a long prompt makes prefill
    /// (the time before the first token) long enough to aim a fault at.
    #[serde(default)]
    pub filler_words: u32,
    /// `max_tokens`.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// SSE.
    #[serde(default = "yes")]
    pub stream: bool,
    /// Ban end-of-sequence so generation runs to `max_tokens`.
    #[serde(default)]
    pub ban_eos: bool,
    /// `gnus.continuation` (`"auto"`, the gateway's default, or `"off"`:
    /// a holder lost after the first token then ends the stream).
    #[serde(default)]
    pub continuation: Option<String>,
    /// Sample at this temperature (with `seed`) instead of greedy; the
    /// reference run uses the same seed, so its text is still the one
    /// an uninterrupted stream must equal.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// The request's `seed` (with `temperature`).
    #[serde(default)]
    pub seed: Option<u64>,
    /// `stream_options.include_usage`.
    #[serde(default = "yes")]
    pub include_usage: bool,
    /// Slow client: bytes read per second.
    #[serde(default)]
    pub read_bytes_per_s: Option<u32>,
    /// Receive buffer for a slow client.
    #[serde(default)]
    pub rcvbuf: Option<u32>,
    /// Vanishing client: hang up after this many content frames.
    #[serde(default)]
    pub vanish_after_frames: Option<u32>,
    /// Client timeout.
    #[serde(default = "default_timeout")]
    pub timeout_s: u64,
    /// Expected outcome.
    #[serde(default)]
    pub expect: Expect,
    /// Expected `cancellation_reason` of the usage record.
    #[serde(default)]
    pub expect_cancellation: Option<String>,
    /// Least `requeue_count` in the usage record.
    #[serde(default)]
    pub expect_requeues_min: Option<u32>,
    /// Compare streamed text with an unfaulted run of the same request
    /// (temperature 0): a delivered stream must be a prefix of it, a
    /// complete one equal to it. Catches gaps, duplicates and silent
    /// switches that frame counting cannot see.
    #[serde(default)]
    pub reference: bool,
    /// The answer may also be the adversary's own output (it won the job
    /// honestly and streamed it, however disorderly): then it must be a
    /// prefix of (complete: equal to) that text instead of the reference.
    #[serde(default)]
    pub adversary_output_ok: bool,
    /// Wait until the usage record shows more tokens generated than
    /// delivered: the cut-off worker's late output reached the gateway
    /// after the heal and was metered, not delivered.
    #[serde(default)]
    pub expect_late_metering: bool,
}

/// When a fault fires.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Trigger {
    /// Milliseconds after traffic starts.
    #[serde(default)]
    pub at_ms: Option<u64>,
    /// Or: once this request group's first request ...
    #[serde(default)]
    pub request: Option<String>,
    /// ... has received this many content frames (0: accepted, a worker
    /// holds the job, no token yet).
    #[serde(default)]
    pub after_tokens: Option<u64>,
    /// Or: once this batch ...
    #[serde(default)]
    pub batch: Option<String>,
    /// ... has this many requests answered (completed + failed).
    #[serde(default)]
    pub after_done: Option<u64>,
    /// And (with any of the above): once this node has logged a line
    /// with this text (what must have happened before the fault, such as
    /// a mirror's first pull).
    #[serde(default)]
    pub log: Option<LogCheck>,
}

/// What a fault does.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// kill -9.
    Kill,
    /// kill -9 then start again on the same ports and data after `hold_ms`.
    Restart,
    /// SIGSTOP, then SIGCONT after `hold_ms`.
    Pause,
    /// Cut every link of `target` to every other node (netns); heal after
    /// `hold_ms` (0: never).
    Isolate,
    /// Cut every link between `sides[0]` and `sides[1]` (netns); heal after
    /// `hold_ms` (0: never).
    Partition,
}

/// One fault.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    /// What.
    pub action: Action,
    /// A node name, or `busy_worker`: the `all` node whose worker runs a job,
    /// or `lock_holder`: a worker holding a processing subtask's lock (its
    /// log says so; not used by `partition`).
    #[serde(default)]
    pub target: String,
    /// The two sides of a `partition`.
    #[serde(default)]
    pub sides: Vec<Vec<String>>,
    /// When.
    pub trigger: Trigger,
    /// Down time (restart) or pause length (pause).
    #[serde(default)]
    pub hold_ms: u64,
}

/// Whole-run limits.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunLimits {
    /// Largest allowed growth of any gateway's RSS during the run.
    #[serde(default = "default_rss")]
    pub max_gateway_rss_growth_mib: u64,
    /// How long to wait for usage records after the traffic.
    #[serde(default = "default_usage_wait")]
    pub usage_wait_s: u64,
}

impl Default for RunLimits {
    fn default() -> Self {
        Self { max_gateway_rss_growth_mib: default_rss(), usage_wait_s: default_usage_wait() }
    }
}

fn one() -> u32 {
    1
}
fn yes() -> bool {
    true
}
fn default_prompt() -> String {
    "Write a short story about a lighthouse keeper.".into()
}
fn default_max_tokens() -> u32 {
    32
}
fn default_timeout() -> u64 {
    120
}
fn default_rss() -> u64 {
    64
}
fn default_usage_wait() -> u64 {
    30
}
fn default_converge() -> u64 {
    30
}

impl Scenario {
    /// Reads and checks a scenario file.
    pub fn load(path: &Path) -> Result<Scenario, Error> {
        let text = std::fs::read_to_string(path)?;
        let s: Scenario = toml::from_str(&text)
            .map_err(|e| Error::Scenario(format!("{}: {e}", path.display())))?;
        s.validate()?;
        Ok(s)
    }

    /// The nodes as started: every HTTP node also gets the scenario's
    /// `--lease-ms`.
    pub fn node_specs(&self) -> Vec<NodeSpec> {
        let mut nodes = self.nodes.clone();
        if let Some(ms) = self.lease_ms {
            for n in nodes.iter_mut().filter(|n| n.role.serves_http()) {
                n.args.extend(["--lease-ms".to_string(), ms.to_string()]);
            }
        }
        nodes
    }

    fn validate(&self) -> Result<(), Error> {
        let node = |n: &str| self.nodes.iter().any(|x| x.name == n);
        let bad = |m: String| Err(Error::Scenario(format!("{}: {m}", self.name)));
        for ms in [self.lease_ms, self.series.as_ref().and_then(|x| x.lease_ms)].into_iter().flatten() {
            if !(1_000..=120_000).contains(&ms) {
                return bad(format!("lease_ms {ms} is outside 1000..=120000 (--lease-ms)"));
            }
        }
        if let Some(series) = &self.series {
            let max = self.requests.iter().find(|r| r.reference).map(|r| r.max_tokens);
            let max = series.max_tokens.or(max).unwrap_or(0);
            if self.faults.is_empty() || max < SERIES_MIN_TOKENS {
                return bad(format!(
                    "a series needs a fault and a reference request of at least {} tokens",
                    SERIES_MIN_TOKENS
                ));
            }
        }
        for r in &self.requests {
            if !self.nodes.iter().any(|x| x.name == r.gateway && x.role.serves_http()) {
                return bad(format!("request {} names no HTTP node {}", r.name, r.gateway));
            }
        }
        for b in &self.batches {
            if !self.nodes.iter().any(|x| x.name == b.gateway && x.role.serves_http()) {
                return bad(format!("batch {} names no HTTP node {}", b.name, b.gateway));
            }
            if let Some(p) = b.poll.as_ref().filter(|p| !self.nodes.iter().any(|x| &x.name == *p && x.role.serves_http())) {
                return bad(format!("batch {} is polled on no HTTP node {p}", b.name));
            }
            if !(1..=1000).contains(&b.lines) {
                return bad(format!("batch {}: lines must be 1..=1000", b.name));
            }
        }
        for n in &self.nodes {
            if let Some(t) = n.trusts.iter().find(|t| !node(&t.by)) {
                return bad(format!("{} trusts a tenant of {}, which is not a node", n.name, t.by));
            }
        }
        for f in &self.faults {
            if let Some(l) = f.trigger.log.as_ref().filter(|l| !node(&l.node)) {
                return bad(format!("a fault's trigger waits for the log of {}, not a node", l.node));
            }
            let cuts = matches!(f.action, Action::Isolate | Action::Partition);
            if cuts && self.network != NetworkMode::Netns {
                return bad(format!("{:?} needs network = \"netns\"", f.action));
            }
            if f.action == Action::Partition {
                if f.sides.len() != 2 || f.sides.iter().flatten().any(|n| !node(n)) {
                    return bad("a partition needs sides = [[nodes...], [nodes...]]".into());
                }
            } else if !matches!(f.target.as_str(), "busy_worker" | "lock_holder") && !node(&f.target) {
                return bad(format!("fault target {} is not a node", f.target));
            }
            let t = &f.trigger;
            let on_request = t.request.is_some() && t.after_tokens.is_some();
            let on_batch = t.batch.is_some() && t.after_done.is_some();
            if t.at_ms.is_none() && !on_request && !on_batch {
                return bad(
                    "a trigger needs at_ms, request and after_tokens, or batch and after_done".into(),
                );
            }
            if let Some(b) = &t.batch {
                if !self.batches.iter().any(|x| &x.name == b) {
                    return bad(format!("trigger names no batch {b}"));
                }
            }
            if let Some(r) = &t.request {
                if !self.requests.iter().any(|x| &x.name == r) {
                    return bad(format!("trigger names no request group {r}"));
                }
            }
        }
        Ok(())
    }
}

/// One batch of chat requests.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchSpec {
    /// Name (fault triggers use it).
    pub name: String,
    /// The node whose HTTP API receives it.
    pub gateway: String,
    /// The node whose HTTP API it is polled on once created (its status,
    /// its output files, its usage), with the creating gateway's key:
    /// another gateway of the tenant takes the batch over. Default: `gateway`.
    #[serde(default)]
    pub poll: Option<String>,
    /// Requests in the file (1..=1000), `custom_id` `b<i>`.
    pub lines: u32,
    /// The model each line asks for (a processing task is one model's).
    #[serde(default = "default_model")]
    pub model: String,
    /// Each line's user message; `{i}` becomes the line's index, so the
    /// prompts differ.
    #[serde(default = "default_batch_prompt")]
    pub prompt: String,
    /// `max_tokens` of every line (greedy).
    #[serde(default = "default_tokens")]
    pub max_tokens: u32,
    /// Start offset from the beginning of traffic.
    #[serde(default)]
    pub start_ms: u64,
    /// How long the batch may take, from its start.
    #[serde(default = "default_batch_timeout")]
    pub timeout_s: u64,
    /// Send every line alone before the faults and require each answer of
    /// the batch to equal it.
    #[serde(default)]
    pub reference: bool,
}

fn default_model() -> String {
    "smollm2-135m-instruct".into()
}
fn default_batch_prompt() -> String {
    "Question {i}: name a colour and a number.".into()
}
fn default_tokens() -> u32 {
    16
}
fn default_batch_timeout() -> u64 {
    300
}

impl BatchSpec {
    /// The request body of line `i`.
    pub fn body(&self, i: u32) -> Value {
        json!({"model": self.model, "max_tokens": self.max_tokens, "temperature": 0,
               "messages": [{"role": "user", "content": self.prompt.replace("{i}", &i.to_string())}]})
    }

    /// The JSONL file: line `i` has `custom_id` `b<i>`.
    pub fn file(&self) -> String {
        let lines: Vec<String> = (0..self.lines)
            .map(|i| {
                json!({"custom_id": format!("b{i}"), "method": "POST",
                       "url": "/v1/chat/completions", "body": self.body(i)})
                .to_string()
            })
            .collect();
        lines.join("\n")
    }
}
