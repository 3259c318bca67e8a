//! libFuzzer entry of the `safetensors` target; the body and its invariants are in `bodies/src/safetensors.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz::safetensors::run(data));
