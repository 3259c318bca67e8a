//! The one error type of the CUDA module: what failed, classified where it happened.

/// A failure of the GPU runtime or a launcher.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// A CUDA shared library could not be loaded (no driver, or the library is not on the
    /// loader's path).
    #[error("cannot load {lib}: {hint}")]
    NoLibrary {
        /// The library that is missing, e.g. `libnvrtc.so.13`.
        lib: &'static str,
        /// How to make it loadable.
        hint: String,
    },
    /// A CUDA driver call failed (device missing, out of memory, launch failure, ...).
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// NVRTC rejected the kernel source; `log` is its compile log.
    #[error("NVRTC compilation failed:\n{log}")]
    Compile {
        /// NVRTC's program log (errors with file and line).
        log: String,
    },
    /// An NVRTC call other than the compilation itself failed.
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Blas(String),
    /// A launcher was given buffers or sizes that do not fit together.
    #[error("bad shape: {0}")]
    BadShape(String),
}

/// The result type of every fallible call in [`crate::cuda`].
pub type Result<T> = std::result::Result<T, GpuError>;

impl From<cudarc::driver::DriverError> for GpuError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        let name = e.error_string().map(|s| s.to_string_lossy().into_owned());
        GpuError::Driver(match name {
            Ok(s) => format!("{:?}: {s}", e.0),
            Err(_) => format!("{:?}", e.0),
        })
    }
}

impl From<cudarc::cublas::result::CublasError> for GpuError {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        GpuError::Blas(format!("{:?}", e.0))
    }
}

impl From<cudarc::nvrtc::result::NvrtcError> for GpuError {
    fn from(e: cudarc::nvrtc::result::NvrtcError) -> Self {
        GpuError::Nvrtc(format!("{:?}", e.0))
    }
}

/// `BadShape` unless `have >= need` (buffers may be larger than a launch needs).
pub(crate) fn need_len(what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(GpuError::BadShape(format!(
            "{what} holds {have} elements, the launch needs {need}"
        )));
    }
    Ok(())
}

/// `v` as an `i32` kernel argument, or `BadShape`.
pub(crate) fn to_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| GpuError::BadShape(format!("{what} = {v} does not fit in i32")))
}

/// `BadShape(msg)` unless `ok`.
pub(crate) fn check(ok: bool, msg: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(GpuError::BadShape(msg()))
    }
}
