//! Streaming text out of a token stream: incremental detokenization and stop-string matching.
//!
//! [`IncrementalDetokenizer`] turns one sequence's output ids into text deltas with the
//! prefix/read-offset technique: it decodes a short window of recent tokens twice (with and
//! without the newest ones) and emits the difference, so tokenizer effects that depend on the
//! neighbours (prefix spaces, byte-level pieces) come out right without decoding the whole
//! output each step.
//!
//! Invariants:
//! - a delta never ends inside a UTF-8 character: while the window's text ends in U+FFFD
//!   (a partial byte sequence) the new tokens are held back; [`IncrementalDetokenizer::flush`]
//!   emits whatever is held at the end;
//! - without prompt context, the concatenation of all deltas and the flush equals
//!   `decode(output ids)` (for byte-level and SentencePiece-style decoders);
//! - the token window is trimmed as it advances, so memory stays constant per sequence.
//!
//! [`StopMatcher`] runs over the emitted text: it holds back any suffix that could still grow
//! into a stop string, and on a match returns the text before it; the stop string itself and
//! anything after it are never emitted.

use crate::Error;
use crate::tokenizer::Tokenizer;

/// How many trailing prompt ids [`IncrementalDetokenizer::new`] keeps as context.
pub const PROMPT_CONTEXT_TOKENS: usize = 6;

/// Tokens before the prefix offset are dropped once this many have accumulated.
const TRIM_THRESHOLD: usize = 64;

/// Turns a stream of token ids into text deltas for one sequence.
#[derive(Clone, Debug)]
pub struct IncrementalDetokenizer {
    /// The window: context tokens, then output tokens not yet outside the prefix offset.
    tokens: Vec<u32>,
    /// Start of the tokens decoded as context for the next delta.
    prefix_offset: usize,
    /// End of the tokens whose text has been emitted.
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    /// A detokenizer whose first delta is decoded in the context of the last
    /// [`PROMPT_CONTEXT_TOKENS`] of `prompt_tail` (pass the prompt, or its end), so a first
    /// output token that starts a word gets its leading space.
    pub fn new(prompt_tail: &[u32], skip_special_tokens: bool) -> Self {
        let tail = &prompt_tail[prompt_tail.len().saturating_sub(PROMPT_CONTEXT_TOKENS)..];
        IncrementalDetokenizer {
            tokens: tail.to_vec(),
            prefix_offset: 0,
            read_offset: tail.len(),
            skip_special_tokens,
        }
    }

    /// Adds one generated token and returns the text it completes (possibly empty: a partial
    /// UTF-8 character is held until the token completing it arrives).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, Error> {
        self.tokens.push(id);
        let prefix = tok.decode(
            &self.tokens[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tok.decode(&self.tokens[self.prefix_offset..], self.skip_special_tokens)?;
        if full.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = new_suffix(&prefix, &full);
        if delta.is_empty() {
            return Ok(String::new());
        }
        let delta = delta.to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        self.trim();
        Ok(delta)
    }

    /// Emits whatever is held back (at the end of the sequence), even an incomplete character
    /// (as U+FFFD, exactly as a full decode shows it).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String, Error> {
        if self.read_offset == self.tokens.len() {
            return Ok(String::new());
        }
        let prefix = tok.decode(
            &self.tokens[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tok.decode(&self.tokens[self.prefix_offset..], self.skip_special_tokens)?;
        let delta = new_suffix(&prefix, &full).to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        Ok(delta)
    }

    fn trim(&mut self) {
        if self.prefix_offset >= TRIM_THRESHOLD {
            self.tokens.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
    }
}

/// The part of `full` after its longest common prefix with `prefix` (at a char boundary).
/// Normally `full` starts with `prefix`; when a context token's partial character was completed
/// by the new tokens, the U+FFFD in `prefix` is replaced and the completed character is new.
fn new_suffix<'a>(prefix: &str, full: &'a str) -> &'a str {
    if let Some(rest) = full.strip_prefix(prefix) {
        return rest;
    }
    let common: usize = prefix
        .chars()
        .zip(full.chars())
        .take_while(|(a, b)| a == b)
        .map(|(a, _)| a.len_utf8())
        .sum();
    &full[common..]
}

/// What [`StopMatcher::push`] decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// No stop string yet: this text is safe to emit now (a suffix that may still become a
    /// stop string is held back).
    Continue(String),
    /// A stop string matched: emit this text (what preceded the stop string and was not yet
    /// emitted) and finish the sequence.
    Stopped(String),
}

