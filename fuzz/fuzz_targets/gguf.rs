//! libFuzzer entry of the `gguf` target; the body and its invariants are in `bodies/src/gguf.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz::gguf::run(data));
