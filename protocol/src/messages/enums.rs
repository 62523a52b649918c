//! Enumerations shared by several messages.

use serde::{Deserialize, Serialize};

macro_rules! wire_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $variant:ident => $tag:literal),* $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub enum $name {
            $(
                $(#[$vm])*
                #[serde(rename = $tag)]
                $variant,
            )*
        }
        impl $name {
            /// Every value.
            pub const ALL: &'static [$name] = &[$($name::$variant),*];
            /// The wire name.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $tag),* }
            }
        }
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

wire_enum!(
    /// API job states (26.13.1).
    JobState {
        /// Built by the gateway, not yet announced.
        Created => "created",
        /// Announced on a job topic.
        Published => "published",
        /// At least one claim arrived; none accepted yet.
        Claiming => "claiming",
        /// A claim was accepted.
        Claimed => "claimed",
        /// The lease was granted and acknowledged.
        Accepted => "accepted",
        /// The worker is running it.
        Executing => "executing",
        /// Chunks are flowing.
        Streaming => "streaming",
        /// Child processing jobs were created.
        ChildJobsCreated => "child_jobs_created",
        /// Waiting for child jobs.
        WaitingChildJobs => "waiting_child_jobs",
        /// Aggregating child results.
        Aggregating => "aggregating",
        /// Terminal: finished.
        Completed => "completed",
        /// Terminal: failed.
        Failed => "failed",
        /// Terminal: cancelled.
        Cancelled => "cancelled",
        /// Terminal: expired before completion.
        Expired => "expired",
        /// Back in the queue, waiting for a new claim.
        Requeued => "requeued",
    }
);

impl JobState {
    /// No transition leaves a terminal state.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Completed | JobState::Failed | JobState::Cancelled | JobState::Expired
        )
    }

    /// Whether `self -> next` is a legal lifecycle transition (26.13.2). Any
    /// live state may end (failed, cancelled, expired); requeue returns a job
    /// to claiming; the rest follow the lifecycle flow in order.
    pub fn can_transition_to(self, next: JobState) -> bool {
        use JobState::*;
        if self.is_terminal() {
            return false;
        }
        if matches!(next, Failed | Cancelled | Expired) {
            return true;
        }
        matches!(
            (self, next),
            (Created, Published)
                | (Published | Requeued, Claiming | Claimed)
                | (Claiming, Claimed)
                | (Claimed, Accepted)
                | (Accepted, Executing)
                | (Executing, Streaming | ChildJobsCreated | Completed)
                | (Streaming, Completed)
                | (ChildJobsCreated, WaitingChildJobs)
                | (WaitingChildJobs, Aggregating)
                | (Aggregating, Streaming | Completed)
                | (Published | Claiming | Claimed | Accepted | Executing | Streaming, Requeued)
                | (ChildJobsCreated | WaitingChildJobs | Aggregating, Requeued)
        )
    }
}

wire_enum!(
    /// Routing modes (26.11.3).
    RoutingMode {
        /// Public GNUS nodes.
        Public => "public",
        /// Only tenant-approved private nodes.
        Private => "private",
        /// Private nodes first, then public if policy allows.
        Hybrid => "hybrid",
        /// Only inside the local swarm.
        LocalOnly => "local_only",
        /// Only on the gateway or its directly attached node.
        GatewayLocal => "gateway_local",
    }
);

wire_enum!(
    /// Prompt privacy levels (26.20.3).
    PrivacyLevel {
        /// Payload may be fetched by the lease holder.
        Standard => "standard",
        /// Payload is encrypted to the lease holder.
        EncryptedPayload => "encrypted_payload",
        /// Only the tenant's private pool may execute.
        PrivatePool => "private_pool",
        /// Only the local swarm may execute.
        LocalOnly => "local_only",
        /// Publish as little metadata as possible.
        MetadataMinimized => "metadata_minimized",
    }
);

wire_enum!(
    /// Claim policies (26.18).
    ClaimPolicy {
        /// MVP: the first valid claim wins.
        FirstValidClaim => "first_valid_claim",
        /// Later.
        WeightedFairClaim => "weighted_fair_claim",
        /// Later.
        ReputationWeightedClaim => "reputation_weighted_claim",
        /// Later.
        LatencyWeightedClaim => "latency_weighted_claim",
        /// Later.
        VerificationRequiredMultiClaim => "verification_required_multi_claim",
    }
);

wire_enum!(
    /// Payload storage modes (26.11.2).
    PayloadMode {
        /// Carried in the job.
        Inline => "inline",
        /// Carried in the job, encrypted.
        EncryptedInline => "encrypted_inline",
        /// In the keyspace under a key.
        CrdtRef => "crdt_ref",
        /// In IPFS by CID.
        IpfsCid => "ipfs_cid",
        /// Held by the gateway; fetched by the lease holder over a direct stream.
        GatewayRef => "gateway_ref",
        /// In tenant-private storage.
        TenantPrivateRef => "tenant_private_ref",
    }
);

wire_enum!(
    /// OpenAI API surface a job serves.
    ApiType {
        /// `/v1/chat/completions`.
        ChatCompletion => "chat.completion",
        /// `/v1/completions`.
        Completion => "text_completion",
        /// `/v1/embeddings`.
        Embedding => "embedding",
    }
);

