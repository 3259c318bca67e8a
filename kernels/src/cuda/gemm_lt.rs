//! The GEMM of [`super::gemm`] through cuBLASLt with an explicitly chosen algorithm, so a caller
//! can time the candidates cuBLASLt's heuristic proposes for one shape and keep the fastest
//! (cublasGemmEx always takes the heuristic's first choice).
//!
//! Layout as in `gemm.rs`: row-major `out[m, n] (+)= x[m, k] · w[n, k]ᵀ` is column-major
//! `out'[n, m] = op(w')·x'` with `w'` `[k, n]` (ld k) and op = transpose, `x'` `[k, m]` (ld k),
//! `out'` `[n, m]` (ld n).
//!
//! Invariant: a [`LtGemm`] runs on [`Gpu::stream`] with its own fixed workspace, and an
//! [`LtAlgo`] never needs more workspace than that, so its GEMMs can be captured in a graph.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr};
use half::bf16;

use super::error::{GpuError, Result, to_i32};
use super::gemm::GemmOut;
use super::gpu::Gpu;

/// Workspace of the cuBLASLt handle (as for cuBLAS: 32 MiB on Hopper).
const LT_WORKSPACE_BYTES: usize = 32 << 20;

fn blas_err(e: lt::CublasError) -> GpuError {
    GpuError::Blas(format!("cuBLASLt: {:?}", e.0))
}

/// A cuBLASLt handle and its workspace, on one [`Gpu`]'s stream.
#[derive(Debug)]
pub struct LtGemm {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
}

// SAFETY: the handle is only used through &self methods that enqueue on `stream`; cuBLASLt
// handles may be used from any thread (not concurrently, which &self + the one stream ensure
// for our callers, who hold the engine exclusively).
unsafe impl Send for LtGemm {}

impl Drop for LtGemm {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `new` and is destroyed once; work already enqueued
        // keeps its own references inside the driver.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

/// One cuBLASLt algorithm for one GEMM shape, as the heuristic proposed it.
#[derive(Clone, Copy, Debug)]
pub struct LtAlgo {
    algo: sys::cublasLtMatmulAlgo_t,
    /// Bytes of workspace it needs.
    pub workspace: usize,
    /// The heuristic's estimate of the waves of CTAs the algorithm launches.
    pub waves: f32,
}

/// The descriptors of one GEMM shape, destroyed on drop.
#[derive(Debug)]
struct Desc {
    shape: GemmShape,
    matmul: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: each non-null descriptor was created in `Desc::new` and is destroyed once (a
        // layout stays null when `Desc::new` failed before creating it).
        unsafe {
            for layout in [self.c, self.b, self.a] {
                if !layout.is_null() {
                    let _ = lt::destroy_matrix_layout(layout);
                }
            }
            let _ = lt::destroy_matmul_desc(self.matmul);
        }
    }
}

// SAFETY: the descriptors are host-side objects owned by this value; cuBLASLt only reads them
// in calls made through `&self` of the one `LtGemm`/`GemmPlans` that holds the engine.
unsafe impl Send for Desc {}

impl Desc {
    fn new(shape: GemmShape) -> Result<Desc> {
        let GemmShape { m, n, k, f32_out: out_f32 } = shape;
        let (mi, ni, ki) = (to_i32("m", m)?, to_i32("n", n)?, to_i32("k", k)?);
        let matmul = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(blas_err)?;
        let mut desc = Desc {
            shape,
            matmul,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
        };
        let trans: i32 = 1; // CUBLAS_OP_T
        // SAFETY: the descriptor is live; the attribute is an int32 read from a live local.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc.matmul,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&trans as *const i32).cast(),
                std::mem::size_of::<i32>(),
            )
        }
        .map_err(blas_err)?;
        let bf = sys::cudaDataType::CUDA_R_16BF;
        desc.a = lt::create_matrix_layout(bf, ki as u64, ni as u64, ki as i64).map_err(blas_err)?;
        desc.b = lt::create_matrix_layout(bf, ki as u64, mi as u64, ki as i64).map_err(blas_err)?;
        let ct = if out_f32 { sys::cudaDataType::CUDA_R_32F } else { bf };
        desc.c = lt::create_matrix_layout(ct, ni as u64, mi as u64, ni as i64).map_err(blas_err)?;
        Ok(desc)
    }
}

