//! The plugin backend: a shared library implementing `include/tandem_kv.h`, loaded by path at run time.
//! This file is the host half of that C ABI: it checks the library's ABI version, vtable size and
//! capabilities, hands it host callbacks that forward to the connector's inbox, and runs the library's
//! (possibly blocking) calls on tokio's blocking pool.
//!
//! Invariants:
//! - No Rust panic crosses the C boundary (every callback catches unwinding).
//! - The library instance is destroyed only after every call into it returned (in-flight sends keep it
//!   alive), and the host callback context outlives `destroy`.
//! - A plugin cannot mark anything ready: it only delivers bytes; the connector verifies them.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::core::lock;
use crate::error::{Error, Result};
use crate::frame::MAX_HEADER;
use crate::memory::{Iov, MemoryKind};
use crate::transport::{BoxFuture, Capabilities, Delivery, Inbox, Landed, Link, Payload, Transport};

/// ABI version this host speaks (`TANDEM_KV_ABI_VERSION`).
pub const ABI_VERSION: u32 = 1;
/// Symbol every plugin exports (`TANDEM_KV_PLUGIN_ENTRY`).
pub const ENTRY_SYMBOL: &str = "tandem_kv_plugin_v1";
/// Largest iovec count per payload (`TANDEM_KV_MAX_IOVS`).
pub const MAX_IOVS: usize = 256;

const OK: c_int = 0;
const DELIVER: c_int = 0;
const DISCARD: c_int = 1;
const MEM_HOST: u32 = 0;
const MEM_CUDA: u32 = 1;

/// `tandem_kv_iov`.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawIov {
    addr: *mut c_void,
    len: u64,
    mem_kind: u32,
    device: i32,
}

type OnMessage = unsafe extern "C" fn(
    *mut c_void,
    u64,
    *const u8,
    usize,
    u64,
    *mut RawIov,
    usize,
    *mut usize,
    *mut u64,
) -> c_int;
type OnPayload = unsafe extern "C" fn(*mut c_void, u64, u64, c_int);
type OnLinkClosed = unsafe extern "C" fn(*mut c_void, u64, c_int, *const c_char);

/// `tandem_kv_host`.
#[repr(C)]
struct RawHost {
    abi_version: u32,
    struct_size: u32,
    ctx: *mut c_void,
    on_message: OnMessage,
    on_payload: OnPayload,
    on_link_closed: OnLinkClosed,
}

/// `tandem_kv_plugin` (ABI version 1 fields).
#[repr(C)]
struct RawPlugin {
    abi_version: u32,
    struct_size: u32,
    capabilities: u64,
    name: *const c_char,
    create: Option<unsafe extern "C" fn(*const c_char, *const RawHost, *mut *mut c_void) -> c_int>,
    destroy: Option<unsafe extern "C" fn(*mut c_void)>,
    endpoint: Option<unsafe extern "C" fn(*mut c_void) -> *const c_char>,
    connect: Option<unsafe extern "C" fn(*mut c_void, *const c_char, *mut u64) -> c_int>,
    send: Option<unsafe extern "C" fn(*mut c_void, u64, *const u8, usize, *const RawIov, usize) -> c_int>,
    close_link: Option<unsafe extern "C" fn(*mut c_void, u64)>,
    last_error: Option<unsafe extern "C" fn() -> *const c_char>,
}

/// The vtable's functions, checked non-null once at load.
#[derive(Clone, Copy)]
struct Fns {
    destroy: unsafe extern "C" fn(*mut c_void),
    connect: unsafe extern "C" fn(*mut c_void, *const c_char, *mut u64) -> c_int,
    send: unsafe extern "C" fn(*mut c_void, u64, *const u8, usize, *const RawIov, usize) -> c_int,
    close_link: unsafe extern "C" fn(*mut c_void, u64),
    last_error: unsafe extern "C" fn() -> *const c_char,
}

