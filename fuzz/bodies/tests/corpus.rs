//! Every committed corpus file of every fuzz target (`fuzz/corpus/TARGET/*`, crash inputs included)
//! through the target's body, on stable Rust: the corpora are regression tests. One test, so the
//! targets run one after another on one thread (their allocation bounds read process-wide counters).

use std::path::Path;

#[test]
fn every_corpus_file_passes_its_target() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus");
    let mut total = 0;
    for (name, body) in tandem_fuzz::TARGETS {
        let dir = root.join(name);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("a directory entry").path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "target {name} has no corpus in {}", dir.display());
        for file in &files {
            let data = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            eprintln!("{name}: {}", file.display());
            body(&data);
        }
        total += files.len();
    }
    tandem_fuzz::safetensors::cleanup();
    assert!(total > 0);
}
