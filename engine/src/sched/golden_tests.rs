//! Data-driven golden tests of scheduler decisions.
//!
//! Each test is one transcript: a `config` line, then commands, each followed by the lines the
//! harness prints for it (indented). The harness replays the commands against a real
//! [`Scheduler`], acting as the engine: after `step` it reports a sampled token for every chunk
//! with `sample` (tokens 900, 901, ...) and finishes sequences that reach `max_tokens`. The
//! regenerated transcript must equal the written one; on mismatch the actual one is printed.
//!
//! Commands: `add R PROMPT [n=N] [max=M]`, `remote R PROMPT [max=M]`, `ready R TOKEN`,
//! `step`, `finish R.I`, `abort R`, `hold R.I`, `release R`. A PROMPT like `A8B3` is 8
//! tokens of family A then 3 of family B (token = family * 1000 + position), so prompts
//! sharing a leading segment share a token prefix.
//! Chunk lines read `R.I START..END [blocks]`, then `sample` (`sample xN`) and the tokens
//! sampled, `copy S->D`, `preempt R.I`, `done R.I`, and a `pool` summary.

use super::{NewRequest, RequestId, Role, Scheduler, SchedulerConfig, SeqId};

fn prompt(spec: &str) -> Vec<u32> {
    let mut tokens = Vec::new();
    let mut chars = spec.chars().peekable();
    while let Some(family) = chars.next() {
        let mut len = String::new();
        while let Some(d) = chars.next_if(|c| c.is_ascii_digit()) {
            len.push(d);
        }
        let len: usize = len.parse().expect("prompt segment length");
        let code = u32::from(family) - u32::from('A') + 1;
        for _ in 0..len {
            tokens.push(code * 1000 + tokens.len() as u32);
        }
    }
    tokens
}

fn seq_id(s: &str) -> SeqId {
    let (r, i) = s.split_once('.').expect("R.I");
    SeqId::new(RequestId(r.parse().unwrap()), i.parse().unwrap())
}

