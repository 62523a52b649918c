//! all-MiniLM-L6-v2 embeddings against the float64 reference fixture.

mod common;

use gcs_engine::bert::Embedder;
use gcs_engine::cpu_device;
use serde_json::Value;

fn cosine(a: &[f32], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y).sum();
    let na: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn vecf(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

#[test]
fn embeddings_match_reference() {
    let (Some(dir), Some(fx)) = (common::minilm_dir(), common::fixture("minilm_reference.json"))
    else {
        return;
    };
    let emb = Embedder::load(&dir, &cpu_device()).unwrap();
    let sentences: Vec<&str> =
        fx["sentences"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    let want: Vec<Vec<f64>> = fx["embeddings"].as_array().unwrap().iter().map(vecf).collect();

    // One at a time (no padding).
    let mut worst = 1.0f64;
    for (i, s) in sentences.iter().enumerate() {
        let got = emb.embed(&[s]).unwrap().remove(0);
        assert_eq!(got.len(), 384);
        let norm: f32 = got.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "L2-normalised");
        let c = cosine(&got, &want[i]);
        worst = worst.min(c);
        assert!(c >= 0.999, "sentence {i}: cosine {c}");
    }
    // Batched with padding: must equal the unpadded results.
    let idx: Vec<usize> = fx["batched"]["indices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let batch: Vec<&str> = idx.iter().map(|&i| sentences[i]).collect();
    let got = emb.embed(&batch).unwrap();
    for (k, &i) in idx.iter().enumerate() {
        let c = cosine(&got[k], &want[i]);
        worst = worst.min(c);
        assert!(c >= 0.999, "batched sentence {i}: cosine {c}");
    }
    // All ten at once as well.
    let all = emb.embed(&sentences).unwrap();
    for (i, g) in all.iter().enumerate() {
        let c = cosine(g, &want[i]);
        worst = worst.min(c);
        assert!(c >= 0.999, "full batch sentence {i}: cosine {c}");
    }
    eprintln!("embeddings: worst cosine vs reference {worst:.7}");
}

#[test]
fn bert_token_ids_match_reference() {
    let (Some(dir), Some(fx)) = (common::minilm_dir(), common::fixture("minilm_reference.json"))
    else {
        return;
    };
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    for (s, ids) in
        fx["sentences"].as_array().unwrap().iter().zip(fx["token_ids"].as_array().unwrap())
    {
        let want: Vec<u32> =
            ids.as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let mut t = tok.clone();
        t.with_padding(None);
        t.with_truncation(Some(tokenizers::TruncationParams {
            max_length: 256,
            ..Default::default()
        }))
        .unwrap();
        let got = t.encode(s.as_str().unwrap(), true).unwrap().get_ids().to_vec();
        assert_eq!(got, want);
    }
}
