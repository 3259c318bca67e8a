//! Batch independence, prefix caching, n > 1 and the prefill/decode roles on the real model:
//! whatever else runs in a step, a request gets exactly the tokens it gets alone.

use std::collections::HashMap;

use tandem_engine::Engine;
use tandem_engine::engine::{EngineConfig, FinishReason, Prompt};
use tandem_engine::sampling::SamplingParams;
use tandem_engine::sched::{RequestId, Role};
use tandem_tests::smollm2_dir;

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens, temperature: 0.0, ..SamplingParams::default() }
}

/// Greedy with exactly `max_tokens` tokens (EOS does not end the sequence).
fn fixed(max_tokens: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..greedy(max_tokens) }
}

/// Sixteen prompts of clearly different lengths (8 to ~400 tokens).
fn prompts() -> Vec<Prompt> {
    let animals = ["cat", "dog", "owl", "fox", "whale", "horse", "eagle", "turtle"];
    (0..16)
        .map(|i| {
            let sentences: Vec<String> = (0..(i * i) / 2 + 1)
                .map(|j| format!("The {} number {j} walked {} miles.", animals[(i + j) % 8], (i * 7 + j * 3) % 23))
                .collect();
            Prompt::Text(format!("{}\nQuestion {i}: which animal walked the farthest?", sentences.join(" ")))
        })
        .collect()
}

fn run_all(engine: &mut Engine, ids: &[RequestId]) -> HashMap<RequestId, Vec<u32>> {
    let mut out: HashMap<RequestId, Vec<u32>> = ids.iter().map(|id| (*id, Vec::new())).collect();
    while engine.has_unfinished() {
        for o in engine.step().unwrap() {
            out.get_mut(&o.request).unwrap().extend(o.token_ids);
        }
    }
    out
}

#[test]
fn sixteen_concurrent_requests_get_the_tokens_they_get_alone() {
    let dir = smollm2_dir();
    let prompts = prompts();
    let mut alone_engine = Engine::load(&dir, EngineConfig { enable_prefix_caching: false, ..EngineConfig::default() }).unwrap();
    let alone: Vec<Vec<u32>> =
        prompts.iter().map(|p| alone_engine.generate(p, greedy(24)).unwrap().remove(0).token_ids).collect();
    drop(alone_engine);

    // A small step budget mixes chunked prefills with decodes; half the requests arrive late.
    let cfg = EngineConfig { max_num_batched_tokens: 96, enable_prefix_caching: false, ..EngineConfig::default() };
    let mut engine = Engine::load(&dir, cfg).unwrap();
    let mut ids: Vec<RequestId> = prompts[..8].iter().map(|p| engine.add_request(p, greedy(24)).unwrap()).collect();
    let mut got: HashMap<RequestId, Vec<u32>> = ids.iter().map(|id| (*id, Vec::new())).collect();
    for _ in 0..3 {
        for o in engine.step().unwrap() {
            got.get_mut(&o.request).unwrap().extend(o.token_ids);
        }
    }
    for p in &prompts[8..] {
        let id = engine.add_request(p, greedy(24)).unwrap();
        got.insert(id, Vec::new());
        ids.push(id);
    }
    for (id, tokens) in run_all(&mut engine, &ids) {
        got.get_mut(&id).unwrap().extend(tokens);
    }
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(got[id], alone[i], "request {i} differs when batched");
    }
    let pool = engine.scheduler().pool();
    assert_eq!(pool.num_free(), pool.num_blocks(), "blocks leaked");
}

#[test]
fn prefix_cache_hits_give_exactly_the_cold_tokens() {
    let dir = smollm2_dir();
    let shared = "You are reviewing a long report. ".repeat(30);
    let a = Prompt::Text(format!("{shared}Summarise the first part."));
    let b = Prompt::Text(format!("{shared}List three risks."));
    let mut cold = Engine::load(&dir, EngineConfig { enable_prefix_caching: false, ..EngineConfig::default() }).unwrap();
    let cold_a = cold.generate(&a, fixed(20)).unwrap().remove(0).token_ids;
    let cold_b = cold.generate(&b, fixed(20)).unwrap().remove(0).token_ids;
    drop(cold);

    let mut warm = Engine::load(&dir, EngineConfig::default()).unwrap();
    assert_eq!(warm.generate(&a, fixed(20)).unwrap().remove(0).token_ids, cold_a);
    for (prompt, want) in [(&a, &cold_a), (&b, &cold_b)] {
        let id = warm.add_request(prompt, fixed(20)).unwrap();
        let mut tokens = Vec::new();
        let mut cached = None;
        while warm.has_unfinished() {
            let outputs = warm.step().unwrap();
            cached = cached.or_else(|| warm.usage(id).map(|u| u.cached_tokens));
            tokens.extend(outputs.into_iter().flat_map(|o| o.token_ids));
        }
        let cached = cached.expect("usage while running");
        assert!(cached >= 160, "expected a prefix-cache hit of at least 10 blocks, got {cached} tokens");
        assert_eq!(&tokens, want, "prefix-cache hit changed the output");
    }
}

