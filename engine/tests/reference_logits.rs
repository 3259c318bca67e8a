//! The CPU model against HF transformers: tiny random-weight Llama variants saved by
//! `scripts/reference/make_tiny_fixtures.py` (MHA, GQA + tied embeddings, llama3 RoPE scaling,
//! Mistral). Last-position logits must match transformers' to a relative error below 1e-4, whether
//! the prompt runs as one chunk or as several chunks over scattered blocks.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tandem_engine::config::ModelConfig;
use tandem_engine::model::{BatchChunk, KvCache, Model};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny")
}

fn max_rel_err(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    got.iter().zip(want).map(|(g, w)| (*g as f64 - w).abs()).fold(0.0, f64::max) / scale
}

/// Runs `ids` through the model in chunks of `chunk` tokens over a block table that is
/// deliberately not in order, and returns the last position's logits.
fn run_chunked(model: &Model, cfg: &ModelConfig, ids: &[u32], chunk: usize) -> Vec<f32> {
    let block_size = 16;
    let blocks = ids.len().div_ceil(block_size);
    let mut kv = KvCache::new(cfg, 2 * blocks + 3, block_size);
    let table: Vec<u32> = (0..blocks as u32).map(|b| 2 * blocks as u32 + 2 - 2 * b).collect();
    let mut start = 0;
    let mut logits = Vec::new();
    while start < ids.len() {
        let end = (start + chunk).min(ids.len());
        let c = BatchChunk { tokens: &ids[start..end], start_pos: start, block_table: &table, want_logits: end == ids.len() };
        logits = model.forward(&[c], &mut kv).unwrap();
        start = end;
    }
    logits
}

#[test]
fn tiny_models_match_transformers_logits() {
    let mut checked = 0;
    for variant in ["llama", "gqa-tied", "llama3-rope", "mistral"] {
        let dir = fixtures().join(variant);
        let expected: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
        let cfg = ModelConfig::from_model_dir(&dir).unwrap();
        let model = Model::load(&dir, &cfg).unwrap();
        for case in expected["cases"].as_array().unwrap() {
            let ids: Vec<u32> = case["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            let want: Vec<f64> = case["last_logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            for chunk in [ids.len(), 5, 16] {
                let got = run_chunked(&model, &cfg, &ids, chunk);
                assert_eq!(got.len(), want.len());
                let err = max_rel_err(&got, &want);
                assert!(err < 1e-4, "{variant} {} chunk {chunk}: relative error {err:e}", case["name"]);
                checked += 1;
            }
        }
    }
    assert!(checked >= 4 * 3 * 4, "too few cases checked: {checked}");
}

#[test]
fn batched_forward_equals_separate_forwards() {
    let dir = fixtures().join("gqa-tied");
    let cfg = ModelConfig::from_model_dir(&dir).unwrap();
    let model = Model::load(&dir, &cfg).unwrap();
    let seqs: Vec<Vec<u32>> = vec![(0..40).map(|i| (i * 7 % 300) as u32 + 3).collect(), vec![5, 9, 11], (0..17).map(|i| i as u32 + 20).collect()];
    let alone: Vec<Vec<f32>> = seqs.iter().map(|s| run_chunked(&model, &cfg, s, s.len())).collect();
    let mut kv = KvCache::new(&cfg, 16, 16);
    let tables: Vec<Vec<u32>> = vec![vec![3, 4, 5], vec![9], vec![12, 1]];
    let chunks: Vec<BatchChunk<'_>> = seqs
        .iter()
        .zip(&tables)
        .map(|(s, t)| BatchChunk { tokens: s, start_pos: 0, block_table: t, want_logits: true })
        .collect();
    let batched = model.forward(&chunks, &mut kv).unwrap();
    let v = cfg.vocab_size;
    for (i, a) in alone.iter().enumerate() {
        let want: Vec<f64> = a.iter().map(|x| *x as f64).collect();
        let err = max_rel_err(&batched[i * v..(i + 1) * v], &want);
        assert!(err < 1e-5, "sequence {i}: batched differs from alone by {err:e}");
    }
}