/// Finds stop strings in a stream of text deltas.
#[derive(Clone, Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not emitted: a suffix that is a proper prefix of some stop string.
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored; validation rejects them anyway).
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Feeds the next delta. The sequence stops at the first delta after which the text contains
    /// a stop string; if several occur by then, the one starting first wins (so a longer stop
    /// that would have started earlier but is not complete yet loses to a shorter complete one).
    /// After a stop, every further push returns `Stopped("")`.
    pub fn push(&mut self, delta: &str) -> StopOutcome {
        if self.stopped {
            return StopOutcome::Stopped(String::new());
        }
        if self.stops.is_empty() {
            return StopOutcome::Continue(delta.to_string());
        }
        self.held.push_str(delta);
        let first_hit = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(pos) = first_hit {
            self.stopped = true;
            self.held.truncate(pos);
            return StopOutcome::Stopped(std::mem::take(&mut self.held));
        }
        let keep = self
            .stops
            .iter()
            .map(|s| partial_match_len(&self.held, s))
            .max()
            .unwrap_or(0);
        let emit = self.held.len() - keep;
        let rest = self.held.split_off(emit);
        StopOutcome::Continue(std::mem::replace(&mut self.held, rest))
    }

    /// At the end of a sequence that did not stop on a string: the held-back text.
    pub fn flush(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }

    /// True once a stop string matched.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`.
