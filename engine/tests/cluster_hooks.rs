//! The engine hooks a disaggregated cluster needs, on the tiny fixture models: layer-by-layer
//! observation of a prefill step (KV shipped at each `layer_done` decodes exactly like a
//! colocated engine), local prefill on a decode node, the read-only prefix-cache probe, the load
//! report and request validation.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tandem_engine::config::ModelConfig;
use tandem_engine::engine::{EngineConfig, FinishReason, PrefillReady, Prompt, StepObserver};
use tandem_engine::model::KvCache;
use tandem_engine::sampling::SamplingParams;
use tandem_engine::sched::{RemoteAlloc, RequestId, Role};
use tandem_engine::{Engine, Error};

const BLOCK: usize = 4;

fn tiny(variant: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny").join(variant)
}

/// An engine on a tiny model with 4-token blocks and a pool of `blocks` blocks.
fn engine(variant: &str, role: Role, max_num_batched_tokens: usize, blocks: usize, prefix_caching: bool) -> Engine {
    let dir = tiny(variant);
    let cfg = ModelConfig::from_model_dir(&dir).unwrap();
    let ecfg = EngineConfig {
        role,
        block_size: BLOCK,
        kv_cache_bytes: blocks * KvCache::bytes_per_block(&cfg, BLOCK),
        max_num_seqs: 16,
        max_num_batched_tokens,
        max_model_len: None,
        enable_prefix_caching: prefix_caching,
        ..EngineConfig::default()
    };
    Engine::load(&dir, ecfg).unwrap()
}

/// Greedy, exactly `max_tokens` tokens.
fn fixed(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens, temperature: 0.0, ignore_eos: true, ..SamplingParams::default() }
}

/// A deterministic prompt of `len` token ids inside the tiny vocabulary, varied by `salt`.
fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 3 + (i * 37 + salt * 101 + i * i * 7) % 340).collect()
}

/// What each prompt generates alone on a colocated engine without prefix caching.
fn colocated(variant: &str, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    let mut e = engine(variant, Role::Colocated, 2048, 256, false);
    prompts.iter().map(|p| e.generate(&Prompt::Tokens(p.clone()), fixed(max_tokens)).unwrap().remove(0).token_ids).collect()
}

fn assert_pool_free(e: &Engine) {
    let pool = e.scheduler().pool();
    assert_eq!(pool.num_free(), pool.num_blocks(), "blocks leaked");
}

/// Ships the completing requests' KV into a decode engine at every `layer_done`, as a KV
/// connector would, and records what the engine reported.
struct Shipper {
    decode: Engine,
    /// Prefill request -> its remote allocation on the decode engine.
    routes: HashMap<RequestId, (RequestId, RemoteAlloc)>,
    completing: Vec<PrefillReady>,
    /// Every completing request seen so far.
    announced: HashMap<RequestId, PrefillReady>,
    calls: Vec<String>,
    /// (layer, prefill block, data) as copied, to check that the rest of the step leaves it.
    copied: Vec<(usize, u32, Vec<f32>)>,
}

impl StepObserver for Shipper {
    fn prefill_completing(&mut self, ready: &[PrefillReady]) {
        self.calls.push("completing".into());
        self.completing = ready.to_vec();
        for r in ready {
            assert!(self.announced.insert(r.request, r.clone()).is_none(), "{:?} completes twice", r.request);
        }
    }

    fn layer_done(&mut self, layer: usize) {
        self.calls.push(format!("layer {layer}"));
    }

    fn layer_done_with_kv(&mut self, layer: usize, kv: &KvCache) {
        self.layer_done(layer);
        for r in &self.completing {
            let (_, alloc) = &self.routes[&r.request];
            assert_eq!(r.block_table.len(), alloc.block_table.len());
            // The decode node's own prefix-cache blocks are not written.
            let skip = alloc.num_cached_tokens / BLOCK;
            for (src, dst) in r.block_table.iter().zip(&alloc.block_table).skip(skip) {
                let data = kv.block(layer, src.0);
                self.decode.kv_cache_mut().unwrap().block_mut(layer, dst.0).copy_from_slice(data);
                self.copied.push((layer, src.0, data.to_vec()));
            }
        }
    }
}

