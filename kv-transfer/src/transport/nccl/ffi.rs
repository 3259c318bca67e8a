//! NCCL, loaded at run time: the few calls the nccl backend makes, a communicator aborted when it
//! is dropped, a plain device buffer, and the environment NCCL must start with.
//!
//! Why not cudarc's `nccl` module: its loader (cudarc 0.19) tries `libnccl.so` and
//! `libnccl.so.{13,12,11,10,9,1}`, never `libnccl.so.2`, the name NCCL's runtime packages install
//! (pip `nvidia-nccl-cu*`, Debian/Ubuntu `libnccl2`); `libnccl.so` only comes with the development
//! package. And a missing library or symbol panics there. Here the runtime name is tried first and
//! every failure is an [`Error::Device`] saying what to install.
//!
//! Invariants:
//! - Nothing panics when the library is missing, older than 2.14, or lacks a symbol: [`api`] says so.
//! - `NCCL_NVLS_ENABLE=0` and `NCCL_MAX_P2P_NCHANNELS=16` are in the process environment (each
//!   unless the operator set it) before the first NCCL call: every path into NCCL goes through
//!   [`api`], which sets them first ([`NCCL_DEFAULTS`]).
//! - A [`Comm`] is used by one thread at a time (its owner keeps it behind a mutex) and aborted
//!   exactly once, by [`Comm::abort`] or when dropped — or never, when its making failed
//!   ([`Comm::leak`]: NCCL 2.28 can crash aborting one).

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;

use crate::error::{Error, Result};

/// Library names tried, in order: the runtime package's, then the development symlink.
pub(crate) const LIBRARY_NAMES: &[&str] = &["libnccl.so.2", "libnccl.so"];
/// The oldest NCCL the backend runs on: nonblocking communicators (`ncclConfig_t.blocking`).
pub(crate) const MIN_VERSION: i32 = 21400;
/// Bytes of an `ncclUniqueId`.
pub(crate) const UNIQUE_ID_BYTES: usize = 128;

type RawComm = *mut c_void;
type NcclResult = c_int;
type CuStream = *mut c_void;

const NCCL_SUCCESS: NcclResult = 0;
const NCCL_IN_PROGRESS: NcclResult = 7;
/// `ncclUint8`: counts are bytes.
const NCCL_UINT8: c_int = 1;
const CONFIG_MAGIC: c_uint = 0xcafe_beef;
const CONFIG_UNDEF_INT: c_int = c_int::MIN;

/// `ncclUniqueId`: the opaque rendezvous the receiver creates and the sender receives.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct UniqueId(pub(crate) [u8; UNIQUE_ID_BYTES]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

/// `ncclConfig_t` as NCCL 2.14 declared it. NCCL reads a config by its `size` and `version`
/// fields, so a newer library takes this older layout and defaults the fields it lacks.
#[repr(C)]
struct ConfigV21400 {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
}

impl ConfigV21400 {
    /// Defaults but `blocking`.
    fn new(blocking: bool) -> ConfigV21400 {
        ConfigV21400 {
            size: std::mem::size_of::<ConfigV21400>(),
            magic: CONFIG_MAGIC,
            version: MIN_VERSION as c_uint,
            blocking: c_int::from(blocking),
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
        }
    }
}

/// The loaded library and the entry points the backend calls (signatures as in `nccl.h`).
pub(crate) struct Api {
    _lib: libloading::Library,
    version: i32,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    get_last_error: Option<unsafe extern "C" fn(RawComm) -> *const c_char>,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank_config:
        unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int, *mut ConfigV21400) -> NcclResult,
    comm_init_all: unsafe extern "C" fn(*mut RawComm, c_int, *const c_int) -> NcclResult,
    comm_get_async_error: unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult,
    comm_abort: unsafe extern "C" fn(RawComm) -> NcclResult,
    /// `ncclCommSplit` (NCCL 2.18 and later; `None` before).
    comm_split: Option<unsafe extern "C" fn(RawComm, c_int, c_int, *mut RawComm, *mut ConfigV21400) -> NcclResult>,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, CuStream) -> NcclResult,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, CuStream) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
}