fn partial_match_len(text: &str, stop: &str) -> usize {
    let max = text.len().min(stop.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&k| stop.is_char_boundary(k) && text.ends_with(&stop[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::test_support::{Fixture, default_tokenizer};
    use rand::seq::IndexedRandom;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Runs the detokenizer over `ids` and returns the deltas and the flush.
    fn stream(tok: &Tokenizer, tail: &[u32], ids: &[u32], skip: bool) -> (Vec<String>, String) {
        let mut d = IncrementalDetokenizer::new(tail, skip);
        let deltas: Vec<String> = ids.iter().map(|&id| d.push(tok, id).unwrap()).collect();
        let flush = d.flush(tok).unwrap();
        (deltas, flush)
    }

    const TEXTS: [&str; 8] = [
        "hello the world",
        "你好好你",
        "😀😀 emoji",
        "mixed 你 😀 hello",
        "é è ß ∑",
        " the the hello",
        "<|im_end|>",
        "\n\t ",
    ];

    #[test]
    fn concatenation_equals_full_decode_for_random_sequences() {
        let (_d, tok) = default_tokenizer();
        let mut rng = ChaCha8Rng::seed_from_u64(2024);
        let vocab = tok.vocab_size() as u32;
        for case in 0..400 {
            // Half: random ids over the whole vocabulary (partial bytes, specials, merges);
            // half: encodings of random multi-byte text.
            let ids: Vec<u32> = if case % 2 == 0 {
                (0..rng.random_range(0..40))
                    .map(|_| rng.random_range(0..vocab))
                    .collect()
            } else {
                let text: String = (0..rng.random_range(1..6))
                    .map(|_| *TEXTS.choose(&mut rng).unwrap())
                    .collect();
                tok.encode(&text, false).unwrap()
            };
            for skip in [false, true] {
                let (deltas, flush) = stream(&tok, &[], &ids, skip);
                let got: String = deltas.concat() + &flush;
                assert_eq!(
                    got,
                    tok.decode(&ids, skip).unwrap(),
                    "ids {ids:?} skip {skip}"
                );
            }
        }
    }

    #[test]
    fn with_prompt_context_the_stream_continues_the_prompt() {
        let (_d, tok) = default_tokenizer();
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let prompt = tok
            .encode("<|im_start|>assistant\nsay 你好", false)
            .unwrap();
        for _ in 0..100 {
            let text: String = (0..3).map(|_| *TEXTS.choose(&mut rng).unwrap()).collect();
            let ids = tok.encode(&text, false).unwrap();
            let (deltas, flush) = stream(&tok, &prompt, &ids, false);
            let all: Vec<u32> = prompt.iter().chain(&ids).copied().collect();
            let whole = tok.decode(&all, false).unwrap();
            let head = tok.decode(&prompt, false).unwrap();
            assert_eq!(deltas.concat() + &flush, whole[head.len()..]);
        }
    }

    #[test]
    fn partial_characters_are_held_until_complete() {
        let (_d, tok) = default_tokenizer();
        // 😀 = (F0 9F 98) + (80); 好 = (E5) + (A5 BD); 你 = (E4 BD) + (A0).
        let ids = tok.encode("a😀好你", false).unwrap();
        assert_eq!(ids.len(), 1 + 2 + 2 + 2);
        let (deltas, flush) = stream(&tok, &[], &ids, true);
        assert_eq!(deltas, vec!["a", "", "😀", "", "好", "", "你"]);
        assert_eq!(flush, "");
        assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')));
    }

    #[test]
    fn valid_text_never_streams_a_replacement_char() {
        let (_d, tok) = default_tokenizer();
        let mut rng = ChaCha8Rng::seed_from_u64(77);
        for _ in 0..200 {
            let text: String = (0..4).map(|_| *TEXTS.choose(&mut rng).unwrap()).collect();
            let ids = tok.encode(&text, false).unwrap();
            let (deltas, flush) = stream(&tok, &[], &ids, false);
            assert!(
                deltas.iter().all(|d| !d.contains('\u{FFFD}')),
                "{text:?}: {deltas:?}"
            );
            assert_eq!(
                flush, "",
                "everything is emitted once the last character completes"
            );
        }
    }

    #[test]
    fn flush_emits_an_incomplete_tail_like_decode() {
        let (_d, tok) = default_tokenizer();
        let ids = tok.encode("x😀", false).unwrap();
        let cut = &ids[..ids.len() - 1]; // drop the last byte of the emoji
        let (deltas, flush) = stream(&tok, &[], cut, false);
        assert_eq!(deltas, vec!["x", ""]);
        assert_eq!(flush, "\u{FFFD}");
        assert_eq!(flush, tok.decode(&cut[1..], false).unwrap());
        let mut d = IncrementalDetokenizer::new(&[], false);
        d.push(&tok, cut[0]).unwrap();
        assert_eq!(d.flush(&tok).unwrap(), "");
        assert_eq!(d.flush(&tok).unwrap(), "", "flush twice gives nothing new");
    }

    #[test]
    fn context_tokens_completing_a_character_emit_it() {
        let (_d, tok) = default_tokenizer();
        // The prompt ends with the first three bytes of 😀; the output's first token ends it.
        let ids = tok.encode("a😀", false).unwrap();
        let (prompt, out) = ids.split_at(2);
        let (deltas, flush) = stream(&tok, prompt, out, false);
        assert_eq!(deltas.concat() + &flush, "😀");
    }

    #[test]
    fn long_streams_keep_a_small_window() {
        let (_d, tok) = default_tokenizer();
        let ids = tok.encode(&"hello 你好 ".repeat(200), false).unwrap();
        let mut d = IncrementalDetokenizer::new(&[], false);
        let mut out = String::new();
        for &id in &ids {
            out += &d.push(&tok, id).unwrap();
            assert!(
                d.tokens.len() <= TRIM_THRESHOLD + 8,
                "window grew to {}",
                d.tokens.len()
            );
        }
        out += &d.flush(&tok).unwrap();
        assert_eq!(out, "hello 你好 ".repeat(200));
    }

    #[test]
    fn special_tokens_respect_skip() {
        let (_d, tok) = default_tokenizer();
        let im_end = Fixture::special_id(2);
        let ids = [tok.encode("hi", false).unwrap(), vec![im_end]].concat();
        assert_eq!(stream(&tok, &[], &ids, false).0.concat(), "hi<|im_end|>");
        assert_eq!(stream(&tok, &[], &ids, true).0.concat(), "hi");
    }

    fn stops(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    use StopOutcome::{Continue, Stopped};

    #[test]
    fn stop_string_spanning_deltas() {
        let mut m = StopMatcher::new(&stops(&["STOP"]));
        assert_eq!(m.push("abc ST"), Continue("abc ".into()));
        assert_eq!(m.push("O"), Continue(String::new()));
        assert_eq!(m.push("P more"), Stopped(String::new()));
        assert!(m.is_stopped());
        assert_eq!(m.push("x"), Stopped(String::new()));
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn text_before_the_stop_in_the_same_delta_is_returned() {
        let mut m = StopMatcher::new(&stops(&["\n\n"]));
        assert_eq!(m.push("one\n"), Continue("one".into()));
        assert_eq!(m.push("two\n\nthree"), Stopped("\ntwo".into()));
    }

    #[test]
    fn stop_at_the_very_start() {
        let mut m = StopMatcher::new(&stops(&["<"]));
        assert_eq!(m.push("<x"), Stopped(String::new()));
        let mut m = StopMatcher::new(&stops(&["ab"]));
        assert_eq!(m.push("a"), Continue(String::new()));
        assert_eq!(m.push("b"), Stopped(String::new()));
    }

    #[test]
    fn overlapping_stop_strings_earliest_start_wins() {
        let mut m = StopMatcher::new(&stops(&["bc", "abcd"]));
        assert_eq!(m.push("xabcd"), Stopped("x".into()));
        let mut m = StopMatcher::new(&stops(&["bcd", "ab"]));
        assert_eq!(m.push("xa"), Continue("x".into()));
        assert_eq!(m.push("bcd"), Stopped(String::new()));
        // A held partial match that fails releases its text.
        let mut m = StopMatcher::new(&stops(&["aab"]));
        assert_eq!(m.push("a"), Continue(String::new()));
        assert_eq!(m.push("a"), Continue(String::new()));
        assert_eq!(m.push("a"), Continue("a".into()));
        assert_eq!(m.push("b"), Stopped(String::new()));
        // A shorter stop that completes first beats a longer one still in progress ...
        let mut m = StopMatcher::new(&stops(&["abc", "b"]));
        assert_eq!(m.push("xa"), Continue("x".into()));
        assert_eq!(m.push("b"), Stopped("a".into()));
        // ... but when both are complete in the same delta, the one starting first wins.
        let mut m = StopMatcher::new(&stops(&["abc", "b"]));
        assert_eq!(m.push("xabc"), Stopped("x".into()));
    }

    #[test]
    fn failed_partial_match_is_released() {
        let mut m = StopMatcher::new(&stops(&["abc"]));
        assert_eq!(m.push("ab"), Continue(String::new()));
        assert_eq!(m.push("x"), Continue("abx".into()));
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn no_stop_flush_returns_the_held_text() {
        let mut m = StopMatcher::new(&stops(&["END"]));
        assert_eq!(m.push("the EN"), Continue("the ".into()));
        assert_eq!(m.flush(), "EN");
        assert_eq!(m.flush(), "");
        let mut m = StopMatcher::new(&[]);
        assert_eq!(m.push("anything"), Continue("anything".into()));
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn multibyte_stop_strings() {
        let mut m = StopMatcher::new(&stops(&["你好", "😀!"]));
        assert_eq!(m.push("a你"), Continue("a".into()));
        assert_eq!(m.push("x😀"), Continue("你x".into()));
        assert_eq!(m.push("!"), Stopped(String::new()));
    }

    /// Reference over the whole accumulated text: after each delta, if the text so far contains
    /// a stop, the answer is the text before the earliest occurrence.
    fn reference(deltas: &[String], stops: &[String]) -> (String, bool) {
        let mut text = String::new();
        for d in deltas {
            text += d;
            if let Some(p) = stops.iter().filter_map(|s| text.find(s.as_str())).min() {
                return (text[..p].to_string(), true);
            }
        }
        (text, false)
    }

    #[test]
    fn random_streams_match_the_reference() {
        let alphabet = ['a', 'b', 'é', '😀'];
        let mut rng = ChaCha8Rng::seed_from_u64(31337);
        let word = |rng: &mut ChaCha8Rng, len: std::ops::Range<usize>| -> String {
            let n = rng.random_range(len);
            (0..n).map(|_| *alphabet.choose(rng).unwrap()).collect()
        };
        for _ in 0..3000 {
            let n_stops = rng.random_range(0..4);
            let stop_list: Vec<String> = (0..n_stops).map(|_| word(&mut rng, 1..5)).collect();
            let text = word(&mut rng, 0..24);
            let chars: Vec<char> = text.chars().collect();
            let mut deltas = Vec::new();
            let mut i = 0;
            while i < chars.len() {
                let take = rng.random_range(0..4).min(chars.len() - i);
                deltas.push(chars[i..i + take].iter().collect::<String>());
                i += take;
            }
            let mut m = StopMatcher::new(&stop_list);
            let mut out = String::new();
            let mut stopped = false;
            for delta in &deltas {
                if stopped {
                    break;
                }
                match m.push(delta) {
                    Continue(t) => out += &t,
                    Stopped(t) => {
                        out += &t;
                        stopped = true;
                    }
                }
                // Emitted text never contains a stop string.
                assert!(stop_list.iter().all(|s| !out.contains(s.as_str())));
            }
            if !stopped {
                out += &m.flush();
            }
            assert_eq!(
                (out, stopped),
                reference(&deltas, &stop_list),
                "{deltas:?} stops {stop_list:?}"
            );
        }
    }
}