/// One prefill step observed by `ship`; checks the call pattern and that the copied KV is
/// still what the prefill engine holds after the step. Returns the step's outputs.
fn observed_step(prefill: &mut Engine, ship: &mut Shipper) -> Vec<tandem_engine::engine::SeqOutput> {
    let layers = prefill.model_config().num_layers;
    let runs_forward = prefill.scheduler().has_schedulable();
    ship.calls.clear();
    ship.copied.clear();
    let out = prefill.step_observed(ship).unwrap();
    let want: Vec<String> = if runs_forward {
        std::iter::once("completing".to_string()).chain((0..layers).map(|l| format!("layer {l}"))).collect()
    } else {
        Vec::new()
    };
    assert_eq!(ship.calls, want);
    for (layer, block, data) in &ship.copied {
        assert_eq!(prefill.kv_cache().unwrap().block(*layer, *block), data.as_slice(), "layer {layer} of block {block} changed after layer_done");
    }
    out
}

#[test]
fn kv_shipped_at_each_layer_done_decodes_like_a_colocated_engine() {
    for variant in ["llama", "gqa-tied"] {
        let a = prompt(37, 1);
        let mut b = a[..12].to_vec();
        b.extend(prompt(9, 2));
        let c = prompt(6, 3);
        let d = prompt(16, 4);
        let prompts = [a.clone(), b.clone(), c.clone(), d.clone()];
        let max_tokens = 8;
        let want = colocated(variant, &prompts, max_tokens);

        // A 16-token step budget chunks `a` over three steps.
        let mut prefill = engine(variant, Role::Prefill, 16, 128, true);
        let decode = engine(variant, Role::Decode, 64, 128, true);
        let mut ship = Shipper {
            decode,
            routes: HashMap::new(),
            completing: Vec::new(),
            announced: HashMap::new(),
            calls: Vec::new(),
            copied: Vec::new(),
        };
        let mut got: HashMap<RequestId, Vec<u32>> = HashMap::new();
        let mut src_of: HashMap<usize, RequestId> = HashMap::new();
        // A request reaches both nodes: blocks on the decode node, a prefill on the prefill node.
        let add = |prefill: &mut Engine, ship: &mut Shipper, p: &[u32]| -> (RequestId, RequestId) {
            let (dst, alloc) = ship.decode.add_remote_request(p.to_vec(), fixed(max_tokens)).unwrap();
            let src = prefill.add_request(&Prompt::Tokens(p.to_vec()), fixed(max_tokens)).unwrap();
            ship.routes.insert(src, (dst, alloc));
            (src, dst)
        };
        for i in [0, 2, 3] {
            let (src, dst) = add(&mut prefill, &mut ship, &prompts[i]);
            src_of.insert(i, src);
            got.insert(dst, Vec::new());
        }
        let mut steps = 0;
        let mut b_added = false;
        let mut prefills_done = 0;
        while prefill.has_unfinished() || ship.decode.has_unfinished() || !b_added {
            steps += 1;
            assert!(steps < 200, "no progress");
            for o in observed_step(&mut prefill, &mut ship) {
                assert_eq!(o.finish, Some(FinishReason::PrefillDone));
                let (dst, _) = ship.routes[&o.request].clone();
                let ready = &ship.announced[&o.request];
                let held = prefill.held_blocks(o.request).expect("a finished prefill holds its blocks");
                assert_eq!(ready.block_table, held, "announced table is the held table");
                assert_eq!(ready.prompt_len, prefill.usage(o.request).unwrap().prompt_tokens);
                assert_eq!(ready.block_table.len(), ready.prompt_len.div_ceil(BLOCK));
                for out in ship.decode.kv_ready(dst, o.token_ids[0]).unwrap() {
                    got.get_mut(&out.request).unwrap().extend(out.token_ids);
                }
                assert!(prefill.release(o.request));
                prefills_done += 1;
            }
            // `b` arrives once `a` has decoded a little: both nodes then have `a`'s first three
            // blocks in their prefix caches.
            if !b_added && prefills_done == 3 {
                let (src, dst) = add(&mut prefill, &mut ship, &prompts[1]);
                src_of.insert(1, src);
                got.insert(dst, Vec::new());
                let (_, alloc) = &ship.routes[&src_of[&1]];
                assert_eq!(alloc.num_cached_tokens, 12, "the decode node reuses a's blocks for b");
                b_added = true;
            }
            for out in ship.decode.step().unwrap() {
                got.get_mut(&out.request).unwrap().extend(out.token_ids);
            }
        }
        assert!(steps > 4, "a was chunked over several steps");
        let ready_a = &ship.announced[&src_of[&0]];
        let ready_b = &ship.announced[&src_of[&1]];
        assert_eq!(ready_b.block_table[..3], ready_a.block_table[..3], "b's table starts with a's cached blocks");
        assert_eq!(ready_b.prompt_len, b.len());
        for (i, want) in want.iter().enumerate() {
            let (dst, _) = &ship.routes[&src_of[&i]];
            assert_eq!(&got[dst], want, "{variant}: prompt {i} differs from colocated");
        }
        assert_pool_free(&prefill);
        assert_pool_free(&ship.decode);
    }
}

