//! The typed request a job carries: what the gateway signs (its payload,
//! canonical CBOR, hashed into the job) and what the worker decodes and
//! runs. The gateway's parser ([`crate::request`]) is the only place the
//! OpenAI body is read; the worker never sees it, so both sides apply one
//! set of rules.

use std::collections::BTreeMap;

use gcs_protocol::ApiType;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The wire format's newest version. Version 2 added
/// [`Generation::constraint`]; a payload without one is still written as
/// version 1 (same bytes as before), so only constrained jobs are refused
/// by workers that predate it, instead of being run unconstrained.
pub const PAYLOAD_VERSION: u32 = 2;

/// The versions this build reads.
const READS: std::ops::RangeInclusive<u32> = 1..=PAYLOAD_VERSION;

/// Longest JSON Schema text a job may carry.
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;

/// What a worker is asked to run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobRequest {
    /// Chat or legacy completion: text generation.
    Generation(Generation),
    /// Sentence embeddings.
    Embedding(Embedding),
}

/// A generation request, every parameter validated and defaulted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    /// Chat messages or one completion prompt.
    pub prompt: Prompt,
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// How tokens are drawn.
    pub sampling: Sampling,
    /// Stop strings (at most 4).
    pub stop: Vec<String>,
    /// Chat `logprobs: true`: the number of alternatives per token
    /// (`top_logprobs`, 0 to 20); `None` when not asked.
    pub logprobs: Option<u8>,
    /// `response_format` json_object / json_schema: the worker compiles it
    /// into a grammar that masks the sampled tokens (absent in version 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub constraint: Option<Constraint>,
}

/// The output's required shape: the constraint's source, not compiled
/// state, so any worker build compiles it against its own tokenizer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Constraint {
    /// Any JSON object.
    JsonObject,
    /// A JSON document valid against `schema` (JSON text, at most
    /// [`MAX_SCHEMA_BYTES`]), checked and compiled at admission.
    JsonSchema {
        /// The client's name for the schema (`json_schema.name`).
        name: String,
        /// The schema, JSON text.
        schema: String,
    },
}
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prompt {
    /// `/v1/chat/completions`: rendered with the model's chat template.
    Chat(Vec<Message>),
    /// `/v1/completions`: the raw prompt text.
    Text(String),
}

/// One chat turn, its text parts joined.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// The text (empty for an assistant turn with no content).
    pub content: String,
}

/// A chat role; `developer` arrives as [`Role::System`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Instructions.
    System,
    /// The user.
    User,
    /// The model's earlier turns.
    Assistant,
}

impl Role {
    /// The name the chat template uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// Sampling parameters with OpenAI's defaults filled in.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    /// 0 is greedy.
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// 0 disables it.
    pub top_k: u32,
    /// Minimum probability relative to the top token.
    pub min_p: f32,
    /// The request's seed; `None` lets the worker pick one.
    pub seed: Option<u64>,
    /// Penalty by how often a token appeared.
    pub frequency_penalty: f32,
    /// Penalty for any token that appeared.
    pub presence_penalty: f32,
    /// Token id to bias (a map, so the encoding is deterministic).
    pub logit_bias: BTreeMap<u32, f32>,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: BTreeMap::new(),
        }
    }
}

/// An embeddings request (one batch of the client's inputs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Embedding {
    /// Non-empty texts, in order.
    pub inputs: Vec<String>,
}

/// Why a payload cannot be encoded or decoded.
#[derive(Debug, Error)]
pub enum PayloadError {
    /// Serialisation failed.
    #[error("cannot encode the job payload: {0}")]
    Encode(String),
    /// Not a payload of this format.
    #[error("malformed job payload: {0}")]
    Malformed(String),
    /// Written by a gateway of another format version.
    #[error(
        "job payload version {found} is not supported (this node reads 1 to {PAYLOAD_VERSION})"
    )]
    Version {
        /// The version the payload states.
        found: u32,
    },
}

/// The envelope on the wire: the version first, so any later format can be
/// recognised before its body is read.
#[derive(Serialize, Deserialize)]
struct Wire<R> {
    version: u32,
    request: R,
}

#[derive(Deserialize)]
struct VersionOnly {
    version: u32,
}