/// The library, loaded once per process; the error says what to install.
pub(crate) fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        nccl_defaults();
        load()
    })
    .as_ref()
    .map_err(|e| Error::Device(format!("NCCL is not available: {e}")))
}

/// How many communicators this process gave up unaborted because their making failed (see
/// [`Comm::leak`]): each keeps its host threads and the buffers NCCL allocated before it failed.
pub fn communicators_left_unaborted() -> u64 {
    LEAKED.load(std::sync::atomic::Ordering::Relaxed)
}

/// The version of the NCCL this process loads (`major * 10000 + minor * 100 + patch`), or why it
/// cannot load one: the check a node runs before it offers the nccl backend.
pub fn library_version() -> Result<i32> {
    Ok(api()?.version)
}

/// `2.21.5` for 22105.
pub(crate) fn version_text(code: i32) -> String {
    format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
}

/// NCCL's environment as tandem starts it, each variable unless the operator set it:
/// - `NCCL_NVLS_ENABLE=0`: NVLink SHARP reserves multicast memory at every communicator's
///   creation, which a two-rank point-to-point communicator never uses.
/// - `NCCL_MAX_P2P_NCHANNELS=16`: NCCL gives a peer 32 point-to-point channels by default, each
///   with ~10 MiB of buffers on both GPUs once connected — ~1.3 GB per link of 4 communicators,
///   held on the decode GPU for every prefill peer. 16 moved 256 MiB as fast in `tandem bench kv`
///   on two H200s over NVLink (the link and a bare NCCL send alike; 8 cut the bare send to 74 %)
///   with half the buffers (BENCHMARKS.md, 2026-11-28).
const NCCL_DEFAULTS: &[(&str, &str)] = &[("NCCL_NVLS_ENABLE", "0"), ("NCCL_MAX_P2P_NCHANNELS", "16")];

/// Sets [`NCCL_DEFAULTS`] the operator left unset.
fn nccl_defaults() {
    for (name, value) in NCCL_DEFAULTS {
        if std::env::var_os(name).is_none() {
            // SAFETY: `set_var` is unsound only while another thread reads or writes the environment
            // through libc (Rust's own `std::env` calls are serialised with it). This runs once,
            // inside the `OnceLock` that guards the first NCCL call of the process, before NCCL (the
            // only reader of these variables) starts; tandem reads its environment through
            // `std::env`, and the CUDA driver read its own at `cuInit`, before any pool could exist.
            // A foreign library calling `getenv` on another thread at this very instant is the
            // remaining window; binaries close it by exporting the variables before they start
            // threads (scripts/device-check.sh does).
            unsafe { std::env::set_var(name, value) };
        }
    }
}

