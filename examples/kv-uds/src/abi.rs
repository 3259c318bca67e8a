//! A hand-written Rust mirror of `kv-transfer/include/tandem_kv.h` (ABI version 1).
//!
//! This file is the only place the plugin learns about tandem: every type here is `#[repr(C)]` and
//! copies one C declaration field for field, in the same order, with the C types' Rust equivalents
//! (`size_t` is `usize`, `int` is `c_int`, a nullable function pointer is `Option<unsafe extern "C" fn>`).
//!
//! Invariant: sizes, field offsets and constant values equal the C compiler's view of the header.
//! `tests/abi_layout.rs` compiles a C program against the header and checks exactly that, so an edit
//! to either side that breaks the mirror fails the tests.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::marker::{PhantomData, PhantomPinned};

/// `TANDEM_KV_ABI_VERSION`: the ABI major version both sides were built against.
pub const TANDEM_KV_ABI_VERSION: u32 = 1;

/// `TANDEM_KV_MAX_HEADER`: the largest message header, in bytes.
pub const TANDEM_KV_MAX_HEADER: u32 = 4096;
/// `TANDEM_KV_MAX_IOVS`: the most iovecs one payload is gathered from or scattered into.
pub const TANDEM_KV_MAX_IOVS: u32 = 256;

/// `TANDEM_KV_OK`: success.
pub const TANDEM_KV_OK: c_int = 0;
/// `TANDEM_KV_ERR_INVALID`: bad argument (unknown link, NULL, too many iovecs, ...).
pub const TANDEM_KV_ERR_INVALID: c_int = -1;
/// `TANDEM_KV_ERR_UNREACHABLE`: endpoint refused, unknown or not answering.
pub const TANDEM_KV_ERR_UNREACHABLE: c_int = -2;
/// `TANDEM_KV_ERR_IO`: the link failed while sending or receiving.
pub const TANDEM_KV_ERR_IO: c_int = -3;
/// `TANDEM_KV_ERR_CLOSED`: link or instance already closed.
pub const TANDEM_KV_ERR_CLOSED: c_int = -4;
/// `TANDEM_KV_ERR_UNSUPPORTED`: e.g. device memory given to a host-only plugin.
pub const TANDEM_KV_ERR_UNSUPPORTED: c_int = -5;
/// `TANDEM_KV_ERR_INTERNAL`: anything else; `last_error` says what.
pub const TANDEM_KV_ERR_INTERNAL: c_int = -6;

/// `TANDEM_KV_CAP_HOST_MEMORY`: payloads may live in ordinary host memory.
pub const TANDEM_KV_CAP_HOST_MEMORY: u64 = 1 << 0;
/// `TANDEM_KV_CAP_DEVICE_MEMORY`: payloads may live in CUDA device memory.
pub const TANDEM_KV_CAP_DEVICE_MEMORY: u64 = 1 << 1;
/// `TANDEM_KV_CAP_CROSS_HOST`: endpoints are reachable from other hosts.
pub const TANDEM_KV_CAP_CROSS_HOST: u64 = 1 << 2;
/// `TANDEM_KV_CAP_CROSS_PROCESS`: endpoints are reachable from other processes.
pub const TANDEM_KV_CAP_CROSS_PROCESS: u64 = 1 << 3;

/// `TANDEM_KV_MEM_HOST`: an iovec in host memory.
pub const TANDEM_KV_MEM_HOST: u32 = 0;
/// `TANDEM_KV_MEM_CUDA`: an iovec in CUDA device memory of `device`.
pub const TANDEM_KV_MEM_CUDA: u32 = 1;

/// `TANDEM_KV_DELIVER`: `on_message` filled iovecs; write the payload there, then call `on_payload`.
pub const TANDEM_KV_DELIVER: c_int = 0;
/// `TANDEM_KV_DISCARD`: read and drop the payload; no `on_payload`.
pub const TANDEM_KV_DISCARD: c_int = 1;

/// `TANDEM_KV_PLUGIN_ENTRY`: the name of the one symbol a plugin exports.
pub const TANDEM_KV_PLUGIN_ENTRY: &CStr = c"tandem_kv_plugin_v1";

/// `tandem_kv_iov`: one contiguous piece of a payload.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TandemKvIov {
    /// Start of the piece (a device pointer when `mem_kind` is CUDA).
    pub addr: *mut c_void,
    /// Length in bytes.
    pub len: u64,
    /// `TANDEM_KV_MEM_HOST` or `TANDEM_KV_MEM_CUDA`.
    pub mem_kind: u32,
    /// CUDA device ordinal for device memory.
    pub device: i32,
}

impl TandemKvIov {
    /// An empty host iovec (NULL, 0 bytes).
    pub const EMPTY: TandemKvIov = TandemKvIov {
        addr: std::ptr::null_mut(),
        len: 0,
        mem_kind: TANDEM_KV_MEM_HOST,
        device: 0,
    };
}

