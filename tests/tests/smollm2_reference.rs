//! The real SmolLM2-135M-Instruct (pulled from PyPI and imported from its Q4_1 GGUF) against HF
//! transformers loading the same GGUF (`scripts/reference/smollm2_greedy.py` made the fixture):
//! identical prompt token ids (plain and chat-template prompts) and identical greedy output ids,
//! including a prompt over 1000 tokens prefilled in many chunks over many blocks.

use std::time::Duration;

use serde_json::Value;
use tandem_engine::Engine;
use tandem_engine::engine::{EngineConfig, Prompt};
use tandem_engine::sampling::SamplingParams;
use tandem_engine::tokenizer::ChatMessage;
use tandem_tests::{fixture, run_tandem, smollm2_dir};

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn prompt_of(case: &Value) -> Prompt {
    if case["chat"].as_bool().unwrap_or(false) {
        Prompt::Chat(
            case["messages"]
                .as_array()
                .expect("messages")
                .iter()
                .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
                .collect(),
        )
    } else {
        Prompt::Text(case["rendered_prompt"].as_str().expect("prompt").to_string())
    }
}

fn fixture_json() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("smollm2_greedy.json")).unwrap()).unwrap()
}

#[test]
fn greedy_output_equals_transformers_on_every_fixture_prompt() {
    let fx = fixture_json();
    // A small step budget forces the long prompt through many chunks of prefill.
    let cfg = EngineConfig { max_num_batched_tokens: 256, ..EngineConfig::default() };
    let mut engine = Engine::load(&smollm2_dir(), cfg).unwrap();
    let cases = fx["cases"].as_array().unwrap();
    assert!(cases.iter().any(|c| c["prompt_len"].as_u64().unwrap() > 1000), "the fixture must hold a >1000-token prompt");
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let prompt = prompt_of(case);
        assert_eq!(engine.tokenize(&prompt).unwrap(), ids(&case["prompt_ids"]), "{name}: prompt token ids");
        let want = ids(&case["output_ids"]);
        let params = SamplingParams { max_tokens: want.len(), temperature: 0.0, ..SamplingParams::default() };
        let got = engine.generate(&prompt, params).unwrap().remove(0);
        assert_eq!(got.token_ids, want, "{name}: greedy output ids");
        assert_eq!(got.text, case["output_text_skip_special"].as_str().unwrap(), "{name}: text");
    }
    assert!(!engine.has_unfinished());
    assert_eq!(engine.scheduler().pool().num_free(), engine.scheduler().pool().num_blocks());
}

#[test]
fn cli_generate_prints_exactly_the_reference_completion() {
    let fx = fixture_json();
    let dir = smollm2_dir();
    let dir = dir.to_str().unwrap();
    for case in fx["cases"].as_array().unwrap().iter().filter(|c| c["prompt_len"].as_u64().unwrap() < 100) {
        let max = case["output_ids"].as_array().unwrap().len().to_string();
        let mut args = vec!["generate", "--model", dir, "--max-tokens", &max, "--temperature", "0"];
        if case["chat"].as_bool().unwrap() {
            args.push("--chat");
            if let Some(system) = case["system"].as_str() {
                args.extend(["--system", system]);
            }
            args.push(case["messages"].as_array().unwrap().last().unwrap()["content"].as_str().unwrap());
        } else {
            args.push(case["rendered_prompt"].as_str().unwrap());
        }
        let out = run_tandem(&args, Duration::from_secs(300));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let want = format!("{}\n", case["output_text_skip_special"].as_str().unwrap());
        assert_eq!(String::from_utf8_lossy(&out.stdout), want, "{}", case["name"]);
    }
}