fn load() -> std::result::Result<Api, String> {
    let mut tried = Vec::new();
    let lib = LIBRARY_NAMES
        .iter()
        // SAFETY: loading NCCL runs its initialisers, which set up only NCCL's own state.
        .find_map(|name| match unsafe { libloading::Library::new(name) } {
            Ok(lib) => Some(lib),
            Err(e) => {
                tried.push(e.to_string());
                None
            }
        })
        .ok_or_else(|| {
            format!(
                "{} (install NCCL {} or later, e.g. `pip install nvidia-nccl-cu13` or the libnccl2 package, and put the \
                 directory holding libnccl.so.2 on LD_LIBRARY_PATH)",
                tried.join("; "),
                version_text(MIN_VERSION)
            )
        })?;
    fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> std::result::Result<T, String> {
        // SAFETY: every `T` asked for below is the C signature `nccl.h` declares for `name`; the
        // pointer is copied out and used only while the library stays loaded (it never unloads:
        // the `Api` lives in a process-wide `OnceLock`).
        unsafe { lib.get::<T>(name.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| format!("the loaded NCCL lacks {name}: {e}"))
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult = sym(&lib, "ncclGetVersion")?;
    let mut version = 0;
    // SAFETY: `version` is a valid out slot; the call only writes the library's version code.
    if unsafe { get_version(&mut version) } != NCCL_SUCCESS || version < MIN_VERSION {
        return Err(format!(
            "NCCL {} is loaded but the nccl backend needs {} or later (nonblocking communicators)",
            version_text(version),
            version_text(MIN_VERSION)
        ));
    }
    Ok(Api {
        version,
        get_error_string: sym(&lib, "ncclGetErrorString")?,
        get_last_error: sym(&lib, "ncclGetLastError").ok(),
        get_unique_id: sym(&lib, "ncclGetUniqueId")?,
        comm_init_rank_config: sym(&lib, "ncclCommInitRankConfig")?,
        comm_init_all: sym(&lib, "ncclCommInitAll")?,
        comm_get_async_error: sym(&lib, "ncclCommGetAsyncError")?,
        comm_abort: sym(&lib, "ncclCommAbort")?,
        comm_split: sym(&lib, "ncclCommSplit").ok(),
        send: sym(&lib, "ncclSend")?,
        recv: sym(&lib, "ncclRecv")?,
        group_start: sym(&lib, "ncclGroupStart")?,
        group_end: sym(&lib, "ncclGroupEnd")?,
        _lib: lib,
    })
}

impl Api {
    /// The library's version code.
    pub(crate) fn version(&self) -> i32 {
        self.version
    }

    /// `ncclSystemError (…): last error text` for a failed call.
    fn describe(&self, code: NcclResult, comm: RawComm) -> String {
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: NCCL returns NUL-terminated static (or per-communicator) strings.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        // SAFETY: takes any code and returns a static string.
        let name = text(unsafe { (self.get_error_string)(code) });
        // SAFETY: `comm` is null (the process's last error) or a live communicator of the caller.
        let last = self
            .get_last_error
            .map(|f| text(unsafe { f(comm) }))
            .unwrap_or_default();
        if last.is_empty() {
            format!("NCCL error {code}: {name}")
        } else {
            format!("NCCL error {code}: {name} ({last})")
        }
    }

    /// A fresh rendezvous id (the receiver's side of a link is its root). Blocks briefly: it opens
    /// NCCL's bootstrap socket.
    pub(crate) fn unique_id(&self) -> std::result::Result<UniqueId, String> {
        let mut id = UniqueId([0; UNIQUE_ID_BYTES]);
        // SAFETY: `id` is a valid 128-byte out slot.
        match unsafe { (self.get_unique_id)(&mut id) } {
            NCCL_SUCCESS => Ok(id),
            code => Err(self.describe(code, std::ptr::null_mut())),
        }
    }

    /// Whether communicators can be split (`ncclCommSplit`, NCCL 2.18 and later).
    pub(crate) fn can_split(&self) -> bool {
        self.comm_split.is_some()
    }

    /// Runs `issue` between `ncclGroupStart` and `ncclGroupEnd` (one thread driving several ranks,
    /// or operations on several communicators launched together).
    pub(crate) fn group(
        &self,
        issue: impl FnOnce() -> std::result::Result<(), String>,
    ) -> std::result::Result<(), String> {
        // SAFETY: group calls nest and take no arguments.
        match unsafe { (self.group_start)() } {
            NCCL_SUCCESS => {}
            code => return Err(self.describe(code, std::ptr::null_mut())),
        }
        let issued = issue();
        // SAFETY: closes the group opened above (also after a failed call inside it).
        let ended = unsafe { (self.group_end)() };
        issued?;
        match ended {
            NCCL_SUCCESS => Ok(()),
            code => Err(self.describe(code, std::ptr::null_mut())),
        }
    }
}

/// Runs `job` on the runtime's blocking pool when called inside a tokio runtime (it may wait for the
/// device or for NCCL's threads, which no async worker may), else right here.
pub(crate) fn off_runtime(job: impl FnOnce() + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            rt.spawn_blocking(job);
        }
        Err(_) => job(),
    }
}

/// Communicators given up unaborted so far ([`Comm::leak`]).
static LEAKED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One rank of a communicator. Aborted (never destroyed, which could wait forever for a vanished
/// peer) when dropped, unless its making failed ([`Comm::leak`]).
pub(crate) struct Comm {
    raw: RawComm,
    api: &'static Api,
}

// SAFETY: NCCL lets any thread use a communicator as long as one thread does at a time; a `Comm` is
// only reached through its owner's mutex (or `&mut`), and aborted once.
unsafe impl Send for Comm {}

/// Which way a point-to-point call moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dir {
    /// `ncclSend` from the buffer.
    Send,
    /// `ncclRecv` into the buffer.
    Recv,
}

