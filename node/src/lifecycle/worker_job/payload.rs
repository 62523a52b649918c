//! The payload answer: checked (and, for an `encrypted_payload` job,
//! opened in memory) before the engine starts. A sealed payload that does
//! not open is answered with a signed failed result before the first token
//! (`gnus_payload_unreadable`), so the gateway requeues the job at once
//! instead of waiting out the lease — without a strike, since the fault may
//! be the gateway's. A continuation's answer is run only as the signed
//! job announces it (`continuation::accept`).

use gcs_protocol::{ErrorInfo, Hash32, NodeKey, ResultStatus};

use super::{continuation, Answer, Effect, Phase, Termination, WorkerJob};
use crate::jobs::sealed::{self, PayloadError};

impl WorkerJob {
    pub(super) fn on_payload(
        &mut self,
        a: Answer,
        now: u64,
        key: &NodeKey,
    ) -> Result<Vec<Effect>, gcs_protocol::ProtocolError> {
        let p = match a {
            Answer::Payload(p) => p,
            other => {
                return Ok(
                    self.end(Termination::Gateway(format!("payload fetch failed: {other:?}")))
                )
            }
        };
        if let Some(why) = p.problem() {
            return Ok(self.end(Termination::Gateway(why.into())));
        }
        let p = if sealed::is_sealed(&self.job) {
            let lease_id = self.lease.as_ref().map(|l| l.lease_id.clone()).unwrap_or_default();
            match sealed::open_leased(*p, &self.job, &lease_id, key) {
                Ok(p) => Box::new(p),
                Err(e) => return self.unreadable(e, now, key),
            }
        } else if Hash32::of(&p.body) == self.job.request.payload_ref.content_hash {
            p
        } else {
            return Ok(self.end(Termination::Gateway("payload hash mismatch".into())));
        };
        match continuation::accept(&self.job, &p) {
            Ok(c) => {
                // Numbering goes on from the fence's next sequence.
                self.seq = c.as_ref().map_or(0, |c| c.from_sequence);
                self.continuation = c;
            }
            Err(why) => return Ok(self.end(Termination::Gateway(why.to_string()))),
        }
        self.phase = Phase::Running;
        self.started_ms = now;
        Ok(vec![Effect::StartEngine(p)])
    }

    /// Tells the gateway, under the lease, that its sealed payload does not
    /// open here; the job then ends here as the gateway's fault.
    fn unreadable(
        &mut self,
        e: PayloadError,
        now: u64,
        key: &NodeKey,
    ) -> Result<Vec<Effect>, gcs_protocol::ProtocolError> {
        tracing::warn!(job_id = %self.job.job_id, error = %e, "sealed payload does not open");
        // No chunk was sent yet: the result says so (chunks_sent 0).
        let error = ErrorInfo {
            kind: "server_error".into(),
            code: PayloadError::CODE.into(),
            message: e.to_string(),
        };
        let termination = Termination::Gateway(e.to_string());
        self.send_result(termination, ResultStatus::Failed, None, Some(error), None, now, key)
    }
}
