//! libFuzzer entry of the `router_request` target; the body and its invariants are in `bodies/src/router_request.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz::router_request::run(data));
