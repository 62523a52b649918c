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
/// [`Generation::constraint`], version 3 tools ([`Generation::tools`], the
/// `tool` role, [`Message::tool_calls`], [`Message::tool_call_id`]). Each
/// payload is written with the oldest version that has every field it
/// uses (a plain chat is still version 1, same bytes as before), so only
/// the jobs that need a newer worker are refused by older ones, instead of
/// being run without their constraint or tools.
pub const PAYLOAD_VERSION: u32 = 3;

/// The versions this build reads.
const READS: std::ops::RangeInclusive<u32> = 1..=PAYLOAD_VERSION;

/// Longest JSON Schema text a job may carry.
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;
/// Most tools one request may define (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;
/// Most bytes of all tool definitions together (names, descriptions,
/// parameter schemas): what the worker's grammar compiles is bounded by it.
pub const MAX_TOOLS_BYTES: usize = 256 * 1024;
/// Most calls one answer may make with `parallel_tool_calls`.
pub const MAX_PARALLEL_CALLS: u8 = 8;

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
    /// The number of alternatives per token: chat's `top_logprobs` with
    /// `logprobs: true`, a completion's `logprobs` (0 to 20); `None` when
    /// not asked.
    pub logprobs: Option<u8>,
    /// `response_format` json_object / json_schema: the worker compiles it
    /// into a grammar that masks the sampled tokens (absent in version 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub constraint: Option<Constraint>,
    /// `tools` with a `tool_choice` other than `none` (absent before
    /// version 3, and when the request has no tools to call).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Tools>,
}

/// The functions the model may call, and how it must choose.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tools {
    /// The definitions, in the request's order (at most [`MAX_TOOLS`]).
    pub functions: Vec<Tool>,
    /// `tool_choice`.
    pub choice: ToolChoice,
    /// Calls one answer may make: 1, or up to [`MAX_PARALLEL_CALLS`] with
    /// `parallel_tool_calls` (OpenAI's default is parallel).
    pub max_calls: u8,
}

/// One function definition (`tools[i].function`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tool {
    /// `^[a-zA-Z0-9_-]{1,64}$`.
    pub name: String,
    /// What the model is told the function does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The arguments' JSON Schema, JSON text (at most [`MAX_SCHEMA_BYTES`]).
    pub parameters: String,
    /// The schema did not compile and the tool is not `strict`: the
    /// arguments are held to any JSON object instead.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub loose: bool,
}

/// `tool_choice` when there is something to choose (`none` carries no tools).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoice {
    /// Text or calls, the model decides.
    Auto,
    /// At least one call, of any tool.
    Required,
    /// Calls of this tool only.
    Function(String),
}

/// One call an earlier assistant turn made (`messages[i].tool_calls[j]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, which the `tool` message answering it names.
    pub id: String,
    /// The function called.
    pub name: String,
    /// Its arguments as the client sent them (JSON text, not re-parsed).
    pub arguments: String,
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
    /// An assistant turn's calls (version 3; absent when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` turn: the call it answers (version 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A turn of plain text.
    pub fn text(role: Role, content: impl Into<String>) -> Self {
        Self { role, content: content.into(), tool_calls: vec![], tool_call_id: None }
    }

    /// Whether it needs payload version 3.
    fn uses_tools(&self) -> bool {
        self.role == Role::Tool || !self.tool_calls.is_empty() || self.tool_call_id.is_some()
    }
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
    /// A function's result (version 3).
    Tool,
}

impl Role {
    /// The name the chat template uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
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

impl Generation {
    /// Whether it needs payload version 3.
    fn uses_tools(&self) -> bool {
        self.tools.is_some()
            || matches!(&self.prompt, Prompt::Chat(m) if m.iter().any(Message::uses_tools))
    }
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
        let version = match self {
            JobRequest::Generation(g) if g.uses_tools() => 3,
            JobRequest::Generation(g) if g.constraint.is_some() => 2,
            _ => 1,
        };
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
            prompt: Prompt::Chat(vec![Message::text(Role::User, "hi")]),
            max_tokens: 7,
            sampling: Sampling {
                seed: Some(u64::MAX),
                logit_bias: [(2, -100.0), (1, 5.5)].into(),
                ..Sampling::default()
            },
            stop: vec!["\n".into()],
            logprobs: Some(3),
            constraint: None,
            tools: None,
        })
    }

    fn with_tools() -> JobRequest {
        let JobRequest::Generation(mut g) = constrained() else { unreachable!() };
        g.tools = Some(Tools {
            functions: vec![Tool {
                name: "f".into(),
                description: None,
                parameters: "{}".into(),
                loose: false,
            }],
            choice: ToolChoice::Function("f".into()),
            max_calls: 1,
        });
        JobRequest::Generation(g)
    }

    fn with_tool_turn() -> JobRequest {
        let JobRequest::Generation(mut g) = chat() else { unreachable!() };
        let Prompt::Chat(m) = &mut g.prompt else { unreachable!() };
        m.push(Message { tool_call_id: Some("call_1".into()), ..Message::text(Role::Tool, "7") });
        JobRequest::Generation(g)
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
    fn tools_or_a_tool_turn_make_version_3() {
        for r in [with_tools(), with_tool_turn()] {
            let bytes = r.encode().unwrap();
            assert_eq!(version_of(&bytes), 3);
            assert_eq!(JobRequest::decode(&bytes).unwrap(), r);
        }
        // The v1 bytes of a plain chat did not change with the new fields.
        assert_eq!(version_of(&chat().encode().unwrap()), 1);
    }

    #[test]
    fn a_request_survives_the_wire() {
        for r in [
            chat(),
            constrained(),
            with_tools(),
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