/// What the host callbacks reach through `ctx`.
struct HostCtx {
    inbox: Arc<dyn Inbox>,
    links: Mutex<HashMap<u64, Arc<PluginLink>>>,
    shared: Mutex<Weak<Shared>>,
    rt: tokio::runtime::Handle,
    raw: RawHost,
}

impl HostCtx {
    fn link(&self, id: u64) -> Arc<PluginLink> {
        let mut links = lock(&self.links);
        Arc::clone(links.entry(id).or_insert_with(|| {
            Arc::new(PluginLink {
                id,
                peer: format!("plugin link {id}"),
                shared: lock(&self.shared).clone(),
                closed: AtomicBool::new(false),
            })
        }))
    }

    /// The inbox asked to drop a link: close it in the plugin (off this callback thread) and report it.
    fn close_from_callback(&self, link: Arc<PluginLink>, reason: String) {
        lock(&self.links).remove(&link.id);
        if link.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let dyn_link: Arc<dyn Link> = Arc::clone(&link) as Arc<dyn Link>;
        self.inbox.on_link_closed(&dyn_link, reason);
        if let Some(shared) = link.shared.upgrade() {
            let id = link.id;
            self.rt.spawn_blocking(move || shared.close_link(id));
        }
    }
}

/// The loaded library and its instance.
struct Shared {
    fns: Fns,
    inst: *mut c_void,
    path: String,
    // Dropped after `destroy` ran (Drop below), in this order: callbacks' context, then the code.
    host: Box<HostCtx>,
    _lib: libloading::Library,
}

// SAFETY: the C ABI requires every plugin function to be callable from any thread concurrently; `inst`
// is only passed back to those functions. The host context is itself Send + Sync.
unsafe impl Send for Shared {}
// SAFETY: see above.
unsafe impl Sync for Shared {}

impl Shared {
    fn last_error(&self) -> String {
        // SAFETY: vtable function checked non-null at load; returns a static or thread-local C string.
        let p = unsafe { (self.fns.last_error)() };
        if p.is_null() {
            return "unknown error".into();
        }
        // SAFETY: non-null, NUL-terminated per the ABI, valid until the next call on this thread.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn close_link(&self, id: u64) {
        // SAFETY: valid instance (not destroyed while `self` lives); close_link is idempotent per the ABI.
        unsafe { (self.fns.close_link)(self.inst, id) };
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: last reference: no other call into the instance is running or can start.
        unsafe { (self.fns.destroy)(self.inst) };
    }
}

/// A transport backed by a plugin library.
pub struct PluginTransport {
    name: String,
    caps: Capabilities,
    endpoint: String,
    shared: Mutex<Option<Arc<Shared>>>,
}

fn plugin_err(path: &str, reason: impl Into<String>) -> Error {
    Error::Plugin { path: path.to_string(), reason: reason.into() }
}

/// Loads the library at `path` and returns it with its vtable, checked against this ABI version
/// (valid while the library stays loaded).
fn open_vtable(path: &str) -> Result<(libloading::Library, *const RawPlugin)> {
    // SAFETY: loading a library runs its initialisers; selecting a plugin by path is the user's
    // explicit decision to trust that code (like any shared library tandem links).
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| plugin_err(path, e.to_string()))?;
    // SAFETY: the symbol's type is fixed by the ABI: `const tandem_kv_plugin *(*)(void)`.
    let entry = unsafe { lib.get::<unsafe extern "C" fn() -> *const RawPlugin>(ENTRY_SYMBOL.as_bytes()) }
        .map_err(|e| plugin_err(path, format!("no {ENTRY_SYMBOL} symbol: {e}")))?;
    // SAFETY: calling the entry point as the ABI defines it.
    let vt_ptr = unsafe { entry() };
    if vt_ptr.is_null() {
        return Err(plugin_err(path, "entry point returned NULL"));
    }
    // SAFETY: non-null; we read the two leading u32s first, which every ABI version has.
    let (abi, size) = unsafe { ((*vt_ptr).abi_version, (*vt_ptr).struct_size) };
    if abi != ABI_VERSION {
        return Err(plugin_err(path, format!("ABI version {abi}, this tandem speaks {ABI_VERSION}")));
    }
    if (size as usize) < std::mem::size_of::<RawPlugin>() {
        return Err(plugin_err(path, format!("vtable of {size} bytes is smaller than ABI v1's")));
    }
    Ok((lib, vt_ptr))
}