impl LtGemm {
    /// A handle on `gpu`'s stream. Fails with [`GpuError::NoLibrary`] without libcublasLt.
    pub fn new(gpu: &Gpu) -> Result<LtGemm> {
        // SAFETY: only tries to dlopen the candidate library names.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::NoLibrary {
                lib: "libcublasLt.so.13",
                hint: "put the directory holding libcublasLt.so.13 (CUDA 13) on LD_LIBRARY_PATH".into(),
            });
        }
        gpu.bind()?;
        let handle = lt::create_handle().map_err(blas_err)?;
        let stream = gpu.stream().clone();
        let workspace = match stream.alloc_zeros::<u8>(LT_WORKSPACE_BYTES) {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: created just above, used by nothing else.
                unsafe {
                    let _ = lt::destroy_handle(handle);
                }
                return Err(e.into());
            }
        };
        Ok(LtGemm { handle, workspace, stream })
    }

    /// Up to `max` algorithms cuBLASLt's heuristic proposes for `out[m, n] (+)= x[m, k] · w[n, k]ᵀ`
    /// (f32 or bf16 `out`), best guess first, each within this handle's workspace.
    pub fn candidates(&self, m: usize, n: usize, k: usize, out_f32: bool, max: usize) -> Result<Vec<LtAlgo>> {
        if m == 0 || n == 0 || k == 0 || max == 0 {
            return Ok(Vec::new());
        }
        let desc = Desc::new(GemmShape { m, n, k, f32_out: out_f32 })?;
        let pref = lt::create_matmul_pref().map_err(blas_err)?;
        let ws = LT_WORKSPACE_BYTES;
        // SAFETY: the preference is live; the attribute is a u64 read from a live local.
        let set = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const usize).cast(),
                std::mem::size_of::<usize>(),
            )
        };
        let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> = Vec::with_capacity(max);
        let mut count = 0i32;
        // SAFETY: all descriptors are live; `results` has room for `max` entries, of which the
        // call initialises `count`.
        let status = set.and_then(|()| unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc.matmul,
                desc.a,
                desc.b,
                desc.c,
                desc.c,
                pref,
                max.min(i32::MAX as usize) as i32,
                results.as_mut_ptr(),
                &mut count,
            )
            .result()
        });
        // SAFETY: created above, destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_pref(pref);
        }
        status.map_err(blas_err)?;
        // SAFETY: the call initialised the first `count` (<= max) entries.
        unsafe { results.set_len((count.max(0) as usize).min(max)) };
        Ok(results
            .into_iter()
            .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= ws)
            .map(|r| LtAlgo { algo: r.algo, workspace: r.workspaceSize, waves: r.wavesCount })
            .collect())
    }

    /// `out[m, n] (+)= x[m, k] · w[n, k]ᵀ` with `algo`, which must come from [`Self::candidates`]
    /// for the same `m, n, k` and output type. Buffers as for [`super::gemm`].
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        gpu: &Gpu,
        x: &CudaView<'_, bf16>,
        w: &CudaView<'_, bf16>,
        out: GemmOut<'_>,
        m: usize,
        n: usize,
        k: usize,
        algo: &LtAlgo,
    ) -> Result<()> {
        let f32_out = matches!(out, GemmOut::F32 { .. });
        self.matmul(gpu, &Desc::new(GemmShape { m, n, k, f32_out })?, x, w, out, algo)
    }

    /// [`Self::gemm`] with the shape's descriptors made beforehand (they must describe `out`'s
    /// type and the operands' shape).
    fn matmul(&self, gpu: &Gpu, desc: &Desc, x: &CudaView<'_, bf16>, w: &CudaView<'_, bf16>, out: GemmOut<'_>, algo: &LtAlgo) -> Result<()> {
        let GemmShape { m, n, k, f32_out } = desc.shape;
        if matches!(out, GemmOut::F32 { .. }) != f32_out {
            return Err(GpuError::BadShape("the GEMM output type differs from its plan's".into()));
        }
        let Some(op) = super::gemm::operands(gpu, x, w, out, m, n, k)? else { return Ok(()) };
        let one = 1.0f32;
        let (ws_ptr, _gw) = self.workspace.device_ptr(&self.stream);
        // SAFETY: the descriptors describe the checked buffer sizes and types; alpha/beta are
        // host f32 (the default pointer mode) for the f32 scale type; the algorithm came from the
        // heuristic for this shape and needs at most the workspace passed; the call only enqueues
        // on the stream the buffers belong to.
        unsafe {
            lt::matmul(
                self.handle,
                desc.matmul,
                (&one as *const f32).cast(),
                (&op.beta as *const f32).cast(),
                op.a as *const c_void,
                desc.a,
                op.b as *const c_void,
                desc.b,
                op.c as *const c_void,
                desc.c,
                op.c as *mut c_void,
                desc.c,
                &algo.algo,
                ws_ptr as *mut c_void,
                LT_WORKSPACE_BYTES,
                gpu.stream().cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(blas_err)?;
        Ok(())
    }

    /// Times `shape` through cuBLAS and through each of up to [`TUNE_CANDIDATES`] cuBLASLt
    /// heuristic candidates (median of 7 timed runs after 2 untimed ones, outputs written to
    /// `out`; `x` and `w` must hold `m*k` and `n*k` elements, their values do not matter).
    pub fn time_candidates(&self, gpu: &Gpu, shape: GemmShape, x: &CudaView<'_, bf16>, w: &CudaView<'_, bf16>, mut out: TuneOut<'_>) -> Result<ShapeTimes> {
        let GemmShape { m, n, k, f32_out } = shape;
        let candidates = self.candidates(m, n, k, f32_out, TUNE_CANDIDATES)?;
        let mut run = |algo: Option<&LtAlgo>| -> Result<()> {
            let dst = match &mut out {
                TuneOut::F32(o) => GemmOut::F32 { out: &mut o.slice_mut(..), accumulate: true },
                TuneOut::Bf16(o) => GemmOut::Bf16(&mut o.slice_mut(..)),
            };
            match algo {
                None => super::gemm(gpu, x, w, dst, m, n, k),
                Some(a) => self.gemm(gpu, x, w, dst, m, n, k, a),
            }
        };
        let blas_ms = gpu.time_median_ms(2, 7, || run(None))?;
        let mut candidates_ms = Vec::with_capacity(candidates.len());
        for a in &candidates {
            candidates_ms.push(gpu.time_median_ms(2, 7, || run(Some(a)))?);
        }
        Ok(ShapeTimes { blas_ms, candidates: candidates.into_iter().zip(candidates_ms).collect() })
    }
}

/// One shape timed by [`LtGemm::time_candidates`] (ms).
#[derive(Clone, Debug)]
pub struct ShapeTimes {
    /// cublasGemmEx.
    pub blas_ms: f64,
    /// Each cuBLASLt candidate, in the heuristic's order.
    pub candidates: Vec<(LtAlgo, f64)>,
}

/// One GEMM shape: `out[m, n] (+)= x[m, k] · w[n, k]ᵀ` with an f32 or a bf16 `out`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct GemmShape {
    /// Rows of `x` and `out`.
    pub m: usize,
    /// Rows of `w`, columns of `out`.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// `out` is f32 (else bf16).
    pub f32_out: bool,
}

