//! NVRTC compilation of the kernel sources in `kernels/cuda/`, and the on-disk CUBIN cache.
//!
//! The sources are one translation unit, concatenated in a fixed order ([`SOURCE`]): NVRTC has no
//! include path, and the headers of a CUDA toolkit are not there at run time anyway. We compile to
//! a CUBIN for the device's real architecture (`sm_XY`), never to PTX, so loading involves no JIT.
//!
//! Invariants: nothing here needs CUDA at build time; an NVRTC that cannot be loaded is
//! [`GpuError::NoLibrary`] (cudarc would panic, so we check first); a cached CUBIN is keyed by a hash
//! of (source, architecture, NVRTC version, options), so any change to any of them recompiles; cache
//! files are written atomically (temporary file + rename) and a cache that cannot be written is
//! only a lost speed-up, never an error.

use std::ffi::{CString, c_char, c_int};
use std::path::PathBuf;

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use super::error::{GpuError, Result};

/// Every kernel, as one CUDA C translation unit. Order matters: helpers first.
pub(crate) const SOURCE: &str = concat!(
    include_str!("../../cuda/common.cuh"),
    "\n",
    include_str!("../../cuda/elementwise.cu"),
    "\n",
    include_str!("../../cuda/attention_common.cuh"),
    "\n",
    include_str!("../../cuda/attention_prefill.cu"),
    "\n",
    include_str!("../../cuda/attention_decode.cu"),
    "\n",
    include_str!("../../cuda/sampling.cu"),
    "\n",
    include_str!("../../cuda/kv_copy.cu"),
);

/// Options for every compilation besides the architecture. No fast math: `expf`, `sincosf` and
/// divisions are the accurate versions (the defaults, spelled out so the cache key names them).
const OPTIONS: [&str; 6] = [
    "-std=c++17",
    "-default-device",
    "--fmad=true",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
];

const NVRTC_HINT: &str = "put the directory holding libnvrtc.so.13 and libnvrtc-builtins.so.13.* on \
     LD_LIBRARY_PATH (a CUDA 13 toolkit's lib64, or the directory scripts/fetch-nvrtc.sh prints)";

/// `NoLibrary` unless libnvrtc can be loaded (cudarc panics on first use otherwise).
pub(crate) fn check_nvrtc() -> Result<()> {
    // SAFETY: only tries to dlopen the candidate library names; no NVRTC function is called.
    if unsafe { nvrtc_sys::is_culib_present() } {
        Ok(())
    } else {
        Err(GpuError::NoLibrary {
            lib: "libnvrtc.so.13",
            hint: NVRTC_HINT.to_string(),
        })
    }
}

/// Compiles the whole kernel source for `arch` (e.g. `"sm_90"`) and returns the CUBIN. Needs
/// NVRTC only, no device: CI uses it to check that every kernel compiles.
pub fn compile(arch: &str) -> Result<Vec<u8>> {
    compile_source(SOURCE, arch)
}

/// Compiles arbitrary CUDA C `source` for `arch` with the same options as [`compile`]. A source
/// NVRTC rejects is [`GpuError::Compile`] carrying NVRTC's log.
pub fn compile_source(source: &str, arch: &str) -> Result<Vec<u8>> {
    check_nvrtc()?;
    let src = CString::new(source).map_err(|_| GpuError::Compile {
        log: "source contains a NUL byte".into(),
    })?;
    let program = Program(nvrtc::create_program(&src, Some(c"tandem.cu"))?);
    let mut options = vec![format!("--gpu-architecture={arch}")];
    options.extend(OPTIONS.iter().map(|o| o.to_string()));
    // SAFETY: `program` is a live program from create_program, destroyed only by its Drop.
    let compiled = unsafe { nvrtc::compile_program(program.0, &options) };
    // SAFETY: as above.
    let log = unsafe { nvrtc::get_program_log(program.0) }
        .map(c_chars_to_string)
        .unwrap_or_default();
    if compiled.is_err() {
        return Err(GpuError::Compile { log });
    }
    let mut size = 0usize;
    // SAFETY: live program; `size` is a valid out-pointer.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(program.0, &mut size) }.result()?;
    let mut cubin = vec![0u8; size];
    // SAFETY: live program; `cubin` has exactly the size NVRTC reported.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr().cast::<c_char>()) }.result()?;
    if cubin.is_empty() {
        return Err(GpuError::Nvrtc(format!(
            "NVRTC returned an empty CUBIN for {arch}"
        )));
    }
    Ok(cubin)
}

