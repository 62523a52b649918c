//! The decode speed a worker advertises (`decode_tokens_per_s` in its
//! registration): measured once after load, on the engine that serves.

use std::time::Instant;

use super::{BatchEngine, Prompt, SeqEvent, SeqRequest};
use crate::error::{EngineError, Result};

/// The prompt of the measurement: short, so the figure is decode speed
/// and not prefill.
const PROMPT: &str = "The history of the printing press";

/// A prefix-cache salt no job has (jobs' salts are secrets their gateway
/// derives), so the measurement's blocks are never shared with a tenant.
const SALT: &str = "gcs-engine/measure-decode";

impl BatchEngine {
    /// Greedy single-stream decode rate in tokens/s over `tokens` tokens
    /// after the first (the first one carries the prefill). Run before any
    /// job is admitted, so nothing else shares the batch.
    pub fn measure_decode(&self, tokens: usize) -> Result<f64> {
        let ids = self.tokenizer().encode(PROMPT)?;
        let mut req = SeqRequest::new(Prompt::Tokens(ids), tokens.max(1) + 1);
        req.ignore_eos = true;
        req.tenant = SALT.into();
        let stream = self.submit(req)?;
        let (mut first, mut after_first) = (None::<Instant>, 0usize);
        loop {
            match stream.recv() {
                Some(SeqEvent::Delta { token_ids, .. }) => match first {
                    None => {
                        first = Some(Instant::now());
                        after_first += token_ids.len().saturating_sub(1);
                    }
                    Some(_) => after_first += token_ids.len(),
                },
                Some(SeqEvent::Done(_)) => break,
                Some(SeqEvent::Error(e)) => return Err(EngineError::InvalidRequest(e)),
                None => return Err(EngineError::Stopped),
            }
        }
        let secs = first.map_or(0.0, |t| t.elapsed().as_secs_f64());
        if after_first == 0 || secs <= 0.0 {
            return Ok(0.0);
        }
        Ok(after_first as f64 / secs)
    }
}