/// Records the call pattern only, through the trait's default `layer_done_with_kv`.
#[derive(Default)]
struct Recorder {
    calls: Vec<String>,
    completing: Vec<RequestId>,
}

impl StepObserver for Recorder {
    fn prefill_completing(&mut self, ready: &[PrefillReady]) {
        self.calls.push("completing".into());
        self.completing.extend(ready.iter().map(|r| r.request));
    }

    fn layer_done(&mut self, layer: usize) {
        self.calls.push(format!("layer {layer}"));
    }
}

#[test]
fn layers_are_reported_in_order_once_per_step_with_a_forward_pass() {
    for role in [Role::Colocated, Role::Prefill, Role::Decode] {
        let mut e = engine("llama3-rope", role, 16, 64, true);
        let layers = e.model_config().num_layers;
        let full: Vec<String> = std::iter::once("completing".to_string()).chain((0..layers).map(|l| format!("layer {l}"))).collect();
        let mut ids = Vec::new();
        for (len, salt) in [(30, 1), (5, 2), (9, 3)] {
            ids.push(e.add_request(&Prompt::Tokens(prompt(len, salt)), fixed(4)).unwrap());
        }
        let mut rec = Recorder::default();
        let (mut forward_steps, mut idle_steps) = (0, 0);
        for _ in 0..40 {
            let runs_forward = e.scheduler().has_schedulable();
            rec.calls.clear();
            e.step_observed(&mut rec).unwrap();
            if runs_forward {
                assert_eq!(rec.calls, full, "{role:?}");
                forward_steps += 1;
            } else {
                assert!(rec.calls.is_empty(), "{role:?}: a step without a forward pass reported {:?}", rec.calls);
                idle_steps += 1;
            }
        }
        assert!(forward_steps >= 3 && idle_steps > 0, "{role:?}: {forward_steps} forward, {idle_steps} idle steps");
        if role == Role::Prefill {
            let mut announced = rec.completing.clone();
            announced.sort();
            assert_eq!(announced, ids, "every prefill completes exactly once");
            for id in ids {
                assert!(e.release(id));
            }
        } else {
            assert!(rec.completing.is_empty(), "{role:?} has no completing prefills");
        }
        assert!(!e.has_unfinished());
        assert_pool_free(&e);
    }
}

#[test]
fn step_and_step_observed_produce_the_same_tokens() {
    let prompts = [prompt(23, 5), prompt(7, 6)];
    let mut runs = Vec::new();
    for observed in [false, true] {
        let mut e = engine("mistral", Role::Colocated, 8, 64, true);
        let ids: Vec<RequestId> = prompts.iter().map(|p| e.add_request(&Prompt::Tokens(p.clone()), fixed(6)).unwrap()).collect();
        let mut got: HashMap<RequestId, Vec<u32>> = ids.iter().map(|&id| (id, Vec::new())).collect();
        let mut rec = Recorder::default();
        while e.has_unfinished() {
            let out = if observed { e.step_observed(&mut rec).unwrap() } else { e.step().unwrap() };
            for o in out {
                got.get_mut(&o.request).unwrap().extend(o.token_ids);
            }
        }
        runs.push(ids.iter().map(|id| got[id].clone()).collect::<Vec<_>>());
    }
    assert_eq!(runs[0], runs[1]);
    assert_eq!(runs[0], colocated("mistral", &prompts, 6));
}

