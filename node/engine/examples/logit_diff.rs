//! Compare first-step probabilities with the llama.cpp fixture.
use gcs_engine::llama::KvCache;
use gcs_engine::{cpu_device, ChatMessage, Engine};

fn main() {
    let fx: serde_json::Value = serde_json::from_slice(
        &std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/smollm2_llamacpp.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let e = Engine::load(
        format!(
            "{}/.cache/gcs/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
            std::env::var("HOME").unwrap_or_else(|_| "/root".into())
        ),
        &cpu_device(),
    )
    .unwrap();
    let mut tot = 0.0;
    for p in fx["prompts"].as_array().unwrap() {
        let msgs: Vec<ChatMessage> = p["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let ids = e.prompt_tokens(&msgs).unwrap();
        let mut cache = KvCache::new();
        let l = e.step(&ids, &mut cache).unwrap();
        if std::env::var("CMP_EXACT").is_ok() {
            std::env::set_var("GCS_EXACT", "1");
            let mut c2 = KvCache::new();
            let l2 = e.step(&ids, &mut c2).unwrap();
            std::env::remove_var("GCS_EXACT");
            let d = l.iter().zip(&l2).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            println!("  quantized vs exact: max |dlogit| {d:.4}");
        }
        let max = l.iter().cloned().fold(f32::MIN, f32::max);
        let lse = max + l.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
        let mut err = 0.0f32;
        let mut s = String::new();
        for t in p["first_step_top5"].as_array().unwrap() {
            let id = t["id"].as_u64().unwrap() as usize;
            let want = t["logprob"].as_f64().unwrap() as f32;
            let got = l[id] - lse;
            err = err.max((got - want).abs());
            s.push_str(&format!(" {id}:{got:.3}/{want:.3}"));
        }
        tot += err;
        println!("prompt {} max|dlogprob| {:.4} {}", p["index"], err, s);
    }
    println!("mean max err {:.4}", tot / 20.0);
}