impl Comm {
    /// Creates rank `rank` of a communicator of `nranks`: `blocking` returns when every rank joined
    /// (or failed); otherwise it returns at once and [`Comm::ready`] says when it is made. A
    /// nonblocking communicator hands every later operation to a thread NCCL starts for it (~100 us
    /// before the operation reaches the stream); a blocking one launches it in the calling thread.
    /// The calling thread must have the device's context current.
    pub(crate) fn start(
        api: &'static Api,
        id: &UniqueId,
        rank: i32,
        nranks: i32,
        blocking: bool,
    ) -> std::result::Result<Comm, String> {
        let mut config = ConfigV21400::new(blocking);
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: `raw` and `config` are valid for the call (NCCL copies the config); `id` is a
        // 128-byte id passed by value as `nccl.h` declares it.
        let code = unsafe { (api.comm_init_rank_config)(&mut raw, nranks, *id, rank, &mut config) };
        let comm = Comm { raw, api };
        match code {
            NCCL_SUCCESS | NCCL_IN_PROGRESS if !raw.is_null() => Ok(comm),
            code => {
                let e = api.describe(code, raw);
                comm.leak();
                Err(e)
            }
        }
    }

    /// Gives up the communicator without aborting it: for one whose making failed (its peer gone
    /// mid-handshake, say), which NCCL 2.28 cannot always abort — seen on two H200s: a decode
    /// node whose prefill peer was killed while their communicator was being split and connected
    /// died of SIGSEGV (and once SIGABRT) inside `ncclCommAbort` (`commFree` freeing the channel
    /// peers, `cuMemAddressFree`, glibc's `free`). No kernel of it runs (a failed call launched
    /// none), so what stays is its host threads, idle with the peer gone, and the buffers NCCL
    /// allocated before failing (connecting the lanes allocates each point-to-point channel's:
    /// ~10 MiB each, measured on two H200s).
    pub(crate) fn leak(self) {
        let raw = std::mem::ManuallyDrop::new(self).raw;
        if !raw.is_null() {
            let n = LEAKED.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            tracing::warn!(leaked = n, "nccl: a communicator whose making failed is left unaborted (NCCL cannot always abort one)");
        }
    }

    /// A communicator of the same ranks with resources (channels, connections) of its own, made
    /// with `ncclCommSplit` (every rank calls this, in the same order; collective on `self`, so it
    /// returns when every rank joined, the child blocking like [`Comm::start`]'s). Operations on
    /// the two proceed independently: a link spreads its operations over several, whose per-
    /// operation start-up costs then overlap. `Err` when the library cannot split (before 2.18).
    pub(crate) fn split(&self, rank: i32) -> std::result::Result<Comm, String> {
        let split = self.api.comm_split.ok_or("the loaded NCCL cannot split communicators (2.18 or later can)")?;
        let mut config = ConfigV21400::new(true);
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: a live communicator of this owner; `raw` and `config` are valid for the call
        // (NCCL copies the config). Colour 0 for every rank keeps them all; `rank` orders them as
        // in the parent.
        let code = unsafe { split(self.raw, 0, rank, &mut raw, &mut config) };
        let comm = Comm { raw, api: self.api };
        match code {
            NCCL_SUCCESS if !raw.is_null() => Ok(comm),
            NCCL_SUCCESS => Err("ncclCommSplit made no communicator".into()),
            code => {
                comm.leak();
                Err(self.api.describe(code, self.raw))
            }
        }
    }

    /// Whether the last call finished: `Ok(true)` done, `Ok(false)` still in progress (creation,
    /// or a point-to-point call still connecting to its peer), `Err` the communicator failed.
    pub(crate) fn ready(&self) -> std::result::Result<bool, String> {
        let mut state = NCCL_SUCCESS;
        // SAFETY: a live communicator of this owner; `state` is a valid out slot.
        let code = unsafe { (self.api.comm_get_async_error)(self.raw, &mut state) };
        match (code, state) {
            (NCCL_SUCCESS, NCCL_SUCCESS) => Ok(true),
            (NCCL_SUCCESS, NCCL_IN_PROGRESS) => Ok(false),
            (NCCL_SUCCESS, state) => Err(self.api.describe(state, self.raw)),
            (code, _) => Err(self.api.describe(code, self.raw)),
        }
    }

