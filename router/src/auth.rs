//! API keys: who may use the router. Clients send `authorization: Bearer KEY` (gRPC metadata or
//! the HTTP header); a router given no keys is open to anyone who can reach it.
//!
//! Invariants:
//! - A refused request never reaches routing (no tokenizing, no node call, no metrics beyond the refusal).
//! - Keys are compared in time independent of where they differ; the set can be replaced while
//!   serving (SIGHUP re-reads the file) and a request sees either the old set or the new one.
//! - Health and metrics stay open (probes and scrapers carry no keys).

use std::path::Path;
use std::sync::RwLock;

/// The longest key accepted in a key file.
pub const MAX_KEY_LEN: usize = 512;

/// The router's key set (`None`: open).
#[derive(Debug, Default)]
pub(crate) struct ApiKeys(RwLock<Option<Vec<Vec<u8>>>>);

/// Why a request was refused.
pub(crate) const REFUSED: &str = "missing or invalid API key: send the header `authorization: Bearer KEY`";

impl ApiKeys {
    pub(crate) fn set(&self, keys: Option<Vec<String>>) {
        let keys = keys.map(|k| k.into_iter().map(String::into_bytes).collect());
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = keys;
    }

    pub(crate) fn is_open(&self) -> bool {
        self.0.read().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    /// Whether an `authorization` header value (if any) carries a valid key.
    pub(crate) fn allows(&self, authorization: Option<&[u8]>) -> bool {
        let guard = self.0.read().unwrap_or_else(|p| p.into_inner());
        let Some(keys) = guard.as_ref() else { return true };
        let Some(given) = authorization.and_then(bearer) else { return false };
        // Every key is compared in full: no early exit on a match either.
        keys.iter().fold(false, |found, k| found | same(k, given))
    }
}

/// The token of `Bearer TOKEN` (scheme case-insensitive, as RFC 9110 says).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| rest.trim_ascii())
}

/// Equality in time that depends only on the lengths.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads a key file: one key per line; blank lines and lines starting with `#` are skipped. A key is
/// 1 to [`MAX_KEY_LEN`] visible ASCII characters. A file without keys is an error (it would lock
/// everyone out).
pub fn read_key_file(path: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading the API key file {}: {e}", path.display()))?;
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let key = line.trim();
        if key.is_empty() || key.starts_with('#') {
            continue;
        }
        if key.len() > MAX_KEY_LEN || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "{} line {}: a key is 1 to {MAX_KEY_LEN} visible ASCII characters without spaces",
                path.display(),
                i + 1
            ));
        }
        keys.push(key.to_string());
    }
    if keys.is_empty() {
        return Err(format!("the API key file {} holds no key", path.display()));
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_listed_bearer_key_passes() {
        let keys = ApiKeys::default();
        assert!(keys.is_open() && keys.allows(None));
        keys.set(Some(vec!["sk-one".into(), "sk-two".into()]));
        assert!(!keys.is_open());
        for ok in ["Bearer sk-one", "bearer sk-two", "BEARER   sk-two  "] {
            assert!(keys.allows(Some(ok.as_bytes())), "{ok:?}");
        }
        for bad in ["", "sk-one", "Bearer", "Bearer ", "Bearer sk-on", "Bearer sk-one2", "Basic sk-one", "Bearer sk-ONE"] {
            assert!(!keys.allows(Some(bad.as_bytes())), "{bad:?}");
        }
        assert!(!keys.allows(None));
        keys.set(None);
        assert!(keys.allows(None), "open again");
    }

    #[test]
    fn key_files_are_checked() {
        let dir = std::env::temp_dir().join(format!("tandem-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let good = write("good", "# team keys\nsk-one\n\n  sk-two  \n");
        assert_eq!(read_key_file(&good).unwrap(), vec!["sk-one", "sk-two"]);
        let empty = write("empty", "# nothing here\n\n");
        assert!(read_key_file(&empty).unwrap_err().contains("holds no key"));
        let spaced = write("spaced", "sk one\n");
        assert!(read_key_file(&spaced).unwrap_err().contains("line 1"));
        let long = write("long", &"k".repeat(MAX_KEY_LEN + 1));
        assert!(read_key_file(&long).is_err());
        assert!(read_key_file(&dir.join("missing")).unwrap_err().contains("reading"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