/// The capabilities the plugin at `path` declares, read from its vtable without creating an
/// instance (a node decides with them whether to register host or device memory).
pub fn probe_capabilities(path: &str) -> Result<Capabilities> {
    let (_lib, vt_ptr) = open_vtable(path)?;
    // SAFETY: `open_vtable` checked version and size; `_lib` keeps the vtable loaded meanwhile.
    Ok(Capabilities(unsafe { (*vt_ptr).capabilities }))
}

impl PluginTransport {
    /// Loads `path`, checks its ABI and creates an instance with `config`.
    pub fn load(path: &str, config: &str, inbox: Arc<dyn Inbox>) -> Result<Arc<PluginTransport>> {
        let rt = tokio::runtime::Handle::try_current().map_err(|_| plugin_err(path, "needs a tokio runtime"))?;
        let (lib, vt_ptr) = open_vtable(path)?;
        // SAFETY: version and size checked: the whole v1 struct is readable and lives as long as `lib`.
        let vt = unsafe { &*vt_ptr };
        let (Some(create), Some(destroy), Some(endpoint), Some(connect), Some(send), Some(close_link), Some(last_error)) =
            (vt.create, vt.destroy, vt.endpoint, vt.connect, vt.send, vt.close_link, vt.last_error)
        else {
            return Err(plugin_err(path, "vtable has a NULL function"));
        };
        let name = if vt.name.is_null() {
            return Err(plugin_err(path, "vtable has no name"));
        } else {
            // SAFETY: non-null static C string per the ABI.
            unsafe { CStr::from_ptr(vt.name) }.to_string_lossy().into_owned()
        };
        let caps = Capabilities(vt.capabilities);
        let fns = Fns { destroy, connect, send, close_link, last_error };

        let mut host = Box::new(HostCtx {
            inbox,
            links: Mutex::new(HashMap::new()),
            shared: Mutex::new(Weak::new()),
            rt,
            raw: RawHost {
                abi_version: ABI_VERSION,
                struct_size: std::mem::size_of::<RawHost>() as u32,
                ctx: std::ptr::null_mut(),
                on_message: host_on_message,
                on_payload: host_on_payload,
                on_link_closed: host_on_link_closed,
            },
        });
        host.raw.ctx = &*host as *const HostCtx as *mut c_void;
        let config_c = CString::new(config).map_err(|_| plugin_err(path, "config contains a NUL byte"))?;
        let mut inst: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid C string, host struct pinned in its Box for the instance's lifetime, out-pointer valid.
        let rc = unsafe { create(config_c.as_ptr(), &host.raw, &mut inst) };
        if rc != OK || inst.is_null() {
            // SAFETY: function checked non-null.
            let msg = unsafe { last_error() };
            let msg = if msg.is_null() {
                String::new()
            } else {
                // SAFETY: NUL-terminated per the ABI.
                unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned()
            };
            return Err(plugin_err(path, format!("create failed ({rc}): {msg}")));
        }
        // SAFETY: instance valid; endpoint() returns a string that lives as long as the instance.
        let ep = unsafe { endpoint(inst) };
        let endpoint = if ep.is_null() {
            String::new()
        } else {
            // SAFETY: NUL-terminated per the ABI.
            unsafe { CStr::from_ptr(ep) }.to_string_lossy().into_owned()
        };
        let shared = Arc::new(Shared { fns, inst, path: path.to_string(), host, _lib: lib });
        *lock(&shared.host.shared) = Arc::downgrade(&shared);
        if endpoint.is_empty() {
            return Err(plugin_err(path, "instance has no endpoint"));
        }
        Ok(Arc::new(PluginTransport { name, caps, endpoint, shared: Mutex::new(Some(shared)) }))
    }

