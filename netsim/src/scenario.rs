//! The scenario file: a topology, client requests, a fault schedule, and
//! what the scenario expects beyond the universal checks. TOML, see
//! netsim/README.md for the format and netsim/scenarios/ for examples.

use std::path::Path;

use serde::Deserialize;

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
    pub requests: Vec<RequestSpec>,
    /// Faults.
    #[serde(default)]
    pub faults: Vec<FaultSpec>,
    /// Whole-run limits.
    #[serde(default)]
    pub limits: RunLimits,
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
}

impl Role {
    /// The `--role` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Gateway => "gateway",
            Role::Worker => "worker",
            Role::All => "all",
        }
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
    /// `stream_options.include_usage`.
    #[serde(default = "yes")]
    pub include_usage: bool,
    /// Slow client: bytes read per second.
    #[serde(default)]
    pub read_bytes_per_s: Option<u32>,
    /// Receive buffer for a slow client.
    #[serde(default)]
    pub rcvbuf: Option<u32>,
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
}

/// One fault.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    /// What.
    pub action: Action,
    /// A node name, or `busy_worker`: the `all` node whose worker runs a job.
    pub target: String,
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

impl Scenario {
    /// Reads and checks a scenario file.
    pub fn load(path: &Path) -> Result<Scenario, Error> {
        let text = std::fs::read_to_string(path)?;
        let s: Scenario = toml::from_str(&text)
            .map_err(|e| Error::Scenario(format!("{}: {e}", path.display())))?;
        s.validate()?;
        Ok(s)
    }

    fn validate(&self) -> Result<(), Error> {
        let node = |n: &str| self.nodes.iter().any(|x| x.name == n);
        let bad = |m: String| Err(Error::Scenario(format!("{}: {m}", self.name)));
        for r in &self.requests {
            if !self.nodes.iter().any(|x| x.name == r.gateway && x.role != Role::Worker) {
                return bad(format!("request {} names no HTTP node {}", r.name, r.gateway));
            }
        }
        for f in &self.faults {
            if f.target != "busy_worker" && !node(&f.target) {
                return bad(format!("fault target {} is not a node", f.target));
            }
            let t = &f.trigger;
            if t.at_ms.is_none() && (t.request.is_none() || t.after_tokens.is_none()) {
                return bad("a trigger needs at_ms, or request and after_tokens".into());
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
