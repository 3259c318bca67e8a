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
            self.say(format!("preempt {p}"));
        }
        let mut samples = Vec::new();
        for c in &sched.chunks {
            let end = c.start_pos + c.tokens.len();
            assert_eq!(c.block_table.len(), end.div_ceil(self.s.config().block_size));
            let mut line = format!("{} {}..{} {}", c.seq, c.start_pos, end, blocks(&c.block_table));
            if c.sample {
                let toks: Vec<u32> = (0..c.num_samples as u32).map(|i| self.next_token + i).collect();
                self.next_token += c.num_samples as u32;
                line += &if c.num_samples > 1 { format!(" sample x{}", c.num_samples) } else { " sample".into() };
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
                let req = NewRequest { id, prompt: p.clone(), n: kv(args, "n", 1), max_tokens: kv(args, "max", 4) };
                self.max_tokens.insert(id, (p.len(), req.max_tokens));
                if words[0] == "add" {
                    if let Err(e) = self.s.add_request(req) {
                        self.say(format!("error: {e}"));
                    }
                } else {
                    match self.s.allocate_remote(req) {
                        Ok(a) => self.say(format!("{} cached={}", blocks(&a.block_table), a.num_cached_tokens)),
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
    let expected: Vec<&str> =
        transcript.lines().map(str::trim_end).filter(|l| !l.trim().is_empty()).collect();
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
    if line.starts_with(' ') || line.starts_with('\t') { format!("  {t}") } else { t.to_string() }
}

#[test]
fn scratch() {
    check(
        "
config bs=4 blocks=16 budget=8
add 1 A10 max=2
",
    );
}