    fn shared(&self) -> Result<Arc<Shared>> {
        lock(&self.shared).clone().ok_or(Error::Shutdown)
    }
}

impl Transport for PluginTransport {
    fn name(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        self.caps
    }

    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    fn connect<'a>(&'a self, endpoint: &'a str) -> BoxFuture<'a, Result<Arc<dyn Link>>> {
        Box::pin(async move {
            let shared = self.shared()?;
            let unreachable = |reason: String| Error::Unreachable { endpoint: endpoint.to_string(), reason };
            let c_ep = CString::new(endpoint).map_err(|_| unreachable("endpoint contains a NUL byte".into()))?;
            let s = Arc::clone(&shared);
            let (rc, id, msg) = tokio::task::spawn_blocking(move || {
                let mut id = 0u64;
                // SAFETY: valid instance (kept alive by `s`), C string and out-pointer.
                let rc = unsafe { (s.fns.connect)(s.inst, c_ep.as_ptr(), &mut id) };
                let msg = if rc == OK { String::new() } else { s.last_error() };
                (rc, id, msg)
            })
            .await
            .map_err(|e| unreachable(format!("connect task failed: {e}")))?;
            if rc != OK || id == 0 {
                return Err(unreachable(format!("plugin {} says ({rc}) {msg}", self.name)));
            }
            let link: Arc<dyn Link> = shared.host.link(id);
            Ok(link)
        })
    }

    fn shutdown(&self) {
        let Some(shared) = lock(&self.shared).take() else { return };
        let links: Vec<Arc<PluginLink>> = lock(&shared.host.links).drain().map(|(_, l)| l).collect();
        for link in links {
            if !link.closed.swap(true, Ordering::AcqRel) {
                shared.close_link(link.id);
            }
        }
        drop(shared); // destroys the instance now, or when the last in-flight send returns
    }
}

impl Drop for PluginTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One plugin link.
struct PluginLink {
    id: u64,
    peer: String,
    shared: Weak<Shared>,
    closed: AtomicBool,
}

impl Link for PluginLink {
    fn id(&self) -> u64 {
        self.id
    }

    fn peer(&self) -> &str {
        &self.peer
    }

    fn send(&self, header: Vec<u8>, payload: Payload) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let err = |reason: String| Error::LinkFailed { peer: self.peer.clone(), reason };
            if self.closed.load(Ordering::Acquire) {
                return Err(err("link closed".into()));
            }
            let shared = self.shared.upgrade().ok_or_else(|| err("plugin shut down".into()))?;
            if payload.iovs().len() > MAX_IOVS {
                return Err(err(format!("{} iovecs exceed the ABI's {MAX_IOVS}", payload.iovs().len())));
            }
            let id = self.id;
            let (rc, msg) = tokio::task::spawn_blocking(move || {
                let raw: Vec<RawIov> = payload.iovs().iter().map(to_raw).collect();
                // SAFETY: instance alive (`shared`), header and iovec arrays valid for the call; the payload
                // (and the claim it holds) lives until this closure ends, after send returned.
                let rc = unsafe { (shared.fns.send)(shared.inst, id, header.as_ptr(), header.len(), raw.as_ptr(), raw.len()) };
                let msg = if rc == OK { String::new() } else { shared.last_error() };
                drop(payload);
                (rc, msg)
            })
            .await
            .map_err(|e| err(format!("send task failed: {e}")))?;
            if rc != OK {
                return Err(err(format!("plugin send failed ({rc}): {msg}")));
            }
            Ok(())
        })
    }

    fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(shared) = self.shared.upgrade() {
            lock(&shared.host.links).remove(&self.id);
            shared.close_link(self.id);
        }
    }
}