/// Scratch output for timing one shape (overwritten).
#[derive(Debug)]
pub enum TuneOut<'a> {
    /// For shapes with an f32 `out`.
    F32(CudaViewMut<'a, f32>),
    /// For shapes with a bf16 `out`.
    Bf16(CudaViewMut<'a, bf16>),
}

/// What tuning chose for a shape: the index of a cuBLASLt heuristic candidate, or cuBLAS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Choice {
    Blas,
    Lt(usize),
}

/// Candidates timed per shape.
const TUNE_CANDIDATES: usize = 8;
/// A cuBLASLt algorithm replaces cuBLAS only when it is at least this much faster.
const TUNE_MIN_GAIN: f64 = 0.03;

/// GEMM plans: shapes tuned once (cuBLAS against cuBLASLt's heuristic candidates, each timed on
/// the device), every other shape through cuBLAS.
///
/// Choices are cached on disk next to the kernels (`gemm-<device>-lt<version>.tsv`, one
/// `m n k f32 choice` line per shape) and a cached shape is not timed again, so processes on one
/// machine (a prefill and a decode node, `tandem generate` and `tandem up`) run the same
/// algorithms and compute the same numbers. A choice is an index into the heuristic's list, which
/// is deterministic for one device and library version (both are in the file name).
///
/// Invariant: a shape's plan is fixed once tuned, and [`GemmPlans::gemm`] with a tuned shape
/// always runs the chosen algorithm (graph capture records it).
#[derive(Debug)]
pub struct GemmPlans {
    lt: LtGemm,
    /// Tuned shapes: the cuBLASLt algorithm and descriptors, or `None` for cuBLAS.
    plans: std::collections::HashMap<GemmShape, Option<(LtAlgo, Desc)>>,
    cache_file: Option<std::path::PathBuf>,
    cached: std::collections::HashMap<GemmShape, Choice>,
    /// `cached` holds choices the file does not.
    unsaved: bool,
}

impl GemmPlans {
    /// Plans for `gpu`, reading the disk cache (a missing or malformed cache is ignored).
    pub fn new(gpu: &Gpu) -> Result<GemmPlans> {
        let lt = LtGemm::new(gpu)?;
        // SAFETY: a plain query of the loaded library.
        let version = unsafe { sys::cublasLtGetVersion() };
        let device: String = gpu
            .name()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let cache_file = super::compile::cache_dir().map(|d| d.join(format!("gemm-{device}-lt{version}.tsv")));
        let cached = cache_file
            .as_ref()
            .and_then(|f| std::fs::read_to_string(f).ok())
            .map(|text| parse_cache(&text))
            .unwrap_or_default();
        Ok(GemmPlans { lt, plans: Default::default(), cache_file, cached, unsaved: false })
    }

