//! The interface between a worker and its inference engine. The engine
//! implements it; the worker drives it on a blocking thread.

use std::sync::atomic::AtomicBool;

use gcs_protocol::{ApiRequestJob, ApiType, FinishReason, TokenLogprob};

/// `source.kind` of a job a gateway runs for an OpenAI batch (the API's is
/// `openai_compatible_api`, 26.11.1). Signed with the job, so neither a
/// client nor a relay can move work between the classes.
pub const SOURCE_KIND_BATCH: &str = "openai_batch";

/// Which work an engine serves first (specs/batch.md, "Priority on the
/// worker"): interactive sequences are admitted before batch ones and
/// preempt them for step slots and KV blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Priority {
    /// An API request a client waits on.
    #[default]
    Interactive,
    /// Work for an OpenAI batch or a processing subtask: fills idle capacity.
    Batch,
}

impl Priority {
    /// The class of a signed job, as its gateway announced it.
    pub fn of_job(job: &ApiRequestJob) -> Self {
        if job.source.kind == SOURCE_KIND_BATCH {
            Priority::Batch
        } else {
            Priority::Interactive
        }
    }
}

/// One request for the engine.
#[derive(Clone, Debug)]
pub struct ExecRequest {
    /// API surface.
    pub api_type: ApiType,
    /// Model id or alias as requested.
    pub model: String,
    /// The job's payload: a typed request as the gateway encoded it
    /// (`gcs_gateway::payload::JobRequest::encode`).
    pub body: Vec<u8>,
    /// The prefix-cache salt: a secret the job's gateway derives per
    /// tenant and sends only to the lease holder. Requests share cached
    /// prefixes only when their salts are equal.
    pub cache_salt: String,
    /// Derived by the worker from what the gateway signed
    /// ([`Priority::of_job`]; processing subtasks are always batch).
    pub priority: Priority,
}

/// How a run ended.
#[derive(Clone, Debug)]
pub struct ExecOutcome {
    /// Why it stopped.
    pub finish_reason: FinishReason,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Tokens generated.
    pub output_tokens: u64,
    /// Prompt tokens served from a reused KV prefix.
    pub cached_tokens: u64,
    /// The full OpenAI response body (for non-streamed answers).
    pub body: serde_json::Value,
}

/// Why the engine did not run a request to its end.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ExecError {
    /// The request cannot run on this engine as asked (a client error: a
    /// prompt longer than the context, a payload of another kind).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The engine failed or stopped.
    #[error("{0}")]
    Engine(String),
}

impl ExecError {
    /// A short stable label for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ExecError::Invalid(_) => "invalid_request",
            ExecError::Engine(_) => "engine",
        }
    }
}

/// `emit(text, tokens, token_ids, logprobs)` of [`Executor::run_with_ids`]:
/// false when the consumer is gone.
pub type EmitIds<'a> = dyn FnMut(&str, u32, &[u32], Vec<TokenLogprob>) -> bool + 'a;

/// An inference engine as a worker sees it.
pub trait Executor: Send + Sync + std::fmt::Debug + 'static {
    /// Runs one request, calling `emit(text, tokens, logprobs)` for each
    /// text delta (`logprobs` only when the request asked for them); `emit`
    /// returns false when the consumer is gone. Must return promptly
    /// (within one decode step) once `cancel` is set.
    fn run(
        &self,
        req: &ExecRequest,
        cancel: &AtomicBool,
        emit: &mut dyn FnMut(&str, u32, Vec<TokenLogprob>) -> bool,
    ) -> Result<ExecOutcome, ExecError>;

    /// Like [`Executor::run`], with the ids of the tokens behind each
    /// delta: `emit(text, tokens, token_ids, logprobs)`, `token_ids` empty
    /// when the engine does not report them (the default). The worker puts
    /// them in its chunks so that the gateway knows the delivered tokens
    /// (exact continuation, specs/lifecycle.md).
    fn run_with_ids(
        &self,
        req: &ExecRequest,
        cancel: &AtomicBool,
        emit: &mut EmitIds<'_>,
    ) -> Result<ExecOutcome, ExecError> {
        self.run(req, cancel, &mut |text, n, lps| emit(text, n, &[], lps))
    }

    /// Continues a stream another worker started (exact continuation,
    /// specs/lifecycle.md): the same job, after the tokens `from` says the
    /// client received; `emit` gets only what follows, and the outcome
    /// counts every token once. Engines that cannot replay refuse (the
    /// default).
    fn resume_with_ids(
        &self,
        req: &ExecRequest,
        from: &gcs_protocol::Continuation,
        cancel: &AtomicBool,
        emit: &mut EmitIds<'_>,
    ) -> Result<ExecOutcome, ExecError> {
        let _ = (req, from, cancel, emit);
        Err(ExecError::Invalid("this engine cannot continue another worker's stream".into()))
    }

    /// Free KV-cache capacity in tokens, advertised in registrations.
    fn free_kv_tokens(&self) -> u64 {
        0
    }

    /// Measured single-stream decode speed in tokens/s, advertised in
    /// registrations (`queue.decode_tokens_per_s`); 0: not measured.
    fn decode_tokens_per_s(&self) -> f64 {
        0.0
    }

    /// The GPU the engine runs on, advertised in registrations
    /// (`queue.accelerator`); None on a CPU.
    fn accelerator(&self) -> Option<gcs_protocol::Accelerator> {
        None
    }
}