/// `tandem_kv_instance`: opaque to tandem; the plugin decides what it points to.
#[repr(C)]
pub struct TandemKvInstance {
    _opaque: [u8; 0],
    _not_send_sync_unpin: PhantomData<(*mut u8, PhantomPinned)>,
}

/// `tandem_kv_link`: a link id chosen by the plugin, unique within one instance, never 0.
pub type TandemKvLink = u64;

/// `tandem_kv_host.on_message`.
pub type OnMessageFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    link: TandemKvLink,
    header: *const u8,
    header_len: usize,
    payload_len: u64,
    iovs: *mut TandemKvIov,
    max_iovs: usize,
    n_iovs: *mut usize,
    token: *mut u64,
) -> c_int;
/// `tandem_kv_host.on_payload`.
pub type OnPayloadFn =
    unsafe extern "C" fn(ctx: *mut c_void, link: TandemKvLink, token: u64, status: c_int);
/// `tandem_kv_host.on_link_closed`.
pub type OnLinkClosedFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    link: TandemKvLink,
    status: c_int,
    reason: *const c_char,
);

/// `tandem_kv_host`: the callbacks tandem gives an instance at creation.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TandemKvHost {
    /// The host's `TANDEM_KV_ABI_VERSION`.
    pub abi_version: u32,
    /// `sizeof(tandem_kv_host)` as the host was built.
    pub struct_size: u32,
    /// Passed back as the first argument of every callback.
    pub ctx: *mut c_void,
    /// A message arrived; the host says where its payload goes.
    pub on_message: Option<OnMessageFn>,
    /// A delivered payload has landed (status 0) or failed (status < 0).
    pub on_payload: Option<OnPayloadFn>,
    /// A link is gone.
    pub on_link_closed: Option<OnLinkClosedFn>,
}

/// `tandem_kv_plugin.create`.
pub type CreateFn = unsafe extern "C" fn(
    config: *const c_char,
    host: *const TandemKvHost,
    out: *mut *mut TandemKvInstance,
) -> c_int;
/// `tandem_kv_plugin.destroy`.
pub type DestroyFn = unsafe extern "C" fn(inst: *mut TandemKvInstance);
/// `tandem_kv_plugin.endpoint`.
pub type EndpointFn = unsafe extern "C" fn(inst: *mut TandemKvInstance) -> *const c_char;
/// `tandem_kv_plugin.connect`.
pub type ConnectFn = unsafe extern "C" fn(
    inst: *mut TandemKvInstance,
    endpoint: *const c_char,
    out: *mut TandemKvLink,
) -> c_int;
/// `tandem_kv_plugin.send`.
pub type SendFn = unsafe extern "C" fn(
    inst: *mut TandemKvInstance,
    link: TandemKvLink,
    header: *const u8,
    header_len: usize,
    iovs: *const TandemKvIov,
    n_iovs: usize,
) -> c_int;
/// `tandem_kv_plugin.close_link`.
pub type CloseLinkFn = unsafe extern "C" fn(inst: *mut TandemKvInstance, link: TandemKvLink);
/// `tandem_kv_plugin.last_error`.
pub type LastErrorFn = unsafe extern "C" fn() -> *const c_char;
/// `tandem_kv_plugin_entry_fn`: the type of the exported `tandem_kv_plugin_v1`.
pub type PluginEntryFn = unsafe extern "C" fn() -> *const TandemKvPlugin;

/// `tandem_kv_plugin`: the vtable a plugin exports.
#[repr(C)]
#[derive(Debug)]
pub struct TandemKvPlugin {
    /// The `TANDEM_KV_ABI_VERSION` the plugin was built against.
    pub abi_version: u32,
    /// `sizeof(tandem_kv_plugin)` as the plugin was built.
    pub struct_size: u32,
    /// `TANDEM_KV_CAP_*` flags.
    pub capabilities: u64,
    /// Short static name, e.g. "uds".
    pub name: *const c_char,
    /// Creates an instance that listens for incoming links.
    pub create: Option<CreateFn>,
    /// Closes every link, stops every thread, frees the instance.
    pub destroy: Option<DestroyFn>,
    /// The endpoint other instances pass to `connect`.
    pub endpoint: Option<EndpointFn>,
    /// Opens a new link to an endpoint.
    pub connect: Option<ConnectFn>,
    /// Sends one message on a link.
    pub send: Option<SendFn>,
    /// Closes a link.
    pub close_link: Option<CloseLinkFn>,
    /// The last error on the calling thread.
    pub last_error: Option<LastErrorFn>,
}

// SAFETY: a vtable is immutable once published: `name` points to a static string and the function
// pointers are thread-safe by the header's threading rules ("every plugin function may be called from
// any thread, concurrently"), so sharing a `&TandemKvPlugin` between threads cannot race.
unsafe impl Sync for TandemKvPlugin {}
