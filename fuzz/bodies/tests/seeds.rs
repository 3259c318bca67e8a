//! The seeds reach the deep paths they were written for (otherwise the fuzzer would start shallow).

use std::path::Path;

fn seed(target: &str, name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus").join(target).join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_tiny_llama_gguf_passes_every_import_check() {
    let bytes = seed("gguf", "seed-tiny-llama");
    let checked = tandem_engine::gguf::check_import(&bytes, &Default::default(), usize::MAX).expect("accepted");
    assert_eq!(checked.tensors.len(), 11);
}

#[test]
fn the_router_seeds_are_let_through() {
    use tandem_router::http::fuzz::{Api, admit_http};
    let tok = tandem_fuzz::router_request::tokenizer();
    for (name, api) in [("seed-completion", Api::Completions), ("seed-chat", Api::Chat)] {
        let data = seed("router_request", name);
        let results = admit_http(api, &data[2..], tok, 1 + 2 * usize::from(data[1]));
        assert!(!results.is_empty() && results.iter().all(Result::is_ok), "{name}: {results:?}");
    }
}
