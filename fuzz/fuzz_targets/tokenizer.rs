//! libFuzzer entry of the `tokenizer` target; the body and its invariants are in `bodies/src/tokenizer.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz::tokenizer::run(data));