fn kv(args: &[&str], key: &str, default: usize) -> usize {
    args.iter()
        .find_map(|a| a.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .map_or(default, |v| v.parse().unwrap())
}

fn config(args: &[&str]) -> SchedulerConfig {
    let role = match args.iter().find_map(|a| a.strip_prefix("role=")) {
        Some("prefill") => Role::Prefill,
        Some("decode") => Role::Decode,
        _ => Role::Colocated,
    };
    SchedulerConfig {
        role,
        block_size: kv(args, "bs", 4),
        num_blocks: kv(args, "blocks", 16),
        max_num_seqs: kv(args, "seqs", 8),
        max_num_batched_tokens: kv(args, "budget", 64),
        max_model_len: kv(args, "maxlen", 256),
        enable_prefix_caching: !args.contains(&"nocache"),
    }
}

fn blocks(b: &[crate::kv::BlockId]) -> String {
    let v: Vec<String> = b.iter().map(|b| b.0.to_string()).collect();
    format!("[{}]", v.join(" "))
}

struct Harness {
    s: Scheduler,
    out: Vec<String>,
    next_token: u32,
    max_tokens: std::collections::HashMap<RequestId, (usize, usize)>,
}

impl Harness {
    fn say(&mut self, line: String) {
        self.out.push(format!("  {line}"));
    }

    fn step(&mut self) {
        let sched = self.s.schedule();
        assert!(sched.num_tokens() <= self.s.config().max_num_batched_tokens);
        assert!(sched.chunks.len() <= self.s.config().max_num_seqs);
        for c in &sched.copies {
            self.say(format!("copy {}->{}", c.src, c.dst));
        }
        for p in &sched.preempted {
            assert!(
                sched.chunks.iter().all(|c| c.seq != *p),
                "preempted {p} has a chunk"
            );
            self.say(format!("preempt {p}"));
        }
        let mut samples = Vec::new();
        for c in &sched.chunks {
            let end = c.start_pos + c.tokens.len();
            assert_eq!(
                c.block_table.len(),
                end.div_ceil(self.s.config().block_size)
            );
            let mut line = format!(
                "{} {}..{} {}",
                c.seq,
                c.start_pos,
                end,
                blocks(&c.block_table)
            );
            if c.sample {
                let toks: Vec<u32> = (0..c.num_samples as u32)
                    .map(|i| self.next_token + i)
                    .collect();
                self.next_token += c.num_samples as u32;
                line += &if c.num_samples > 1 {
                    format!(" sample x{}", c.num_samples)
                } else {
                    " sample".into()
                };
                line += &format!(" {toks:?}");
                samples.push((c.seq, toks));
            }
            self.say(line);
        }
        if sched.chunks.is_empty() && sched.preempted.is_empty() {
            self.say("idle".into());
        }
        for (seq, toks) in samples {
            self.s.on_sampled(seq, &toks);
            let (prompt_len, max) = self.max_tokens[&seq.request];
            for i in 0..toks.len() as u32 {
                let child = SeqId::new(seq.request, seq.index + i);
                // Engine behaviour: a sequence that reached max_tokens is finished.
                let len = self.s.seqs.get(&child).map_or(0, |s| s.tokens.len());
                if len >= prompt_len + max {
                    self.s.finish(child);
                    self.say(format!("done {child}"));
                }
            }
        }
        self.pool_line();
        self.s.check_invariants().unwrap();
    }

    fn pool_line(&mut self) {
        let p = self.s.pool();
        let line = format!(
            "pool free={} cached={} running={} waiting={}",
            p.num_free(),
            p.num_cached(),
            self.s.num_running(),
            self.s.num_waiting()
        );
        self.say(line);
    }

    fn command(&mut self, line: &str) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let args = &words[1..];
        match words[0] {
            "add" | "remote" => {
                let id = RequestId(args[0].parse().unwrap());
                let p = prompt(args[1]);
                let req = NewRequest {
                    id,
                    prompt: p.clone(),
                    n: kv(args, "n", 1),
                    max_tokens: kv(args, "max", 4),
                };
                self.max_tokens.insert(id, (p.len(), req.max_tokens));
                if words[0] == "add" {
                    if let Err(e) = self.s.add_request(req) {
                        self.say(format!("error: {e}"));
                    }
                } else {
                    match self.s.allocate_remote(req) {
                        Ok(a) => self.say(format!(
                            "{} cached={}",
                            blocks(&a.block_table),
                            a.num_cached_tokens
                        )),
                        Err(e) => self.say(format!("error: {e}")),
                    }
                }
            }
            "ready" => {
                let id = RequestId(args[0].parse().unwrap());
                if let Err(e) = self.s.kv_ready(id, args[1].parse().unwrap()) {
                    self.say(format!("error: {e}"));
                }
            }
            "step" => self.step(),
            "finish" => self.s.finish(seq_id(args[0])),
            "abort" => {
                let ok = self.s.abort(RequestId(args[0].parse().unwrap()));
                self.say(format!("{ok}"));
                self.pool_line();
            }
            "hold" => {
                let b = self.s.hold(seq_id(args[0]));
                self.say(blocks(&b));
            }
            "release" => {
                let ok = self.s.release(RequestId(args[0].parse().unwrap()));
                self.say(format!("{ok}"));
                self.pool_line();
            }
            other => panic!("unknown command {other}"),
        }
        self.s.check_invariants().unwrap();
    }
}

/// Replays the transcript's commands and compares the regenerated transcript.
fn check(transcript: &str) {
    let expected: Vec<&str> = transcript
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty())
        .collect();
    let cfg_words: Vec<&str> = expected[0].split_whitespace().collect();
    assert_eq!(cfg_words[0], "config");
    let mut h = Harness {
        s: Scheduler::new(config(&cfg_words[1..])),
        out: vec![expected[0].trim().to_string()],
        next_token: 900,
        max_tokens: Default::default(),
    };
    for line in &expected[1..] {
        if line.starts_with("  ") || line.starts_with("\t") {
            continue;
        }
        let line = line.trim();
        h.out.push(line.to_string());
        h.command(line);
    }
    let expected: Vec<String> = expected.iter().map(|l| normalize(l)).collect();
    let actual: Vec<String> = h.out.iter().map(|l| normalize(l)).collect();
    if expected != actual {
        panic!("golden transcript differs; actual:\n{}\n", h.out.join("\n"));
    }
}

/// Transcript lines compare with uniform indentation: commands flush left, output indented 2.
fn normalize(line: &str) -> String {
    let t = line.trim();
    if line.starts_with(' ') || line.starts_with('\t') {
        format!("  {t}")
    } else {
        t.to_string()
    }
}

#[test]
fn chunked_prefill_then_mixed_decode() {
    check(
        "
config bs=4 blocks=16 budget=8
add 1 A10 max=2
add 2 B5 max=2
step
  1.0 0..8 [0 1]
  pool free=14 cached=2 running=1 waiting=1
step
  1.0 8..10 [0 1 2] sample [900]
  2.0 0..5 [3 4] sample [901]
  pool free=11 cached=3 running=2 waiting=0
step
  1.0 10..11 [0 1 2] sample [902]
  2.0 5..6 [3 4] sample [903]
  done 1.0
  done 2.0
  pool free=16 cached=3 running=0 waiting=0
",
    );
}