#[test]
fn decode_role_prefills_locally_mixed_with_remote_requests() {
    let remote = [prompt(19, 7), prompt(10, 8)];
    let local = [prompt(26, 9), prompt(3, 10)];
    let all: Vec<Vec<u32>> = remote.iter().chain(&local).cloned().collect();
    let want = colocated("gqa-tied", &all, 10);

    let mut prefill = engine("gqa-tied", Role::Prefill, 2048, 64, true);
    let mut decode = engine("gqa-tied", Role::Decode, 12, 128, true);
    let mut got: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut order = Vec::new();
    // The first remote request arrives, then a local one, which starts prefilling (chunked)
    // while the remote KV is still on its way.
    let mut remotes = Vec::new();
    for (i, p) in remote.iter().enumerate() {
        let (dst, alloc) = decode.add_remote_request(p.clone(), fixed(10)).unwrap();
        let src = prefill.add_request(&Prompt::Tokens(p.clone()), fixed(10)).unwrap();
        remotes.push((src, dst, alloc));
        order.push(dst);
        if i == 0 {
            let id = decode.add_request(&Prompt::Tokens(local[0].clone()), fixed(10)).unwrap();
            order.push(id);
        }
    }
    for o in decode.step().unwrap() {
        got.entry(o.request).or_default().extend(o.token_ids);
    }
    let mut firsts = HashMap::new();
    while prefill.has_unfinished() && firsts.len() < remotes.len() {
        for o in prefill.step().unwrap() {
            assert_eq!(o.finish, Some(FinishReason::PrefillDone));
            firsts.insert(o.request, o.token_ids[0]);
        }
    }
    for (src, dst, alloc) in &remotes {
        let held = prefill.held_blocks(*src).unwrap();
        for layer in 0..prefill.kv_cache().unwrap().num_layers() {
            for (s, d) in held.iter().zip(&alloc.block_table).skip(alloc.num_cached_tokens / BLOCK) {
                let data = prefill.kv_cache().unwrap().block(layer, s.0).to_vec();
                decode.kv_cache_mut().unwrap().block_mut(layer, d.0).copy_from_slice(&data);
            }
        }
        assert!(prefill.release(*src));
        for o in decode.kv_ready(*dst, firsts[src]).unwrap() {
            got.entry(o.request).or_default().extend(o.token_ids);
        }
    }
    let id = decode.add_request(&Prompt::Tokens(local[1].clone()), fixed(10)).unwrap();
    order.push(id);
    while decode.has_unfinished() {
        for o in decode.step().unwrap() {
            got.entry(o.request).or_default().extend(o.token_ids);
        }
    }
    // `order` is remote 0, local 0, remote 1, local 1.
    let want_in_order = [&want[0], &want[2], &want[1], &want[3]];
    for (i, (id, want)) in order.iter().zip(want_in_order).enumerate() {
        assert_eq!(&got[id], want, "request {i} on the decode node differs from colocated");
    }
    assert_pool_free(&decode);
    assert_pool_free(&prefill);
}