    /// Enqueues `ncclSend`/`ncclRecv` of `bytes` at device address `buf` with rank `peer` on `stream`.
    /// `Ok` once issued; on a nonblocking communicator poll [`Comm::ready`] before the next call.
    ///
    /// # Safety
    /// `buf` must be `bytes` of device memory of this rank's GPU that nothing else touches until
    /// the operation completed on `stream` (or the communicator was aborted); `stream` must be a live
    /// stream of that GPU's context.
    pub(crate) unsafe fn p2p(
        &self,
        dir: Dir,
        buf: u64,
        bytes: usize,
        peer: i32,
        stream: CuStream,
    ) -> std::result::Result<(), String> {
        let code = match dir {
            // SAFETY: the caller's contract.
            Dir::Send => unsafe {
                (self.api.send)(
                    buf as *const c_void,
                    bytes,
                    NCCL_UINT8,
                    peer,
                    self.raw,
                    stream,
                )
            },
            // SAFETY: the caller's contract.
            Dir::Recv => unsafe {
                (self.api.recv)(
                    buf as *mut c_void,
                    bytes,
                    NCCL_UINT8,
                    peer,
                    self.raw,
                    stream,
                )
            },
        };
        match code {
            NCCL_SUCCESS | NCCL_IN_PROGRESS => Ok(()),
            code => Err(self.api.describe(code, self.raw)),
        }
    }

    /// Aborts the communicator: its kernels stop, its resources are freed, its peer's operations
    /// fail. May wait for NCCL's threads: call it off the async runtime.
    pub(crate) fn abort(mut self) {
        let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        if !raw.is_null() {
            // SAFETY: a live communicator, aborted once (`self` no longer holds it).
            let _ = unsafe { (self.api.comm_abort)(raw) };
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        struct Raw(RawComm);
        // SAFETY: the communicator is handed to the one job below and used by nothing else.
        unsafe impl Send for Raw {}
        let (raw, api) = (
            Raw(std::mem::replace(&mut self.raw, std::ptr::null_mut())),
            self.api,
        );
        if !raw.0.is_null() {
            off_runtime(move || {
                let raw = raw;
                // SAFETY: a live communicator, aborted once (its owner is gone).
                let _ = unsafe { (api.comm_abort)(raw.0) };
            });
        }
    }
}

/// A plain device allocation (`cuMemAlloc`), not stream-ordered pool memory: NCCL's same-process
/// peer-to-peer path may have the peer GPU read or write the buffer directly, and pool memory is not
/// reachable from peers that way. Freed when dropped, off the async runtime (`cuMemFree` waits for
/// the device, so also for any kernel still using the buffer).
pub(crate) struct DeviceBuffer {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceBuffer {
    /// `bytes` (more than 0) of uninitialised device memory of `ctx`'s GPU.
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        bytes: usize,
    ) -> std::result::Result<DeviceBuffer, String> {
        if bytes == 0 {
            return Err("a staging buffer of 0 bytes".into());
        }
        ctx.bind_to_thread()
            .map_err(|e| format!("binding the context: {e}"))?;
        // SAFETY: a plain allocation in the bound context, freed once in Drop; its contents are only
        // ever written (pack, receive) before they are read.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes) }
            .map_err(|e| format!("allocating a {bytes}-byte staging buffer: {e}"))?;
        Ok(DeviceBuffer {
            ptr,
            bytes,
            ctx: Arc::clone(ctx),
        })
    }

    /// Device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let (ptr, ctx) = (self.ptr, Arc::clone(&self.ctx));
        off_runtime(move || {
            if ctx.bind_to_thread().is_ok() {
                // SAFETY: allocated by `malloc_sync` in this context and freed once; every user held
                // its owner alive, so none issues work on it any more, and cuMemFree waits for work
                // still queued.
                let _ = unsafe { cudarc::driver::result::free_sync(ptr) };
            }
        });
    }
}

