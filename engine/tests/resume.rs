//! Resumed requests (what a migrated request becomes on its new decode node): a request given its
//! prompt plus the output another engine already streamed continues that output exactly. For every
//! split point, the resumed tokens and text deltas appended to what the first engine streamed up to
//! the split equal the uninterrupted run: no token or character repeated or skipped, stop strings held
//! across the split, penalties counting the streamed tokens as output, seeded sampling drawing on.

use std::path::{Path, PathBuf};

use tandem_engine::config::ModelConfig;
use tandem_engine::engine::{EngineConfig, FinishReason, Prompt, Usage};
use tandem_engine::model::KvCache;
use tandem_engine::sampling::SamplingParams;
use tandem_engine::sched::Role;
use tandem_engine::{Engine, Error};

const BLOCK: usize = 4;

fn tiny(variant: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny").join(variant)
}

fn engine(role: Role) -> Engine {
    let dir = tiny("llama");
    let cfg = ModelConfig::from_model_dir(&dir).unwrap();
    let ecfg = EngineConfig {
        role,
        block_size: BLOCK,
        kv_cache_bytes: 256 * KvCache::bytes_per_block(&cfg, BLOCK),
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        ..EngineConfig::default()
    };
    Engine::load(&dir, ecfg).unwrap()
}

/// A deterministic prompt inside the tiny vocabulary.
fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 3 + (i * 37 + salt * 101 + i * i * 7) % 340).collect()
}

/// One run, message by message: each message's token ids and text, the finish reason and usage.
#[derive(Debug, Default, Clone)]
struct Run {
    tokens: Vec<u32>,
    /// The text delta each token's message carried.
    deltas: Vec<String>,
    finish: Option<FinishReason>,
    usage: Usage,
}

impl Run {
    fn text(&self) -> String {
        self.deltas.concat()
    }
}

/// Steps `e` until request `id` finishes; collects its messages.
fn drive(e: &mut Engine, id: tandem_engine::sched::RequestId) -> Run {
    let mut run = Run::default();
    while run.finish.is_none() {
        let usage = e.usage(id);
        for o in e.step().unwrap().into_iter().filter(|o| o.request == id) {
            assert!(o.token_ids.len() <= 1, "one token per message");
            run.tokens.extend(&o.token_ids);
            run.deltas.push(o.text);
            if o.finish.is_some() {
                run.finish = o.finish;
                run.usage = usage.expect("known until its last step");
                run.usage.completion_tokens += 1; // the last token was counted after the read
            }
        }
    }
    run
}

fn uninterrupted(p: &[u32], params: &SamplingParams) -> Run {
    let mut e = engine(Role::Colocated);
    let id = e.add_request(&Prompt::Tokens(p.to_vec()), params.clone()).unwrap();
    drive(&mut e, id)
}

/// Resumes `p` after the first `split` tokens of `whole` on a fresh engine.
fn resumed(p: &[u32], whole: &Run, split: usize, params: &SamplingParams) -> Run {
    let mut e = engine(Role::Decode);
    let tokens: Vec<u32> = p.iter().chain(&whole.tokens[..split]).copied().collect();
    let mut rest = params.clone();
    rest.max_tokens = params.max_tokens - split;
    let id = e.add_resumed_request(tokens, split, rest).unwrap();
    let run = drive(&mut e, id);
    let pool = e.scheduler().pool();
    assert_eq!(pool.num_free(), pool.num_blocks(), "blocks leaked");
    run
}

/// Every split of `whole` continues into exactly the rest of it.
fn check_every_split(p: &[u32], params: &SamplingParams, whole: &Run) {
    assert!(whole.tokens.len() >= 4, "a run long enough to split: {whole:?}");
    for split in 1..whole.tokens.len() {
        let got = resumed(p, whole, split, params);
        assert_eq!(got.tokens, whole.tokens[split..], "tokens after split {split}");
        let streamed: String = whole.deltas[..split].concat();
        assert_eq!(streamed + &got.text(), whole.text(), "text after split {split}");
        assert_eq!(got.finish, whole.finish, "finish after split {split}");
        assert_eq!(got.usage.prompt_tokens, p.len(), "usage after split {split}");
        assert_eq!(got.usage.completion_tokens, whole.tokens.len(), "usage after split {split}");
        assert!(got.usage.cached_tokens <= p.len());
    }
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens, temperature: 0.0, ignore_eos: true, ..SamplingParams::default() }
}