    /// Plans `shape`: the cached choice if there is one, else the fastest of cuBLAS and the
    /// cuBLASLt candidates ([`LtGemm::time_candidates`], outputs written to `out`), which
    /// [`Self::save`] then writes to the cache. Returns whether cuBLASLt was chosen.
    pub fn tune(&mut self, gpu: &Gpu, shape: GemmShape, x: &CudaView<'_, bf16>, w: &CudaView<'_, bf16>, out: TuneOut<'_>) -> Result<bool> {
        if let Some(plan) = self.plans.get(&shape) {
            return Ok(plan.is_some());
        }
        let GemmShape { m, n, k, f32_out } = shape;
        let algo = match self.cached.get(&shape) {
            // A cached index the heuristic no longer offers falls back to cuBLAS.
            Some(&Choice::Lt(i)) => self.lt.candidates(m, n, k, f32_out, TUNE_CANDIDATES)?.get(i).copied(),
            Some(&Choice::Blas) => None,
            None => {
                let times = self.lt.time_candidates(gpu, shape, x, w, out)?;
                let mut best = (times.blas_ms * (1.0 - TUNE_MIN_GAIN), None);
                for (i, &(a, ms)) in times.candidates.iter().enumerate() {
                    if ms < best.0 {
                        best = (ms, Some((i, a)));
                    }
                }
                self.cached.insert(shape, best.1.map_or(Choice::Blas, |(i, _)| Choice::Lt(i)));
                self.unsaved = true;
                best.1.map(|(_, a)| a)
            }
        };
        let plan = match algo {
            Some(a) => Some((a, Desc::new(shape)?)),
            None => None,
        };
        let chosen = plan.is_some();
        self.plans.insert(shape, plan);
        Ok(chosen)
    }

    /// `out[m, n] (+)= x[m, k] · w[n, k]ᵀ` with the shape's plan (cuBLAS if it has none).
    /// Buffers as for [`super::gemm`].
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(&self, gpu: &Gpu, x: &CudaView<'_, bf16>, w: &CudaView<'_, bf16>, out: GemmOut<'_>, m: usize, n: usize, k: usize) -> Result<()> {
        let f32_out = matches!(out, GemmOut::F32 { .. });
        match self.plans.get(&GemmShape { m, n, k, f32_out }) {
            Some(Some((algo, desc))) => self.lt.matmul(gpu, desc, x, w, out, algo),
            _ => super::gemm(gpu, x, w, out, m, n, k),
        }
    }

    /// Shapes planned so far, and how many of them run cuBLASLt.
    pub fn counts(&self) -> (usize, usize) {
        (self.plans.len(), self.plans.values().filter(|p| p.is_some()).count())
    }

    /// Writes the shapes tuned since the last save to the disk cache, once after a batch of
    /// [`Self::tune`] calls (best effort: a read-only cache directory only costs re-tuning).
    pub fn save(&mut self) {
        if !std::mem::take(&mut self.unsaved) {
            return;
        }
        let Some(file) = &self.cache_file else { return };
        let mut lines: Vec<_> = self.cached.iter().collect();
        lines.sort_by_key(|(s, _)| **s);
        let text: String = lines
            .into_iter()
            .map(|(s, c)| {
                let c = match c {
                    Choice::Blas => "blas".to_string(),
                    Choice::Lt(i) => i.to_string(),
                };
                format!("{} {} {} {} {c}\n", s.m, s.n, s.k, u8::from(s.f32_out))
            })
            .collect();
        if let Some(dir) = file.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        // Write then rename, so a concurrent reader never sees half a file.
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, file);
        }
    }
}

/// Parses the cache file; malformed lines are skipped.
fn parse_cache(text: &str) -> std::collections::HashMap<GemmShape, Choice> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let [m, n, k, f32_out, choice] = f.as_slice() else { return None };
            let shape = GemmShape { m: m.parse().ok()?, n: n.parse().ok()?, k: k.parse().ok()?, f32_out: *f32_out == "1" };
            let choice = if *choice == "blas" { Choice::Blas } else { Choice::Lt(choice.parse().ok()?) };
            Some((shape, choice))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_lines_parse_and_bad_lines_are_skipped() {
        let text = "1 6144 4096 0 3\n256 4096 14336 1 blas\nnot a line\n2 2 2 1 x\n";
        let c = parse_cache(text);
        assert_eq!(c.len(), 2);
        assert_eq!(c[&GemmShape { m: 1, n: 6144, k: 4096, f32_out: false }], Choice::Lt(3));
        assert_eq!(c[&GemmShape { m: 256, n: 4096, k: 14336, f32_out: true }], Choice::Blas);
    }
}
