//! The typed table of every kernel function: looked up once when the module is loaded, so a launch
//! is an array index, and a kernel missing from the CUBIN fails at start-up, not at first use.

use cudarc::driver::{CudaFunction, CudaModule, sys::CUfunction_attribute};
use std::sync::Arc;

use super::error::Result;

macro_rules! kernels {
    ($($variant:ident => $name:literal,)*) => {
        /// Every `extern "C"` kernel in `kernels/cuda/`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum Kernel { $($variant,)* }

        impl Kernel {
            /// Every kernel, in table order.
            pub(crate) const ALL: &'static [Kernel] = &[$(Kernel::$variant,)*];

            /// Whether the kernel opts in to [`MAX_DYNAMIC_SMEM`] bytes of dynamic shared memory.
            pub(crate) fn needs_large_smem(self) -> bool {
                matches!(
                    self,
                    Kernel::PrefillAttentionHd64
                        | Kernel::PrefillAttentionHd128
                        | Kernel::DecodeAttentionHd64
                        | Kernel::DecodeAttentionHd128
                        | Kernel::Sample
                )
            }

            /// The function's name in the CUDA source.
            pub(crate) fn name(self) -> &'static str {
                match self { $(Kernel::$variant => $name,)* }
            }
        }
    };
}

kernels! {
    Embedding => "embedding",
    RmsNorm => "rms_norm",
    Rope => "rope",
    SiluMul => "silu_mul",
    WriteKv => "write_kv",
    ResolveTokens => "resolve_tokens",
    PrefillAttentionHd64 => "prefill_attention_hd64",
    PrefillAttentionHd128 => "prefill_attention_hd128",
    DecodeAttentionHd64 => "decode_attention_hd64",
    DecodeAttentionHd128 => "decode_attention_hd128",
    DecodeReduce => "decode_reduce",
    Sample => "sample",
    KvCopyBlocks => "kv_copy_blocks",
    KvCopySegments => "kv_copy_segments",
}

/// Dynamic shared memory the attention and sampling kernels may use (they opt in above the
/// 48 KiB default; static shared memory comes on top).
pub(crate) const MAX_DYNAMIC_SMEM: usize = 96 * 1024;

/// The loaded functions, indexed by [`Kernel`].
#[derive(Debug)]
pub(crate) struct KernelTable {
    funcs: Vec<CudaFunction>,
}

impl KernelTable {
    /// Looks every kernel up in `module`.
    pub(crate) fn load(module: &Arc<CudaModule>) -> Result<Self> {
        let mut funcs = Vec::with_capacity(Kernel::ALL.len());
        for &k in Kernel::ALL {
            let f = module.load_function(k.name())?;
            if k.needs_large_smem() {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    MAX_DYNAMIC_SMEM as i32,
                )?;
            }
            funcs.push(f);
        }
        Ok(KernelTable { funcs })
    }

    pub(crate) fn get(&self, k: Kernel) -> &CudaFunction {
        &self.funcs[k as usize]
    }
}