#[test]
fn greedy_resumes_at_every_split_without_a_repeated_or_skipped_token_or_character() {
    let p = prompt(13, 1);
    let params = greedy(14);
    let whole = uninterrupted(&p, &params);
    assert_eq!(whole.finish, Some(FinishReason::Length));
    assert!(!whole.text().is_empty());
    check_every_split(&p, &params, &whole);
}

#[test]
fn a_stop_string_is_found_across_the_split_and_held_back_text_is_not_lost() {
    let p = prompt(11, 2);
    let free = uninterrupted(&p, &greedy(16));
    // A stop string out of the middle of the free run's text, longer than one token's text, so
    // that its first characters are held back in some messages before it matches.
    let text = free.text();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 12, "enough text to pick a stop string from: {text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 4].iter().collect();
    let params = SamplingParams { stop: vec![stop.clone()], ..greedy(16) };
    let whole = uninterrupted(&p, &params);
    assert_eq!(whole.finish, Some(FinishReason::Stop), "{stop:?} stops {text:?}");
    assert!(!whole.text().contains(&stop));
    assert!(whole.deltas.iter().any(String::is_empty), "some message held text back: {:?}", whole.deltas);
    check_every_split(&p, &params, &whole);
}

#[test]
fn penalties_count_the_streamed_tokens_as_output() {
    let p = prompt(9, 3);
    // Negative penalties favour tokens already in the output, so they change this run (the tiny model
    // alone never repeats a token): a continuation that took the streamed tokens for prompt would not
    // favour them and would differ.
    let params = SamplingParams { frequency_penalty: -2.0, presence_penalty: -2.0, ..greedy(12) };
    let whole = uninterrupted(&p, &params);
    assert_ne!(uninterrupted(&p, &greedy(12)).tokens, whole.tokens, "the penalties change the run");
    check_every_split(&p, &params, &whole);
}

#[test]
fn a_seeded_sample_draws_on_from_where_the_stream_stopped() {
    let p = prompt(10, 4);
    let params = SamplingParams { temperature: 1.0, seed: Some(11), max_tokens: 12, ignore_eos: true, ..SamplingParams::default() };
    let whole = uninterrupted(&p, &params);
    check_every_split(&p, &params, &whole);
}

#[test]
fn outputs_that_cannot_be_resumed_are_refused_without_allocating() {
    let mut e = engine(Role::Decode);
    let p = prompt(8, 5);
    let whole = uninterrupted(&p, &greedy(6));
    let with = |split: usize| p.iter().chain(&whole.tokens[..split]).copied().collect::<Vec<u32>>();
    let refused = |r: Result<tandem_engine::sched::RequestId, Error>| matches!(r, Err(Error::InvalidResume(_)));
    // No prompt left.
    assert!(refused(e.add_resumed_request(whole.tokens[..3].to_vec(), 3, greedy(3))));
    // n > 1.
    assert!(refused(e.add_resumed_request(with(2), 2, SamplingParams { n: 2, ..greedy(3) })));
    // A stop token among the streamed tokens.
    let stop_token = SamplingParams { stop_token_ids: vec![whole.tokens[1]], ..greedy(3) };
    assert!(refused(e.add_resumed_request(with(2), 2, stop_token)));
    // A stop string the streamed text already completes.
    let text: String = whole.deltas[..2].concat();
    let last: String = text.chars().rev().take(1).collect();
    if !last.is_empty() {
        assert!(refused(e.add_resumed_request(with(2), 2, SamplingParams { stop: vec![last], ..greedy(3) })));
    }
    let pool = e.scheduler().pool();
    assert_eq!(pool.num_free(), pool.num_blocks());
    assert!(!e.has_unfinished());
}