fn to_raw(iov: &Iov) -> RawIov {
    let (mem_kind, device) = match iov.kind {
        MemoryKind::Host => (MEM_HOST, 0),
        MemoryKind::Cuda { device } => (MEM_CUDA, device),
    };
    RawIov { addr: iov.addr as *mut c_void, len: iov.len as u64, mem_kind, device }
}

/// Recovers the host context from a callback's `ctx`.
///
/// # Safety
/// `ctx` must be the pointer the host gave the plugin at `create` (valid until `destroy` returned).
unsafe fn host<'a>(ctx: *mut c_void) -> &'a HostCtx {
    // SAFETY: per the function contract.
    unsafe { &*(ctx as *const HostCtx) }
}

unsafe extern "C" fn host_on_message(
    ctx: *mut c_void,
    link: u64,
    header: *const u8,
    header_len: usize,
    payload_len: u64,
    iovs: *mut RawIov,
    max_iovs: usize,
    n_iovs: *mut usize,
    token: *mut u64,
) -> c_int {
    let run = || {
        // SAFETY: the plugin passes back the ctx it was given.
        let h = unsafe { host(ctx) };
        let l = h.link(link);
        if header.is_null() || header_len > MAX_HEADER {
            h.close_from_callback(l, "plugin delivered an invalid header".into());
            return DISCARD;
        }
        // SAFETY: non-null, `header_len` bytes valid during the call per the ABI.
        let bytes = unsafe { std::slice::from_raw_parts(header, header_len) };
        let dyn_link: Arc<dyn Link> = Arc::clone(&l) as Arc<dyn Link>;
        match h.inbox.on_message(&dyn_link, bytes, payload_len) {
            Delivery::Discard => DISCARD,
            Delivery::CloseLink(reason) => {
                h.close_from_callback(l, reason);
                DISCARD
            }
            Delivery::Into { iovs: dst, token: t } => {
                if iovs.is_null() || n_iovs.is_null() || token.is_null() || dst.len() > max_iovs {
                    h.inbox.on_payload(&dyn_link, t, Err("plugin offered too few iovecs".into()));
                    return DISCARD;
                }
                for (i, iov) in dst.iter().enumerate() {
                    // SAFETY: the plugin provides `max_iovs` writable entries; i < dst.len() <= max_iovs.
                    unsafe { iovs.add(i).write(to_raw(iov)) };
                }
                // SAFETY: non-null out-pointers provided by the plugin for this call.
                unsafe {
                    n_iovs.write(dst.len());
                    token.write(t);
                }
                DELIVER
            }
        }
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or(DISCARD)
}

unsafe extern "C" fn host_on_payload(ctx: *mut c_void, link: u64, token: u64, status: c_int) {
    let run = || {
        // SAFETY: the plugin passes back the ctx it was given.
        let h = unsafe { host(ctx) };
        let l: Arc<dyn Link> = h.link(link);
        let result = if status == OK { Ok(Landed::default()) } else { Err(format!("plugin reported status {status}")) };
        h.inbox.on_payload(&l, token, result);
    };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
}

unsafe extern "C" fn host_on_link_closed(ctx: *mut c_void, link: u64, status: c_int, reason: *const c_char) {
    let run = || {
        // SAFETY: the plugin passes back the ctx it was given.
        let h = unsafe { host(ctx) };
        let Some(l) = lock(&h.links).remove(&link) else { return };
        if l.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let why = if reason.is_null() {
            format!("status {status}")
        } else {
            // SAFETY: non-null, NUL-terminated, valid during the call per the ABI.
            unsafe { CStr::from_ptr(reason) }.to_string_lossy().into_owned()
        };
        let dyn_link: Arc<dyn Link> = l;
        h.inbox.on_link_closed(&dyn_link, why);
    };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
}

impl std::fmt::Debug for PluginTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = lock(&self.shared).as_ref().map(|s| s.path.clone());
        f.debug_struct("PluginTransport").field("name", &self.name).field("path", &path).finish()
    }
}