#[test]
fn prefix_cache_reuse_leaves_the_last_token() {
    check(
        "
config bs=4 blocks=8
add 1 A9 max=1
step
  1.0 0..9 [0 1 2] sample [900]
  done 1.0
  pool free=8 cached=2 running=0 waiting=0
add 2 A8B3 max=1
add 3 A8 max=1
step
  2.0 8..11 [0 1 2] sample [901]
  3.0 4..8 [0 3] sample [902]
  done 2.0
  done 3.0
  pool free=8 cached=2 running=0 waiting=0
",
    );
}

#[test]
fn fork_then_copy_on_write() {
    check(
        "
config bs=4 blocks=8
add 1 A6 n=2 max=3
step
  1.0 0..6 [0 1] sample x2 [900, 901]
  pool free=6 cached=1 running=2 waiting=0
step
  copy 1->2
  1.0 6..7 [0 2] sample [902]
  1.1 6..7 [0 1] sample [903]
  pool free=5 cached=1 running=2 waiting=0
step
  1.0 7..8 [0 2] sample [904]
  1.1 7..8 [0 1] sample [905]
  done 1.0
  done 1.1
  pool free=8 cached=3 running=0 waiting=0
",
    );
}

#[test]
fn preemption_by_recompute() {
    check(
        "
config bs=2 blocks=4
add 1 A3 max=4
add 2 B3 max=4
step
  1.0 0..3 [0 1] sample [900]
  2.0 0..3 [2 3] sample [901]
  pool free=0 cached=2 running=2 waiting=0
step
  1.0 3..4 [0 1] sample [902]
  2.0 3..4 [2 3] sample [903]
  pool free=0 cached=4 running=2 waiting=0
step
  preempt 2.0
  1.0 4..5 [0 1 3] sample [904]
  pool free=1 cached=3 running=1 waiting=1
step
  1.0 5..6 [0 1 3] sample [905]
  done 1.0
  pool free=4 cached=4 running=0 waiting=1
step
  2.0 2..5 [2 3 1] sample [906]
  pool free=1 cached=3 running=1 waiting=0
step
  2.0 5..6 [2 3 1] sample [907]
  done 2.0
  pool free=4 cached=4 running=0 waiting=0
step
  idle
  pool free=4 cached=4 running=0 waiting=0
",
    );
}

#[test]
fn a_scheduled_sequence_is_never_the_victim() {
    check(
        "
config bs=2 blocks=5 budget=4 role=decode
add 1 A8 max=1
step
  1.0 0..4 [0 1]
  pool free=3 cached=2 running=1 waiting=0
remote 2 B4 max=2
  [2 3] cached=0
ready 2 7
step
  preempt 1.0
  2.0 4..5 [2 3 4] sample [900]
  done 2.0
  pool free=5 cached=4 running=0 waiting=1
step
  1.0 4..8 [0 1 4 3] sample [901]
  done 1.0
  pool free=5 cached=5 running=0 waiting=0
",
    );
}

#[test]
fn decodes_first_then_prefill_chunks_fill_the_budget() {
    check(
        "
config bs=4 blocks=16 budget=4
add 1 A2 max=5
step
  1.0 0..2 [0] sample [900]
  pool free=15 cached=0 running=1 waiting=0
add 2 B9 max=1
step
  1.0 2..3 [0] sample [901]
  2.0 0..3 [1]
  pool free=14 cached=0 running=2 waiting=0
step
  1.0 3..4 [0] sample [902]
  2.0 3..6 [1 2]
  pool free=13 cached=2 running=2 waiting=0
step
  1.0 4..5 [0 3] sample [903]
  2.0 6..9 [1 2 4] sample [904]
  done 2.0
  pool free=14 cached=3 running=1 waiting=0
step
  1.0 5..6 [0 3] sample [905]
  done 1.0
  pool free=16 cached=3 running=0 waiting=0
",
    );
}

#[test]
fn the_newest_running_sequence_is_preempted() {
    check(
        "
config bs=2 blocks=6
add 1 A1 max=5
add 2 B1 max=5
add 3 C1 max=5
step
  1.0 0..1 [0] sample [900]
  2.0 0..1 [1] sample [901]
  3.0 0..1 [2] sample [902]
  pool free=3 cached=0 running=3 waiting=0
step
  1.0 1..2 [0] sample [903]
  2.0 1..2 [1] sample [904]
  3.0 1..2 [2] sample [905]
  pool free=3 cached=3 running=3 waiting=0
step
  1.0 2..3 [0 3] sample [906]
  2.0 2..3 [1 4] sample [907]
  3.0 2..3 [2 5] sample [908]
  pool free=0 cached=3 running=3 waiting=0
step
  1.0 3..4 [0 3] sample [909]
  2.0 3..4 [1 4] sample [910]
  3.0 3..4 [2 5] sample [911]
  pool free=0 cached=6 running=3 waiting=0
step
  preempt 3.0
  1.0 4..5 [0 3 5] sample [912]
  2.0 4..5 [1 4 2] sample [913]
  done 1.0
  done 2.0
  pool free=6 cached=4 running=0 waiting=1
step
  3.0 0..5 [2 5 3] sample [914]
  done 3.0
  pool free=6 cached=5 running=0 waiting=0
",
    );
}