#[test]
fn cached_prefix_len_predicts_reuse_without_touching_the_pool() {
    let mut e = engine("llama", Role::Decode, 2048, 64, true);
    let p = prompt(21, 11);
    assert_eq!(e.cached_prefix_len(&p), 0);
    e.generate(&Prompt::Tokens(p.clone()), fixed(3)).unwrap();
    let mut sharing = p[..13].to_vec();
    sharing.extend(prompt(8, 12));
    let pool_before = format!("{:?}", e.scheduler().pool());
    assert_eq!(e.cached_prefix_len(&p), 20, "five full prompt blocks are cached");
    assert_eq!(e.cached_prefix_len(&p[..16]), 16, "a fully cached prompt reports every block");
    assert_eq!(e.cached_prefix_len(&sharing), 12, "only whole shared blocks count");
    assert_eq!(e.cached_prefix_len(&prompt(21, 13)), 0);
    assert_eq!(e.cached_prefix_len(&[]), 0);
    assert_eq!(format!("{:?}", e.scheduler().pool()), pool_before, "the probe changed the pool (refs or LRU)");

    // The prediction is what a remote allocation and a local prefill then reuse.
    let predicted = e.cached_prefix_len(&sharing);
    let (remote, alloc) = e.add_remote_request(sharing.clone(), fixed(2)).unwrap();
    assert_eq!(alloc.num_cached_tokens, predicted);
    assert!(e.abort(remote));
    let local = e.add_request(&Prompt::Tokens(p.clone()), fixed(2)).unwrap();
    let predicted = e.cached_prefix_len(&p);
    e.step().unwrap();
    assert_eq!(e.usage(local).unwrap().cached_tokens, predicted);
    while e.has_unfinished() {
        e.step().unwrap();
    }

    let mut off = engine("llama", Role::Decode, 2048, 64, false);
    off.generate(&Prompt::Tokens(p.clone()), fixed(3)).unwrap();
    assert_eq!(off.cached_prefix_len(&p), 0, "no prefix cache, nothing cached");
}

#[test]
fn current_load_counts_queues_and_free_blocks() {
    let mut e = engine("llama", Role::Decode, 8, 32, true);
    let idle = e.current_load();
    assert_eq!((idle.waiting, idle.running, idle.free_blocks, idle.total_blocks), (0, 0, 32, 32));
    let a = e.add_request(&Prompt::Tokens(prompt(20, 14)), fixed(4)).unwrap();
    e.add_request(&Prompt::Tokens(prompt(6, 15)), fixed(4)).unwrap();
    assert_eq!(e.current_load().waiting, 2);
    assert_eq!(e.current_load().free_blocks, 32, "queued requests take no blocks");
    // An 8-token budget admits the first (chunked); the second still waits.
    e.step().unwrap();
    let load = e.current_load();
    assert_eq!((load.waiting, load.running), (1, 1));
    assert_eq!(load.free_blocks, 30, "8 computed tokens take two blocks");
    let (remote, alloc) = e.add_remote_request(prompt(12, 16), fixed(4)).unwrap();
    let load = e.current_load();
    assert_eq!((load.waiting, load.running), (1, 1), "a request awaiting KV is neither waiting nor running");
    assert_eq!(alloc.block_table.len(), 3);
    assert_eq!(load.free_blocks, 27);
    assert!(e.abort(a));
    assert!(e.abort(remote));
    while e.has_unfinished() {
        e.step().unwrap();
    }
    let done = e.current_load();
    assert!(e.scheduler().pool().num_evictable() > 0, "finished blocks stay cached");
    assert_eq!((done.waiting, done.running, done.free_blocks, done.total_blocks), (0, 0, 32, 32), "evictable blocks count as free");
}