/// Destroys the NVRTC program on every path out of [`compile_source`].
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program came from create_program and is destroyed exactly once, here.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

fn c_chars_to_string(v: Vec<c_char>) -> String {
    let bytes: Vec<u8> = v
        .into_iter()
        .take_while(|&c| c != 0)
        .map(|c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// NVRTC's `(major, minor)` version.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    check_nvrtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: two valid out-pointers; the library is loadable (checked above).
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }.result()?;
    Ok((major, minor))
}

/// Where compiled kernels are cached: `$TANDEM_CACHE_DIR/kernels`, else
/// `$XDG_CACHE_HOME/tandem/kernels`, else `$HOME/.cache/tandem/kernels`; `None` when none of these
/// variables is set (then nothing is cached).
pub fn cache_dir() -> Option<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = var("TANDEM_CACHE_DIR") {
        return Some(dir.join("kernels"));
    }
    let base = var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|h| h.join(".cache")))?;
    Some(base.join("tandem").join("kernels"))
}

/// FNV-1a, 64 bits: stable across Rust releases (unlike `DefaultHasher`), enough for a cache key.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &b in part.iter().chain(&[0xffu8]) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The cache file for the kernel source compiled for `arch` by this NVRTC.
fn cache_path(arch: &str) -> Result<Option<PathBuf>> {
    let Some(dir) = cache_dir() else {
        return Ok(None);
    };
    let (major, minor) = nvrtc_version()?;
    let version = format!("{major}.{minor}");
    let options = OPTIONS.join(" ");
    let key = fnv1a(&[
        SOURCE.as_bytes(),
        arch.as_bytes(),
        version.as_bytes(),
        options.as_bytes(),
    ]);
    Ok(Some(dir.join(format!("{arch}-{key:016x}.cubin"))))
}

/// A cached CUBIN for `arch` if there is one, else compiles and caches it. Returns the CUBIN and
/// whether it came from the cache (the caller recompiles with [`compile`] if it fails to load).
pub(crate) fn compile_cached(arch: &str) -> Result<(Vec<u8>, bool)> {
    let path = cache_path(arch)?;
    if let Some(bytes) = path
        .as_ref()
        .and_then(|p| std::fs::read(p).ok())
        .filter(|b| !b.is_empty())
    {
        return Ok((bytes, true));
    }
    let cubin = compile(arch)?;
    if let Some(path) = path {
        store(&path, &cubin);
    }
    Ok((cubin, false))
}

/// Writes `bytes` to `path` atomically; failures are ignored (the cache is only a speed-up).
pub(crate) fn store(path: &std::path::Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tmp = dir.join(format!(".tmp-{}-{nanos}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_ok() {
        return;
    }
    let _ = std::fs::remove_file(&tmp);
}

/// Removes the cache entry for `arch` (used when a cached CUBIN fails to load).
pub(crate) fn forget(arch: &str) {
    if let Ok(Some(path)) = cache_path(arch) {
        let _ = std::fs::remove_file(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_hash_is_stable_and_separates_parts() {
        assert_eq!(fnv1a(&[]), 0xcbf2_9ce4_8422_2325);
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_eq!(fnv1a(&[b"sm_90"]), fnv1a(&[b"sm_90"]));
    }
}
