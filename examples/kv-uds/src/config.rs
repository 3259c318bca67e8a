//! The instance configuration: the text after `?` in `--kv-connector plugin:/path/lib.so?config`.
//!
//! Format: `key=value` pairs separated by `&`, taken verbatim (no escaping, so a value cannot hold
//! `&`). Empty pairs are ignored. Known keys:
//!  - `dir`: the directory the listening socket is created in (default: `std::env::temp_dir()`).
//!
//! Invariant: unknown keys, repeated keys and pairs without `=` are errors, never silently ignored,
//! and the directory in a parsed [`Config`] is absolute (the endpoint must work from another process).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use crate::error::Failure;

/// A validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Config {
    /// Absolute directory for the listening socket.
    pub(crate) dir: PathBuf,
}

impl Config {
    /// Parses the config text (bytes, since a path need not be UTF-8).
    pub(crate) fn parse(text: &[u8]) -> Result<Config, Failure> {
        let mut dir: Option<PathBuf> = None;
        for pair in text.split(|&b| b == b'&').filter(|pair| !pair.is_empty()) {
            let shown = String::from_utf8_lossy(pair);
            let Some(eq) = pair.iter().position(|&b| b == b'=') else {
                return Err(Failure::invalid(format!(
                    "config: `{shown}` is not key=value"
                )));
            };
            let (key, value) = (&pair[..eq], &pair[eq + 1..]);
            match key {
                b"dir" => {
                    if dir.is_some() {
                        return Err(Failure::invalid("config: `dir` given twice"));
                    }
                    if value.is_empty() {
                        return Err(Failure::invalid("config: `dir` is empty"));
                    }
                    dir = Some(PathBuf::from(OsStr::from_bytes(value)));
                }
                _ => {
                    let key = String::from_utf8_lossy(key);
                    return Err(Failure::invalid(format!(
                        "config: unknown key `{key}` (known: dir)"
                    )));
                }
            }
        }
        let dir = dir.unwrap_or_else(std::env::temp_dir);
        let dir = std::path::absolute(&dir).map_err(|e| {
            Failure::invalid(format!("config: cannot resolve dir {}: {e}", dir.display()))
        })?;
        Ok(Config { dir })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi;

    #[test]
    fn empty_config_uses_the_temp_dir() {
        let config = Config::parse(b"").unwrap();
        assert_eq!(
            config.dir,
            std::path::absolute(std::env::temp_dir()).unwrap()
        );
        assert_eq!(Config::parse(b"&&").unwrap(), config);
    }

    #[test]
    fn dir_is_taken_verbatim_and_made_absolute() {
        assert_eq!(
            Config::parse(b"dir=/tmp/x").unwrap().dir,
            PathBuf::from("/tmp/x")
        );
        assert_eq!(
            Config::parse(b"&dir=/a b/c&").unwrap().dir,
            PathBuf::from("/a b/c")
        );
        let relative = Config::parse(b"dir=rel").unwrap().dir;
        assert!(
            relative.is_absolute() && relative.ends_with("rel"),
            "{}",
            relative.display()
        );
    }

    #[test]
    fn bad_configs_are_invalid_with_a_reason() {
        for (text, needle) in [
            (&b"dir"[..], "not key=value"),
            (b"dir=", "empty"),
            (b"dir=/a&dir=/b", "twice"),
            (b"port=9", "unknown key `port`"),
            (b"=x", "unknown key ``"),
        ] {
            let failure = Config::parse(text).unwrap_err();
            assert_eq!(failure.status(), abi::TANDEM_KV_ERR_INVALID);
            assert!(
                failure.message().contains(needle),
                "{:?}: {}",
                String::from_utf8_lossy(text),
                failure.message()
            );
        }
    }
}