wire_enum!(
    /// Node status in a registration.
    NodeStatus {
        /// Accepting work.
        Online => "online",
        /// Finishing current work, accepting none.
        Draining => "draining",
        /// Gone (graceful shutdown).
        Offline => "offline",
    }
);

wire_enum!(
    /// Why a stream chunk ends a choice.
    FinishReason {
        /// Natural stop or stop sequence.
        Stop => "stop",
        /// max tokens reached.
        Length => "length",
        /// Ended by an error after partial output.
        Error => "error",
        /// Content filter.
        ContentFilter => "content_filter",
    }
);

wire_enum!(
    /// Cancellation reasons (26.13.3, 26.16.7).
    CancellationReason {
        /// The HTTP client went away.
        ClientDisconnected => "client_disconnected",
        /// The client could not keep up with the stream.
        ClientBackpressure => "client_backpressure",
        /// First-token, idle or wall-clock timeout.
        Timeout => "timeout",
        /// Tenant quota exceeded mid-flight.
        QuotaExceeded => "quota_exceeded",
        /// An administrator cancelled it.
        Admin => "admin",
        /// The gateway caught the worker misbehaving.
        InvalidWorkerBehavior => "invalid_worker_behavior",
    }
);

wire_enum!(
    /// Requeue reasons (26.19.1).
    RequeueReason {
        /// No valid claim before claim_timeout.
        NoValidClaim => "no_valid_claim",
        /// The winner never acknowledged its lease.
        WorkerNoAck => "worker_no_ack",
        /// The lease expired.
        WorkerTimeout => "worker_timeout",
        /// The worker failed before its first token.
        WorkerFailedBeforeFirstToken => "worker_failed_before_first_token",
        /// The worker disconnected.
        WorkerDisconnected => "worker_disconnected",
        /// The worker returned an invalid result.
        InvalidResult => "invalid_result",
        /// The worker violated policy.
        PolicyViolation => "policy_violation",
        /// Child processing jobs failed.
        ChildJobsFailed => "child_jobs_failed",
        /// The stream stalled beyond its timeout.
        StreamStalled => "stream_stalled",
        /// The result signature did not verify.
        ResultSignatureInvalid => "result_signature_invalid",
        /// The holder could not open the sealed payload
        /// (`encrypted_payload`): the fault may be the gateway's, so no
        /// strike, but the holder is left out of the job's next round.
        PayloadUnreadable => "payload_unreadable",
    }
);

wire_enum!(
    /// Why a claim was rejected: one per count of 26.12.1.
    ClaimRejectReason {
        /// The job is unknown to the gateway.
        JobNotFound => "job_not_found",
        /// The job expired.
        JobExpired => "job_expired",
        /// The claimant's registration is missing or stale.
        RegistrationStale => "registration_stale",
        /// The node does not take API request jobs of this type.
        JobTypeUnsupported => "job_type_unsupported",
        /// The node does not serve the model or alias.
        ModelUnsupported => "model_unsupported",
        /// The job streams and the node cannot.
        StreamingUnsupported => "streaming_unsupported",
        /// The node's context is too small.
        ContextTooSmall => "context_too_small",
        /// Routing or privacy policy excludes the node.
        PolicyDenied => "policy_denied",
        /// The node has no free capacity.
        NoCapacity => "no_capacity",
        /// The claim's signature does not verify.
        BadSignature => "bad_signature",
        /// Another claim already won, or the job is finished.
        AlreadyClaimed => "already_claimed",
        /// Hybrid routing: the tenant's private nodes have the first claim
        /// window; a public node may claim the job when it is re-announced.
        PrivateFirst => "private_first",
        /// The job is an exact continuation and the claimant's
        /// registration does not advertise the engine build and model file
        /// hash the announcement names (specs/lifecycle.md).
        ContinuationMismatch => "continuation_mismatch",
    }
);

wire_enum!(
    /// Final result status (26.17).
    ResultStatus {
        /// Finished normally.
        Completed => "completed",
        /// Failed.
        Failed => "failed",
        /// Stopped by a cancellation.
        Cancelled => "cancelled",
    }
);

wire_enum!(
    /// Job kinds of the unified queue wrapper (26.22.3).
    JobKind {
        /// 0.
        Unspecified => "GCS_JOB_KIND_UNSPECIFIED",
        /// 1.
        ProcessingChunk => "GCS_JOB_KIND_PROCESSING_CHUNK",
        /// 2.
        ApiRequest => "GCS_JOB_KIND_API_REQUEST",
        /// 3.
        RouterPlan => "GCS_JOB_KIND_ROUTER_PLAN",
        /// 4.
        Retrieval => "GCS_JOB_KIND_RETRIEVAL",
        /// 5.
        Embedding => "GCS_JOB_KIND_EMBEDDING",
        /// 6.
        Verification => "GCS_JOB_KIND_VERIFICATION",
        /// 7.
        Aggregation => "GCS_JOB_KIND_AGGREGATION",
        /// 8.
        Maintenance => "GCS_JOB_KIND_MAINTENANCE",
        /// 9.
        Retraining => "GCS_JOB_KIND_RETRAINING",
    }
);

impl JobKind {
    /// The protobuf enum number of 26.22.3.
    pub fn number(self) -> u32 {
        Self::ALL.iter().position(|k| *k == self).unwrap_or(0) as u32
    }
}