/// One pause of a polling loop that started at `since`.
pub(crate) fn backoff(since: Instant) {
    let waited = since.elapsed();
    if waited < Duration::from_micros(100) {
        std::thread::yield_now();
    } else if waited < Duration::from_millis(5) {
        std::thread::sleep(Duration::from_micros(20));
    } else {
        std::thread::sleep(Duration::from_micros(500));
    }
}

/// A bare NCCL pair between two GPUs of this process, for benchmarks: rank 0 on the source GPU,
/// rank 1 on the destination, blocking communicators made by `ncclCommInitAll`, one stream each.
pub(crate) struct Pair {
    comms: [Comm; 2],
    streams: [Arc<cudarc::driver::CudaStream>; 2],
}

impl Pair {
    /// Creates both ranks (blocks until NCCL has connected them).
    pub(crate) fn new(
        src: &Arc<CudaContext>,
        dst: &Arc<CudaContext>,
    ) -> std::result::Result<Pair, String> {
        let api = api().map_err(|e| e.to_string())?;
        let devices = [src.ordinal() as c_int, dst.ordinal() as c_int];
        let mut raw: [RawComm; 2] = [std::ptr::null_mut(); 2];
        src.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: `raw` has room for two communicators and `devices` names two device ordinals.
        let code = unsafe { (api.comm_init_all)(raw.as_mut_ptr(), 2, devices.as_ptr()) };
        let comms = raw.map(|raw| Comm { raw, api });
        if code != NCCL_SUCCESS || comms.iter().any(|c| c.raw.is_null()) {
            return Err(api.describe(code, std::ptr::null_mut()));
        }
        let streams = [
            src.new_stream().map_err(|e| e.to_string())?,
            dst.new_stream().map_err(|e| e.to_string())?,
        ];
        Ok(Pair { comms, streams })
    }

    /// Sends `bytes` from device address `src` (rank 0's GPU) to `dst` (rank 1's) and waits for both
    /// streams; returns the host time from issue to completion.
    ///
    /// # Safety
    /// Both ranges must be live device memory of their GPUs that nothing else touches meanwhile.
    pub(crate) unsafe fn send(
        &self,
        src: u64,
        dst: u64,
        bytes: usize,
    ) -> std::result::Result<Duration, String> {
        let api = self.comms[0].api;
        let t = Instant::now();
        api.group(|| {
            // SAFETY: the caller's contract; each call on its own rank's stream.
            unsafe {
                self.comms[0].p2p(
                    Dir::Send,
                    src,
                    bytes,
                    1,
                    self.streams[0].cu_stream() as CuStream,
                )?;
                self.comms[1].p2p(
                    Dir::Recv,
                    dst,
                    bytes,
                    0,
                    self.streams[1].cu_stream() as CuStream,
                )
            }
        })?;
        for s in &self.streams {
            s.synchronize().map_err(|e| e.to_string())?;
        }
        Ok(t.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_has_the_layout_of_nccl_2_14() {
        // size_t, 2 x unsigned, 4 x int, const char*: 40 bytes on LP64.
        assert_eq!(std::mem::size_of::<ConfigV21400>(), 40);
        assert_eq!(std::mem::size_of::<UniqueId>(), UNIQUE_ID_BYTES);
    }

    #[test]
    fn versions_read_as_nccl_prints_them() {
        assert_eq!(version_text(21400), "2.14.0");
        assert_eq!(version_text(22703), "2.27.3");
    }

    /// Where NCCL is installed the probe finds a usable version; elsewhere (this CI) it is a typed
    /// error naming the library, never a panic.
    #[test]
    fn a_missing_library_is_a_typed_error() {
        match library_version() {
            Ok(v) => assert!(v >= MIN_VERSION, "{v}"),
            Err(Error::Device(m)) => assert!(
                m.contains("libnccl.so.2") && m.contains("LD_LIBRARY_PATH"),
                "{m}"
            ),
            Err(e) => panic!("unexpected error kind: {e}"),
        }
        // The environment NCCL starts with is set either way.
        for (name, _) in NCCL_DEFAULTS {
            assert!(std::env::var_os(name).is_some(), "{name}");
        }
    }
}
