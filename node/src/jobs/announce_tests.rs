use super::*;
use gcs_engine::paged::{tenant_salt, BlockManager};
use gcs_protocol::{ApiType, NodeKey, Routing};

fn spec(privacy: PrivacyLevel) -> JobSpec {
    let mut routing = Routing::public();
    routing.privacy_mode = privacy;
    JobSpec {
        api_type: ApiType::ChatCompletion,
        model: "gnus-auto".into(),
        stream: true,
        body: b"the prompt".to_vec(),
        tenant_id: "tenant-acme".into(),
        project_id: "project-rocket".into(),
        api_key_id: "gcskey_secretive".into(),
        idempotency_key: "client-idem-4711".into(),
        limits: JobLimits::default(),
        max_output_tokens: 16,
        routing,
        batch_id: None,
        parent: None,
        price_percent: None,
    }
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[test]
fn an_announcement_carries_no_project_key_or_idempotency_key() {
    let key = NodeKey::from_seed([5; 32]);
    let s = spec(PrivacyLevel::Standard);
    let job = build_job(&s, &key, &s.body, 1_783_468_800_000).unwrap();
    let wire = gcs_protocol::encode(&job).unwrap();
    let opened = gcs_protocol::open(&wire, job.created_at_ms, &gcs_protocol::Limits::default());
    assert!(opened.is_ok(), "a valid signed job: {opened:?}");
    for secret in ["project-rocket", "gcskey_secretive", "client-idem-4711", "the prompt"] {
        assert!(!contains(&wire, secret), "{secret} is on the wire");
    }
    assert!(contains(&wire, "tenant-acme"), "a standard job names its tenant");
    assert_eq!(job.idempotency_key, idempotency_token(&key, "tenant-acme", "client-idem-4711"));
    let other = NodeKey::from_seed([6; 32]);
    assert_ne!(job.idempotency_key, idempotency_token(&other, "tenant-acme", "client-idem-4711"));
}

#[test]
fn a_metadata_minimized_job_names_only_a_per_job_tenant_reference() {
    let key = NodeKey::from_seed([5; 32]);
    let s = spec(PrivacyLevel::MetadataMinimized);
    let a = build_job(&s, &key, &s.body, 1_783_468_800_000).unwrap();
    let b = build_job(&s, &key, &s.body, 1_783_468_800_001).unwrap();
    for job in [&a, &b] {
        let wire = gcs_protocol::encode(job).unwrap();
        assert!(!contains(&wire, "tenant-acme"), "the tenant is not on the wire");
        assert!(job.tenant.tenant_id.starts_with("tref_"));
    }
    assert_ne!(a.tenant.tenant_id, b.tenant.tenant_id, "two jobs cannot be linked by it");
}

#[test]
fn the_gateway_keeps_billing_locally_in_a_versioned_record() {
    let r = GatewayRecord::of(&spec(PrivacyLevel::MetadataMinimized));
    let bytes = gcs_protocol::codec::to_canonical_bytes(&r).unwrap();
    let back = GatewayRecord::decode(&bytes).unwrap();
    assert_eq!(back.billing.api_key_id, "gcskey_secretive");
    assert_eq!(back.billing.project_id, "project-rocket");
    let mut future = r.clone();
    future.version = RECORD_VERSION + 1;
    let bytes = gcs_protocol::codec::to_canonical_bytes(&future).unwrap();
    assert!(GatewayRecord::decode(&bytes).is_none(), "another version is not guessed at");
    assert!(GatewayRecord::decode(b"raw body bytes").is_none());
}

#[test]
fn cache_salts_are_per_gateway_and_tenant_secrets() {
    let (g1, g2) = (NodeKey::from_seed([5; 32]), NodeKey::from_seed([6; 32]));
    assert_eq!(cache_salt(&g1, "acme"), cache_salt(&g1, "acme"), "stable: a tenant's cache works");
    assert_ne!(cache_salt(&g1, "acme"), cache_salt(&g1, "umbrella"));
    assert_ne!(cache_salt(&g1, "acme"), cache_salt(&g2, "acme"), "another gateway, another salt");
    assert_ne!(cache_salt(&g1, "acme").to_vec(), blake3::hash(b"acme").as_bytes().to_vec());
}

#[test]
fn two_gateways_jobs_with_one_system_prompt_share_no_cache_hits() {
    // The engine keys its prefix cache on the salt the payload carries
    // (`LeasedPayload::salt_hex` → `SeqRequest::tenant` → `tenant_salt`).
    let (g1, g2) = (NodeKey::from_seed([5; 32]), NodeKey::from_seed([6; 32]));
    let salt = |g: &NodeKey, t: &str| {
        let p = crate::jobs::wire::LeasedPayload::new(vec![], t.into(), cache_salt(g, t));
        tenant_salt(&p.salt_hex())
    };
    let system_prompt: Vec<u32> = (0..80).collect();
    let mut m = BlockManager::new(64);
    assert_eq!(m.admit(1, salt(&g1, "acme"), &system_prompt).unwrap(), 0);
    m.commit(1, system_prompt.len()).unwrap();
    assert!(m.admit(2, salt(&g1, "acme"), &system_prompt).unwrap() > 0, "same gateway and tenant");
    assert_eq!(
        m.admit(3, salt(&g2, "acme"), &system_prompt).unwrap(),
        0,
        "a probe from another gateway"
    );
    assert_eq!(m.admit(4, salt(&g1, "umbrella"), &system_prompt).unwrap(), 0, "another tenant");
}

#[test]
fn an_encrypted_job_announces_a_sealed_reference_to_its_commitment() {
    let key = NodeKey::from_seed([5; 32]);
    let s = spec(PrivacyLevel::EncryptedPayload);
    let c = crate::jobs::sealed::committed(&s.body).unwrap();
    let job = build_job(&s, &key, &c, 1_000).unwrap();
    assert!(job.request.payload_ref.encrypted);
    assert_eq!(job.request.payload_ref.content_hash, Hash32::of(&c));
    assert_ne!(job.request.payload_ref.content_hash, Hash32::of(&s.body), "no hash of the clear body");
    assert!(!contains(&gcs_protocol::encode(&job).unwrap(), "the prompt"));
    let plain = build_job(&spec(PrivacyLevel::Standard), &key, &s.body, 1_000).unwrap();
    assert!(!plain.request.payload_ref.encrypted);
}

#[test]
fn a_version_1_record_reads_as_not_sealed() {
    let r = GatewayRecord::of(&spec(PrivacyLevel::Standard));
    #[derive(serde::Serialize)]
    struct V1<'a> {
        version: u16,
        billing: &'a TenantRef,
        #[serde(with = "serde_bytes")]
        body: &'a [u8],
    }
    let v1 = V1 { version: 1, billing: &r.billing, body: &r.body };
    let back = GatewayRecord::decode(&gcs_protocol::codec::to_canonical_bytes(&v1).unwrap()).unwrap();
    assert!(!back.sealed);
    assert_eq!(back.body, b"the prompt");
}
