//! The end of a run on this worker: its signed final result, under its
//! lease — what it meters, and how an engine failure is reported (a
//! refusal of the request itself as the client's error, a continuation's
//! refused replay as this worker's).

use gcs_protocol::{
    sign, Attestation, ErrorInfo, FinalResult, Hash32, MessageType, Metering, NodeKey,
    ResponseBody, ResultStatus, PROTOCOL_VERSION,
};

use super::{Effect, Phase, Termination, WorkerJob, MAX_ERROR_CHARS, REFUSED_CODE};
use crate::jobs::executor::{ExecError, ExecOutcome};

impl WorkerJob {
    /// Signs and sends the final result.
    pub(super) fn report(
        &mut self,
        now: u64,
        key: &NodeKey,
    ) -> Result<Vec<Effect>, gcs_protocol::ProtocolError> {
        let compute_ms = self.engine_done_ms.saturating_sub(self.started_ms);
        let first_token_ms = self.first_token_ms.unwrap_or(0);
        // A continuation's holder meters the whole completion, the
        // delivered prefix included (its engine counts every token once),
        // and the prompt once: the gateway's one usage record is built
        // from the last holder's result (specs/lifecycle.md).
        let metering = |o: &ExecOutcome| Metering {
            input_tokens: o.input_tokens,
            output_tokens: o.output_tokens,
            tokens_sent_to_client: 0,
            cached_tokens: o.cached_tokens.min(o.input_tokens),
            compute_ms,
            first_token_ms,
            child_jobs: 0,
            cost_gnus: "0".into(),
        };
        let error = |kind: &str, code: &str, message: &str| ErrorInfo {
            kind: kind.into(),
            code: code.into(),
            message: message.chars().take(MAX_ERROR_CHARS).collect(),
        };
        let (termination, status, response, error, metering) = match &self.outcome {
            Some(Ok(o)) if !self.stopped => (
                Termination::Completed,
                ResultStatus::Completed,
                Some(ResponseBody {
                    format: format!("openai.{}", self.job.request.api_type),
                    body: o.body.clone(),
                }),
                None,
                Some(metering(o)),
            ),
            // Cancelled: the result still meters what the engine generated
            // (more than the client got), so the gateway can bill it.
            Some(Ok(o)) => (
                Termination::Cancelled,
                ResultStatus::Cancelled,
                None,
                Some(error("cancelled", "gnus_cancelled", "cancelled")),
                Some(metering(o)),
            ),
            // A refusal of the request itself is a client error: the
            // gateway answers it at once instead of requeueing the job.
            Some(Err(e)) => (
                Termination::EngineFailed(e.clone()),
                ResultStatus::Failed,
                None,
                Some(match e {
                    // A continuation's refusal is this engine's, not the
                    // client's: another worker (or the first) ran it fine.
                    ExecError::Invalid(m) if self.continuation.is_some() => {
                        error("server_error", REFUSED_CODE, m)
                    }
                    ExecError::Invalid(m) => ErrorInfo::invalid_request(m.as_str()),
                    ExecError::Engine(m) => error("server_error", "gnus_engine_error", m),
                }),
                None,
            ),
            None => return Ok(vec![]),
        };
        self.send_result(termination, status, response, error, metering, now, key)
    }

    /// Signs this run's final result, under its lease, and moves to
    /// reporting it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn send_result(
        &mut self,
        termination: Termination,
        status: ResultStatus,
        response: Option<ResponseBody>,
        error: Option<ErrorInfo>,
        metering: Option<Metering>,
        now: u64,
        key: &NodeKey,
    ) -> Result<Vec<Effect>, gcs_protocol::ProtocolError> {
        let result_hash = Hash32::of(&serde_json::to_vec(&response).unwrap_or_default());
        let mut r = FinalResult {
            message_type: MessageType::FinalResult,
            version: PROTOCOL_VERSION,
            job_id: self.job.job_id.clone(),
            node_id: key.node_id(),
            lease_id: self.lease.as_ref().map(|l| l.lease_id.clone()),
            status,
            response,
            error,
            metering,
            attestation: Some(Attestation {
                claim_id: self.claim.claim_id.clone(),
                registration_id: self.claim.registration_id.clone(),
                result_hash,
            }),
            chunks_sent: self.seq,
            created_at_ms: now,
            signature: None,
        };
        sign(&mut r, key)?;
        self.termination = Some(termination);
        self.phase = Phase::Reporting;
        self.next_renewal_ms = None;
        Ok(vec![Effect::SendResult(Box::new(r))])
    }
}