#[test]
fn a_group_reserves_n_slots_until_it_forks() {
    check(
        "
config bs=4 blocks=16 seqs=2
add 1 A3 n=2 max=2
add 2 B3 max=1
step
  1.0 0..3 [0] sample x2 [900, 901]
  pool free=15 cached=0 running=2 waiting=1
step
  copy 0->1
  1.0 3..4 [1] sample [902]
  1.1 3..4 [0] sample [903]
  done 1.0
  done 1.1
  pool free=16 cached=2 running=0 waiting=1
step
  2.0 0..3 [2] sample [904]
  done 2.0
  pool free=16 cached=2 running=0 waiting=0
",
    );
}

#[test]
fn no_prefix_reuse_when_caching_is_off() {
    check(
        "
config bs=4 blocks=8 nocache
add 1 A9 max=1
step
  1.0 0..9 [0 1 2] sample [900]
  done 1.0
  pool free=8 cached=0 running=0 waiting=0
add 2 A9 max=1
step
  2.0 0..9 [0 1 2] sample [901]
  done 2.0
  pool free=8 cached=0 running=0 waiting=0
",
    );
}

#[test]
fn prefill_role_never_decodes_and_holds_blocks() {
    check(
        "
config bs=4 blocks=8 role=prefill
add 1 A6 max=8
step
  1.0 0..6 [0 1] sample [900]
  pool free=6 cached=1 running=1 waiting=0
step
  idle
  pool free=6 cached=1 running=1 waiting=0
hold 1.0
  [0 1]
step
  idle
  pool free=6 cached=1 running=0 waiting=0
release 1
  true
  pool free=8 cached=1 running=0 waiting=0
release 1
  false
  pool free=8 cached=1 running=0 waiting=0
",
    );
}

#[test]
fn decode_role_takes_remote_kv() {
    check(
        "
config bs=4 blocks=8 role=decode
remote 1 A9 max=3
  [0 1 2] cached=0
step
  idle
  pool free=5 cached=0 running=0 waiting=0
ready 1 5
ready 1 5
  error: unknown request 1
step
  1.0 9..10 [0 1 2] sample [900]
  pool free=5 cached=2 running=1 waiting=0
remote 2 A8B2 max=1
  [0 1 3] cached=8
remote 3 C20
  error: KV pool is full: need 5 free blocks, 4 available
abort 2
  true
  pool free=5 cached=2 running=1 waiting=0
step
  1.0 10..11 [0 1 2] sample [901]
  done 1.0
  pool free=8 cached=2 running=0 waiting=0
",
    );
}

#[test]
fn abort_anywhere_frees_everything() {
    check(
        "
config bs=4 blocks=8 budget=4
add 1 A10 max=2
add 2 B3 max=2
step
  1.0 0..4 [0]
  pool free=7 cached=1 running=1 waiting=1
abort 1
  true
  pool free=8 cached=1 running=0 waiting=1
abort 2
  true
  pool free=8 cached=1 running=0 waiting=0
abort 2
  false
  pool free=8 cached=1 running=0 waiting=0
add 3 C5 max=3
step
  3.0 0..4 [1]
  pool free=7 cached=2 running=1 waiting=0
abort 3
  true
  pool free=8 cached=2 running=0 waiting=0
",
    );
}

#[test]
fn invalid_requests_get_typed_errors() {
    check(
        "
config bs=4 blocks=4 seqs=2 maxlen=20
add 1 A3
add 1 A3
  error: request 1 already exists
add 2 A0
  error: the prompt is empty
add 3 A3 n=0
  error: invalid sampling parameter: n must be at least 1
add 4 A3 n=3
  error: invalid sampling parameter: n = 3 exceeds the 2 sequences this engine runs at once
add 5 A3 max=0
  error: invalid sampling parameter: max_tokens must be at least 1
add 6 A10 max=11
  error: prompt has 10 tokens; with max_tokens 11 that exceeds the context limit of 20 tokens
add 7 A10 max=8
  error: request needs 5 KV blocks but the pool only has 4
",
    );
}
