//! libFuzzer entry of the `kv_frame` target; the body and its invariants are in `bodies/src/kv_frame.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz::kv_frame::run(data));