impl JobRequest {
    /// The API surface this request belongs to.
    pub fn api_type(&self) -> ApiType {
        match self {
            JobRequest::Generation(g) => match g.prompt {
                Prompt::Chat(_) => ApiType::ChatCompletion,
                Prompt::Text(_) => ApiType::Completion,
            },
            JobRequest::Embedding(_) => ApiType::Embedding,
        }
    }

    /// The payload bytes: canonical CBOR, so equal requests hash equal
    /// (idempotency keys compare these hashes).
    pub fn encode(&self) -> Result<Vec<u8>, PayloadError> {
        let constrained = matches!(self, JobRequest::Generation(g) if g.constraint.is_some());
        let version = if constrained { PAYLOAD_VERSION } else { 1 };
        let wire = Wire { version, request: self };
        gcs_protocol::codec::to_canonical_bytes(&wire)
            .map_err(|e| PayloadError::Encode(e.to_string()))
    }

    /// Reads payload bytes written by [`JobRequest::encode`].
    pub fn decode(bytes: &[u8]) -> Result<Self, PayloadError> {
        let malformed = |e: gcs_protocol::ProtocolError| PayloadError::Malformed(e.to_string());
        let v: VersionOnly = gcs_protocol::codec::from_cbor_bytes(bytes).map_err(malformed)?;
        if !READS.contains(&v.version) {
            return Err(PayloadError::Version { found: v.version });
        }
        let wire: Wire<JobRequest> =
            gcs_protocol::codec::from_cbor_bytes(bytes).map_err(malformed)?;
        Ok(wire.request)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn chat() -> JobRequest {
        JobRequest::Generation(Generation {
            prompt: Prompt::Chat(vec![Message { role: Role::User, content: "hi".into() }]),
            max_tokens: 7,
            sampling: Sampling {
                seed: Some(u64::MAX),
                logit_bias: [(2, -100.0), (1, 5.5)].into(),
                ..Sampling::default()
            },
            stop: vec!["\n".into()],
            logprobs: Some(3),
            constraint: None,
        })
    }

    fn constrained() -> JobRequest {
        let JobRequest::Generation(mut g) = chat() else { unreachable!() };
        g.constraint = Some(Constraint::JsonSchema {
            name: "p".into(),
            schema: r#"{"type":"object"}"#.into(),
        });
        JobRequest::Generation(g)
    }

    fn version_of(bytes: &[u8]) -> u32 {
        gcs_protocol::codec::from_cbor_bytes::<VersionOnly>(bytes).unwrap().version
    }

    #[test]
    fn only_a_constrained_job_is_written_as_version_2() {
        assert_eq!(version_of(&chat().encode().unwrap()), 1);
        let bytes = constrained().encode().unwrap();
        assert_eq!(version_of(&bytes), 2);
        assert_eq!(JobRequest::decode(&bytes).unwrap(), constrained());
        // A version-1 payload (no constraint field at all) still reads.
        let JobRequest::Generation(g) = chat() else { unreachable!() };
        let v1 = gcs_protocol::codec::to_canonical_bytes(&Wire {
            version: 1,
            request: JobRequest::Generation(g),
        })
        .unwrap();
        assert_eq!(JobRequest::decode(&v1).unwrap(), chat());
    }

    #[test]
    fn a_request_survives_the_wire() {
        for r in [
            chat(),
            constrained(),
            JobRequest::Embedding(Embedding { inputs: vec!["a".into(), "b".into()] }),
        ] {
            assert_eq!(JobRequest::decode(&r.encode().unwrap()).unwrap(), r);
        }
        assert_eq!(chat().api_type(), ApiType::ChatCompletion);
    }

    #[test]
    fn equal_requests_encode_to_equal_bytes() {
        assert_eq!(chat().encode().unwrap(), chat().encode().unwrap());
    }

    #[test]
    fn another_version_or_garbage_is_refused() {
        let other = Wire { version: PAYLOAD_VERSION + 1, request: chat() };
        let bytes = gcs_protocol::codec::to_canonical_bytes(&other).unwrap();
        assert!(matches!(JobRequest::decode(&bytes),
            Err(PayloadError::Version { found }) if found == PAYLOAD_VERSION + 1));
        let json = br#"{"messages":[{"role":"user","content":"hi"}]}"#;
        assert!(matches!(JobRequest::decode(json), Err(PayloadError::Malformed(_))));
    }
}