#[test]
fn validate_request_rejects_what_add_request_rejects_without_allocating() {
    // 8 blocks of 4 tokens: 32 token slots.
    let mut e = engine("llama", Role::Decode, 64, 8, true);
    let vocab = e.model_config().vocab_size as u32;
    let limit = e.max_model_len();
    let ok = prompt(10, 17);
    let cases: Vec<(Vec<u32>, SamplingParams, &str)> = vec![
        (Vec::new(), fixed(4), "empty"),
        (vec![5, vocab, 6], fixed(4), "vocab"),
        (prompt(limit - 3, 18), fixed(4), "context"),
        (ok.clone(), SamplingParams { temperature: -1.0, ..fixed(4) }, "sampling"),
        (ok.clone(), SamplingParams { n: 17, ..fixed(4) }, "n above max_num_seqs"),
        (ok.clone(), fixed(0), "max_tokens"),
        (ok.clone(), fixed(30), "capacity"),
    ];
    let pool_before = format!("{:?}", e.scheduler().pool());
    for (p, params, what) in &cases {
        let err = e.validate_request(p, params).unwrap_err();
        let matches = match *what {
            "empty" => matches!(err, Error::EmptyPrompt),
            "vocab" => matches!(err, Error::Tokenizer(_)),
            "context" => matches!(err, Error::PromptTooLong { .. }),
            "capacity" => matches!(err, Error::CapacityExceeded { needed: 10, total: 8 }),
            _ => matches!(err, Error::InvalidSampling(_)),
        };
        assert!(matches, "{what}: {err}");
        // add_request and add_remote_request reject it the same way.
        let local = e.add_request(&Prompt::Tokens(p.clone()), params.clone()).unwrap_err();
        let remote = e.add_remote_request(p.clone(), params.clone()).unwrap_err();
        assert_eq!(local.to_string(), err.to_string(), "{what}");
        assert_eq!(remote.to_string(), err.to_string(), "{what}");
    }
    assert_eq!(format!("{:?}", e.scheduler().pool()), pool_before, "validation allocated something");
    assert!(!e.has_unfinished());
    assert_eq!(e.current_load().waiting, 0);

    e.validate_request(&ok, &fixed(22)).unwrap();
    let id = e.add_request(&Prompt::Tokens(ok.clone()), fixed(22)).unwrap();
    // Valid but the pool is busy now: validation passes, a remote allocation fails transiently.
    e.step().unwrap();
    let big = prompt(30, 20);
    e.validate_request(&big, &fixed(2)).unwrap();
    assert!(matches!(e.add_remote_request(big, fixed(2)), Err(Error::KvPoolFull { .. })));
    assert!(e.abort(id));
    assert_pool_free(&e);
}

#[test]
fn a_prefill_whose_sibling_stops_stays_held_until_released() {
    // n = 2 sampled on a prefill node: find a seed whose two samples differ, then make the
    // second one a stop token. A prefill node holds every sample for the transfer, even one that
    // would stop (the decode node applies the stop rules); the request stays known until release.
    let p = prompt(9, 19);
    let sampled = |seed: u64, stop: Vec<u32>| SamplingParams {
        n: 2,
        max_tokens: 4,
        temperature: 1.0,
        seed: Some(seed),
        stop_token_ids: stop,
        ..SamplingParams::default()
    };
    let mut e = engine("llama", Role::Prefill, 2048, 64, true);
    let mut found = None;
    for seed in 0..64 {
        let id = e.add_request(&Prompt::Tokens(p.clone()), sampled(seed, Vec::new())).unwrap();
        let mut tokens = [0u32; 2];
        // One step prefills the whole prompt and samples both.
        let out = e.step().unwrap();
        assert_eq!(out.len(), 2);
        for o in out {
            tokens[o.index as usize] = o.token_ids[0];
        }
        e.release(id);
        assert!(!e.has_unfinished());
        if tokens[0] != tokens[1] && !e.tokenizer().eos_token_ids().contains(&tokens[0]) {
            found = Some((seed, tokens));
            break;
        }
    }
    let (seed, tokens) = found.expect("some seed gives two different first tokens");
    let id = e.add_request(&Prompt::Tokens(p.clone()), sampled(seed, vec![tokens[1]])).unwrap();
    let finishes: HashMap<u32, FinishReason> = e.step().unwrap().into_iter().map(|o| (o.index, o.finish.unwrap())).collect();
    assert_eq!(finishes[&0], FinishReason::PrefillDone);
    assert_eq!(finishes[&1], FinishReason::PrefillDone, "a stop token is the decode node's to apply");
    assert!(e.held_blocks(id).is_some(), "the held sample keeps the request known");
    assert!(e.release(id));
    assert!(e.held_blocks(id).is_none());
    assert!(!e.has_unfinished());
    assert_pool_free(&e);
}

