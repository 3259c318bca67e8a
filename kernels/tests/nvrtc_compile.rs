//! CI check, no GPU needed: every CUDA kernel compiles with NVRTC for the architectures we run on.
//!
//! Needs libnvrtc on the loader path: `LD_LIBRARY_PATH=$(scripts/fetch-nvrtc.sh | tail -1)`. A
//! missing NVRTC FAILS these tests (never skips them), so CI cannot pass without compiling the
//! kernels.

use tandem_kernels::cuda::{self, GpuError};

fn nvrtc_or_fail() {
    if let Err(e) = cuda::nvrtc_version() {
        panic!(
            "NVRTC is not loadable ({e}); run `LD_LIBRARY_PATH=$(scripts/fetch-nvrtc.sh | tail -1) \
             cargo test -p tandem-kernels --release --test nvrtc_compile`"
        );
    }
}

fn compiles_for(arch: &str) {
    nvrtc_or_fail();
    match cuda::compile(arch) {
        Ok(cubin) => {
            assert!(
                cubin.len() > 1024,
                "{arch}: CUBIN of only {} bytes",
                cubin.len()
            );
            assert_eq!(&cubin[..4], b"\x7fELF", "{arch}: a CUBIN is an ELF image");
        }
        Err(GpuError::Compile { log }) => panic!("kernels do not compile for {arch}:\n{log}"),
        Err(e) => panic!("compiling for {arch}: {e}"),
    }
}

#[test]
fn kernels_compile_for_sm_90() {
    compiles_for("sm_90");
}

#[test]
fn kernels_compile_for_sm_80() {
    compiles_for("sm_80");
}

#[test]
fn a_syntax_error_is_a_compile_error_with_the_log() {
    nvrtc_or_fail();
    let src = "extern \"C\" __global__ void broken(float* x) { x[0] = 1.0f +; }";
    match cuda::compile_source(src, "sm_90") {
        Err(GpuError::Compile { log }) => {
            assert!(log.contains("error"), "log should name the error: {log}");
            assert!(log.contains("tandem.cu"), "log should name the file: {log}");
        }
        other => panic!("expected GpuError::Compile, got {other:?}"),
    }
}

#[test]
fn nvrtc_is_new_enough() {
    nvrtc_or_fail();
    let (major, _) = cuda::nvrtc_version().unwrap();
    assert!(
        major >= 12,
        "NVRTC {major}.x is older than the kernels need (sm_90, cp.async, bf16 PTX)"
    );
}
