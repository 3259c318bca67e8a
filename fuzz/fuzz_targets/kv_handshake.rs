//! libFuzzer entry of the `kv_handshake` target; the body and its invariants are in `bodies/src/kv_handshake.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz::kv_handshake::run(data));