/// A first token from another node that lies outside the vocabulary (or logprobs naming other tokens)
/// is refused at `kv_ready` without touching the request, so it can fail only its own request: the
/// neighbours batched beside it decode on, and the refused request can still be aborted cleanly.
#[test]
fn a_bad_first_token_from_a_peer_is_refused_without_harming_other_requests() {
    let prompts = [prompt(9, 21), prompt(7, 22)];
    let want = colocated("gqa-tied", &prompts, 6);
    let mut decode = engine("gqa-tied", Role::Decode, 64, 64, true);
    let vocab = decode.model_config().vocab_size as u32;
    let neighbour = decode.add_request(&Prompt::Tokens(prompts[0].clone()), fixed(6)).unwrap();
    let (bad, _) = decode.add_remote_request(prompts[1].clone(), fixed(6)).unwrap();
    let mut got: Vec<u32> = decode.step().unwrap().into_iter().filter(|o| o.request == neighbour).flat_map(|o| o.token_ids).collect();
    for token in [vocab, u32::MAX] {
        assert!(matches!(decode.kv_ready(bad, token), Err(tandem_engine::Error::Tokenizer(_))), "token {token} accepted");
    }
    let lying = tandem_engine::engine::TokenLogprob { token: 5, logprob: -0.1, top: vec![(vocab + 3, -0.1)] };
    assert!(decode.kv_ready_with_logprob(bad, 5, Some(lying)).is_err(), "logprobs naming an unknown token accepted");
    assert!(decode.abort(bad));
    while decode.has_unfinished() {
        for o in decode.step().unwrap() {
            assert_eq!(o.request, neighbour);
            got.extend(o.token_ids);
        }
    }
    assert_eq!(got, want[0], "the neighbour's output changed");
    assert_pool_free(&decode);
}

/// A driver sleeps while every request waits on the outside: a decode request awaiting its KV and a
/// prefill holding its blocks for a transfer are unfinished but give `step` nothing to do.
#[test]
fn requests_waiting_on_the_outside_give_no_work() {
    let p = prompt(9, 31);
    let mut decode = engine("gqa-tied", Role::Decode, 64, 64, true);
    let (dst, _) = decode.add_remote_request(p.clone(), fixed(3)).unwrap();
    assert!(decode.has_unfinished() && !decode.has_work(), "awaiting KV is not work");
    let mut prefill = engine("gqa-tied", Role::Prefill, 64, 64, true);
    let src = prefill.add_request(&Prompt::Tokens(p), fixed(3)).unwrap();
    assert!(prefill.has_work());
    let mut first = None;
    while prefill.has_work() {
        for o in prefill.step().unwrap() {
            first = o.token_ids.first().copied();
        }
    }
    assert!(prefill.has_unfinished(), "the finished prefill holds its blocks");
    assert!(prefill.release(src));
    assert!(!prefill.has_unfinished());
    decode.kv_ready(dst, first.expect("a first token")).unwrap();
    assert!(decode.has_work());
    while decode.has_work() {
        decode.step().unwrap();
    }
    assert!(!decode.has_unfinished());
    assert_pool_free(&decode);
}

#[test]
fn first_scheduled_reports_each_queued_request_once_with_its_cache_hit() {
    let mut e = engine("llama", Role::Decode, 8, 64, true);
    let p = prompt(21, 21);
    e.generate(&Prompt::Tokens(p.clone()), fixed(2)).unwrap();
    // Sharing the first 16 tokens (four whole blocks) with the finished prompt.
    let mut sharing = p[..16].to_vec();
    sharing.extend(prompt(9, 22));
    let a = e.add_request(&Prompt::Tokens(sharing.clone()), fixed(3)).unwrap();
    let b = e.add_request(&Prompt::Tokens(prompt(6, 23)), fixed(3)).unwrap();
    let (remote, _) = e.add_remote_request(prompt(12, 24), fixed(3)).unwrap();
    let mut seen: Vec<(RequestId, usize, usize)> = Vec::new();
    let mut steps = 0;
    while e.has_work() {
        e.step().unwrap();
        steps += 1;
        seen.extend(e.first_scheduled().iter().map(|f| (f.request, f.prompt_tokens, f.cached_tokens)));
        assert!(steps < 100, "the engine never finished");
    }
    // With an 8-token budget `a` (9 uncached tokens) is chunked, so `b` waits for a later step.
    assert_eq!(seen, vec![(a, 25, 16), (b, 6, 0)], "each queued request once, in order; the remote one never");
    assert!(e.first_scheduled().is_empty() || steps > 0);
    assert!(e.abort(remote));
}
