//! Checks shared by the launchers: device addresses and their alignment, launch geometry.

use cudarc::driver::{CudaStream, DevicePtr};

/// The device address of a buffer (for alignment checks and nullable kernel arguments).
pub(crate) fn addr<T, P: DevicePtr<T>>(p: &P, stream: &CudaStream) -> u64 {
    // Event tracking is off (see `gpu.rs`), so the returned guard records nothing.
    let (a, _guard) = p.device_ptr(stream);
    a
}

/// Whether every address is a multiple of `bytes`.
pub(crate) fn aligned(addrs: &[u64], bytes: u64) -> bool {
    addrs.iter().all(|a| a % bytes == 0)
}

/// `n.div_ceil(d)` as a grid dimension.
pub(crate) fn blocks(n: usize, d: usize) -> u32 {
    n.div_ceil(d) as u32
}
