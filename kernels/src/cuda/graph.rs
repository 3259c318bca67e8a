//! CUDA graphs of a [`super::Gpu`]'s stream: record a sequence of launches once, replay it with one call.
//!
//! Invariant: a captured graph reads and writes only device buffers that existed before the
//! capture and outlive the graph (the caller keeps them); replaying it re-runs the recorded
//! launches with the recorded arguments, so inputs change only through the contents of those
//! buffers.

use std::sync::Arc;

use cudarc::driver::{CudaGraph, CudaStream};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::error::{GpuError, Result};

/// An instantiated graph of launches on one [`Gpu`]'s stream.
pub struct Graph(CudaGraph);

// SAFETY: a CUDA graph exec may be used from any thread as long as it is not used from two at
// once; `Graph` is `Send` but not `Sync`, and `launch` takes `&self` of a value one thread owns.
unsafe impl Send for Graph {}

impl Graph {
    /// Replays the graph on the stream it was captured from (asynchronously).
    pub fn launch(&self) -> Result<()> {
        Ok(self.0.launch()?)
    }
}

/// Captures every launch `record` enqueues on `stream` (a [`Gpu::stream`]) into a graph, without
/// running them. `record` must not synchronise or allocate device memory. Capture is
/// thread-local, so CUDA calls of other threads are unaffected.
pub fn capture<E: From<GpuError>>(stream: &Arc<CudaStream>, record: impl FnOnce() -> std::result::Result<(), E>) -> std::result::Result<Graph, E> {
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(GpuError::from)?;
    let recorded = record();
    // End the capture whatever happened, so the stream is usable again.
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    recorded?;
    match graph.map_err(GpuError::from)? {
        Some(g) => Ok(Graph(g)),
        None => Err(GpuError::Driver("the graph capture recorded nothing".into()).into()),
    }
}