#[test]
fn n_samples_are_seeded_reproducible_and_greedy_children_agree() {
    let dir = smollm2_dir();
    let mut engine = Engine::load(&dir, EngineConfig::default()).unwrap();
    let prompt = Prompt::Text("Once upon a time".into());
    let sampled = SamplingParams { n: 4, max_tokens: 16, temperature: 1.0, seed: Some(42), ignore_eos: true, ..SamplingParams::default() };
    let first: Vec<Vec<u32>> = engine.generate(&prompt, sampled.clone()).unwrap().into_iter().map(|c| c.token_ids).collect();
    let again: Vec<Vec<u32>> = engine.generate(&prompt, sampled).unwrap().into_iter().map(|c| c.token_ids).collect();
    assert_eq!(first, again, "a seeded request must be reproducible");
    assert_eq!(first.len(), 4);
    assert!(first.iter().all(|s| s.len() == 16));
    assert!(first.iter().any(|s| s != &first[0]), "4 sampled children at temperature 1 should not all agree");
    let greedy_one = engine.generate(&prompt, greedy(16)).unwrap().remove(0).token_ids;
    let greedy_n = engine.generate(&prompt, SamplingParams { n: 3, ..greedy(16) }).unwrap();
    assert!(greedy_n.iter().all(|c| c.token_ids == greedy_one));
    let pool = engine.scheduler().pool();
    assert_eq!(pool.num_free(), pool.num_blocks());
}

#[test]
fn prefill_role_hands_kv_to_decode_role_layer_by_layer() {
    let dir = smollm2_dir();
    let prompt = Prompt::Text("The three primary colours are".into());
    let mut colocated = Engine::load(&dir, EngineConfig::default()).unwrap();
    let want = colocated.generate(&prompt, greedy(20)).unwrap().remove(0).token_ids;
    drop(colocated);

    let mut prefill = Engine::load(&dir, EngineConfig { role: Role::Prefill, ..EngineConfig::default() }).unwrap();
    let mut decode = Engine::load(&dir, EngineConfig { role: Role::Decode, ..EngineConfig::default() }).unwrap();
    let ids = prefill.tokenize(&prompt).unwrap();
    let (dst, alloc) = decode.add_remote_request(ids.clone(), greedy(20)).unwrap();
    let src = prefill.add_request(&Prompt::Tokens(ids), greedy(20)).unwrap();
    let mut first = None;
    while first.is_none() {
        for o in prefill.step().unwrap() {
            assert_eq!(o.finish, Some(FinishReason::PrefillDone));
            first = Some(o.token_ids[0]);
        }
    }
    let held = prefill.held_blocks(src).expect("the prefill holds its blocks");
    assert_eq!(held.len(), alloc.block_table.len());
    // Ship every layer's blocks as the wire would: one layer at a time, block by block.
    for layer in 0..prefill.kv_cache().unwrap().num_layers() {
        for (s, d) in held.iter().zip(&alloc.block_table) {
            let data = prefill.kv_cache().unwrap().block(layer, s.0).to_vec();
            decode.kv_cache_mut().unwrap().block_mut(layer, d.0).copy_from_slice(&data);
        }
    }
    assert!(prefill.release(src));
    let pool = prefill.scheduler().pool();
    assert_eq!(pool.num_free(), pool.num_blocks(), "prefill released everything");

    let mut got: Vec<u32> = decode.kv_ready(dst, first.unwrap()).unwrap().into_iter().flat_map(|o| o.token_ids).collect();
    while decode.has_unfinished() {
        got.extend(decode.step().unwrap().into_iter().flat_map(|o| o.token_ids));
    }
    assert_eq!(got, want, "disaggregated output must equal colocated output");
    let pool = decode.scheduler().pool();
    assert_eq!(pool.num_free(), pool.num_blocks());
}

#[test]
fn abort_at_any_point_frees_every_block() {
    let dir = smollm2_dir();
    let cfg = EngineConfig { max_num_batched_tokens: 64, ..EngineConfig::default() };
    let mut engine = Engine::load(&dir, cfg).unwrap();
    let prompts = prompts();
    let ids: Vec<RequestId> = prompts[8..12].iter().map(|p| engine.add_request(p, fixed(16)).unwrap()).collect();
    // ids[0] is mid-prefill after one step (its prompt exceeds the 64-token budget), ids[3]
    // still waits; the others get aborted later, mid-decode.
    engine.step().unwrap();
    assert!(engine.abort(ids[0]));
    assert!(engine.abort(ids[3]));
    for _ in 0..12 {
        engine.step().unwrap();
    }
    assert!(engine.abort(ids[1]));
    assert!(engine.abort(ids[2]));
    assert!(!engine.abort(ids[2]), "a second abort finds nothing");
    assert!(!engine.has_unfinished());
    let pool = engine.scheduler().pool();
    assert_eq!(pool.num_free(), pool.num_blocks(), "blocks leaked by abort");
    // The engine keeps serving after aborts.
    let after = engine.generate(&prompts[0], fixed(4)).unwrap().remove(0);
    assert_eq!(after.token_ids.len(), 4);
}
