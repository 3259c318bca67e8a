//! A test host for the plugin: `extern "C"` callbacks that record everything into a mutex-guarded
//! state, and a `Peer` that drives one plugin instance through the exported vtable only, the way tandem
//! does after `dlopen`.
//!
//! Invariants: every wait is bounded by [`WAIT`]; a callback never panics (a panic in an `extern "C"`
//! function aborts the test binary), anomalies are collected in `HostState::errors` instead and the
//! tests assert that list is empty.

#![allow(dead_code)] // each test binary uses part of it

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tandem_kv_uds::abi::{self, TandemKvHost, TandemKvInstance, TandemKvIov, TandemKvPlugin};

/// The longest any test waits for something to happen.
pub(crate) const WAIT: Duration = Duration::from_secs(20);
/// Payloads larger than this are discarded by the test host instead of allocated.
pub(crate) const MAX_TEST_PAYLOAD: u64 = 64 << 20;

/// The plugin's vtable, obtained through the exported entry point.
pub(crate) fn plugin() -> &'static TandemKvPlugin {
    let entry: abi::PluginEntryFn = tandem_kv_uds::tandem_kv_plugin_v1;
    // SAFETY: the entry point takes no arguments and returns the address of a static vtable.
    let vtable = unsafe { entry() };
    // SAFETY: non-NULL, points to a `static`, valid for the life of the process.
    unsafe { vtable.as_ref() }.expect("the entry point returned NULL")
}

/// The calling thread's `last_error` text.
pub(crate) fn last_error() -> String {
    let last_error = plugin().last_error.expect("last_error");
    // SAFETY: `last_error` takes no arguments and never returns NULL (the header's promise).
    let text = unsafe { last_error() };
    assert!(!text.is_null(), "last_error returned NULL");
    // SAFETY: a NUL-terminated string valid until the next failing call on this thread.
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}

/// What the test host answers to a message with a payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// DELIVER into this many iovecs (random lengths summing to the payload length).
    Deliver { pieces: usize },
    /// DISCARD.
    Discard,
    /// DELIVER, but the iovecs hold one byte less than the payload (a host bug).
    ShortIovs,
    /// DELIVER into device memory (which a host-only plugin cannot write).
    CudaIovs,
    /// DELIVER with `*n_iovs` larger than `max_iovs` (a host bug).
    TooManyIovs,
    /// Answer this code, neither DELIVER nor DISCARD (a host bug).
    Answer(c_int),
    /// Call `destroy` on our own instance from inside the callback, then DISCARD.
    DestroySelf,
}

/// Picks the action for a message from its header and payload length.
pub(crate) type Policy = fn(&[u8], u64) -> Action;

/// The default policy: deliver everything into 3 pieces.
pub(crate) fn deliver_all(_: &[u8], _: u64) -> Action {
    Action::Deliver { pieces: 3 }
}

/// One message as the host saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Received {
    pub(crate) link: u64,
    pub(crate) header: Vec<u8>,
    pub(crate) payload_len: u64,
    /// The payload bytes, when delivered with status 0.
    pub(crate) payload: Option<Vec<u8>>,
    /// The `on_payload` status, when there was one.
    pub(crate) status: Option<c_int>,
    pub(crate) action: Option<Action>,
}

/// Everything the callbacks recorded.
#[derive(Debug)]
pub(crate) struct HostState {
    /// Messages in completion order: at `on_message` without a delivery, at `on_payload` with one.
    pub(crate) received: Vec<Received>,
    /// `(link, status, reason)` per `on_link_closed`.
    pub(crate) closed: Vec<(u64, c_int, String)>,
    /// Callbacks running or starting after the test declared the instance destroyed.
    pub(crate) late_callbacks: usize,
    /// Callbacks running right now.
    active: usize,
    /// Set by the test once `destroy` returned.
    pub(crate) dead: bool,
    /// Contract violations the callbacks noticed.
    pub(crate) errors: Vec<String>,
    policy: Policy,
    pending: HashMap<u64, (Received, Box<[u8]>)>,
    next_token: u64,
    rng: SmallRng,
    /// How long `on_message` sleeps (to keep callbacks in flight).
    pub(crate) on_message_delay: Duration,
}

/// The host side of one instance: its `ctx`.
#[derive(Debug)]
pub(crate) struct TestHost {
    state: Mutex<HostState>,
    changed: Condvar,
    /// Our own instance, for `Action::DestroySelf`.
    instance: AtomicPtr<TandemKvInstance>,
}

impl TestHost {
    fn new(policy: Policy) -> TestHost {
        TestHost {
            state: Mutex::new(HostState {
                received: Vec::new(),
                closed: Vec::new(),
                late_callbacks: 0,
                active: 0,
                dead: false,
                errors: Vec::new(),
                policy,
                pending: HashMap::new(),
                next_token: 1,
                rng: SmallRng::seed_from_u64(0x5eed),
                on_message_delay: Duration::ZERO,
            }),
            changed: Condvar::new(),
            instance: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// The recorded state.
    pub(crate) fn state(&self) -> MutexGuard<'_, HostState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until `done` holds, at most [`WAIT`]; panics with `what` on timeout.
    pub(crate) fn wait(
        &self,
        what: &str,
        done: impl Fn(&HostState) -> bool,
    ) -> MutexGuard<'_, HostState> {
        let deadline = Instant::now() + WAIT;
        let mut state = self.state();
        while !done(&state) {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "timed out after {WAIT:?} waiting for {what}; state: {:?}",
                Summary(&state)
            );
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        state
    }

    /// Like [`TestHost::wait`], for when only the waiting matters.
    pub(crate) fn wait_until(&self, what: &str, done: impl Fn(&HostState) -> bool) {
        drop(self.wait(what, done));
    }

    /// Declares the instance destroyed: from now on any callback counts as late.
    pub(crate) fn mark_dead(&self) {
        self.mark_dead_except(0);
    }

    /// `mark_dead` from inside `own` running callbacks (which are not late: they called destroy).
    fn mark_dead_except(&self, own: usize) {
        let mut state = self.state();
        state.dead = true;
        state.late_callbacks += state.active - own;
        drop(state);
        self.changed.notify_all();
    }

    /// Enters a callback: counts it, and counts it late if the instance was declared destroyed.
    fn enter(&self) -> Active<'_> {
        let mut state = self.state();
        state.active += 1;
        if state.dead {
            state.late_callbacks += 1;
        }
        Active(self)
    }
}

/// A running callback; leaving it is counted on drop.
struct Active<'a>(&'a TestHost);

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.state().active -= 1;
    }
}

/// A short view of a state for timeout messages.
struct Summary<'a>(&'a HostState);

impl std::fmt::Debug for Summary<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostState")
            .field("received", &self.0.received.len())
            .field("pending", &self.0.pending.len())
            .field("closed", &self.0.closed)
            .field("errors", &self.0.errors)
            .finish()
    }
}

/// # Safety
/// `ctx` is the `Arc<TestHost>` pointer a `Peer` registered, alive while its instance lives.
unsafe fn host<'a>(ctx: *mut c_void) -> &'a TestHost {
    // SAFETY: see the function's contract; the Peer keeps the Arc alive past `destroy`.
    unsafe { &*ctx.cast_const().cast::<TestHost>() }
}

/// Random piece lengths summing to `total`.
fn split(rng: &mut SmallRng, total: usize, pieces: usize) -> Vec<usize> {
    let mut cuts: Vec<usize> = (1..pieces).map(|_| rng.random_range(0..=total)).collect();
    cuts.sort_unstable();
    cuts.push(total);
    let mut start = 0;
    cuts.into_iter()
        .map(|cut| {
            let len = cut - start;
            start = cut;
            len
        })
        .collect()
}

unsafe extern "C" fn on_message(
    ctx: *mut c_void,
    link: u64,
    header: *const u8,
    header_len: usize,
    payload_len: u64,
    iovs: *mut TandemKvIov,
    max_iovs: usize,
    n_iovs: *mut usize,
    token: *mut u64,
) -> c_int {
    // SAFETY: ctx is ours (see `host`).
    let host = unsafe { host(ctx) };
    let _active = host.enter();
    // SAFETY: the plugin passes a header valid for `header_len` bytes during the call.
    let header = unsafe { std::slice::from_raw_parts(header, header_len) }.to_vec();
    let mut state = host.state();
    if header_len > abi::TANDEM_KV_MAX_HEADER as usize
        || max_iovs != abi::TANDEM_KV_MAX_IOVS as usize
    {
        state.errors.push(format!(
            "on_message: header_len {header_len}, max_iovs {max_iovs}"
        ));
    }
    let delay = state.on_message_delay;
    let mut received = Received {
        link,
        header,
        payload_len,
        payload: None,
        status: None,
        action: None,
    };
    if payload_len == 0 {
        state.received.push(received);
        drop(state);
        host.changed.notify_all();
        std::thread::sleep(delay);
        return abi::TANDEM_KV_DISCARD;
    }
    let mut action = (state.policy)(&received.header, payload_len);
    if payload_len > MAX_TEST_PAYLOAD && action != Action::DestroySelf {
        action = Action::Discard;
    }
    received.action = Some(action);
    let answer = match action {
        Action::Discard | Action::Answer(_) | Action::DestroySelf => {
            state.received.push(received);
            match action {
                Action::Answer(code) => code,
                _ => abi::TANDEM_KV_DISCARD,
            }
        }
        Action::Deliver { .. } | Action::ShortIovs | Action::CudaIovs | Action::TooManyIovs => {
            let len = payload_len as usize;
            let mut buffer = vec![0u8; len].into_boxed_slice();
            let (pieces, described) = match action {
                Action::Deliver { pieces } => (pieces.clamp(1, max_iovs), len),
                Action::ShortIovs => (2, len - 1),
                _ => (1, len),
            };
            let lens = split(&mut state.rng, described, pieces);
            let mut offset = 0;
            for (i, &piece) in lens.iter().enumerate() {
                let iov = TandemKvIov {
                    // SAFETY: offset <= len: the pieces sum to at most the buffer's length.
                    addr: unsafe { buffer.as_mut_ptr().add(offset) }.cast(),
                    len: piece as u64,
                    mem_kind: if action == Action::CudaIovs {
                        abi::TANDEM_KV_MEM_CUDA
                    } else {
                        abi::TANDEM_KV_MEM_HOST
                    },
                    device: 0,
                };
                // SAFETY: i < pieces <= max_iovs: inside the plugin's array of `max_iovs` entries.
                unsafe { iovs.add(i).write(iov) };
                offset += piece;
            }
            let count = if action == Action::TooManyIovs {
                max_iovs + 1
            } else {
                lens.len()
            };
            let id = state.next_token;
            state.next_token += 1;
            // SAFETY: the plugin passes writable `n_iovs` and `token`.
            unsafe {
                n_iovs.write(count);
                token.write(id);
            }
            state.pending.insert(id, (received, buffer));
            abi::TANDEM_KV_DELIVER
        }
    };
    drop(state);
    host.changed.notify_all();
    if action == Action::DestroySelf {
        let instance = host.instance.swap(std::ptr::null_mut(), Ordering::AcqRel);
        let destroy = plugin().destroy.expect("destroy");
        // SAFETY: our own live instance; the Peer no longer destroys it (the pointer was swapped out).
        unsafe { destroy(instance) };
        host.mark_dead_except(1);
    }
    std::thread::sleep(delay);
    answer
}

unsafe extern "C" fn on_payload(ctx: *mut c_void, link: u64, token: u64, status: c_int) {
    // SAFETY: ctx is ours (see `host`).
    let host = unsafe { host(ctx) };
    let _active = host.enter();
    let mut state = host.state();
    match state.pending.remove(&token) {
        Some((mut received, buffer)) => {
            if received.link != link {
                state.errors.push(format!(
                    "on_payload: token {token} came on link {link}, not {}",
                    received.link
                ));
            }
            received.status = Some(status);
            if status == abi::TANDEM_KV_OK {
                received.payload = Some(buffer.into_vec());
            }
            state.received.push(received);
        }
        None => state
            .errors
            .push(format!("on_payload: unknown token {token}")),
    }
    drop(state);
    host.changed.notify_all();
}

unsafe extern "C" fn on_link_closed(
    ctx: *mut c_void,
    link: u64,
    status: c_int,
    reason: *const c_char,
) {
    // SAFETY: ctx is ours (see `host`).
    let host = unsafe { host(ctx) };
    let _active = host.enter();
    let reason = if reason.is_null() {
        String::new()
    } else {
        // SAFETY: a NUL-terminated string valid during the call.
        unsafe { CStr::from_ptr(reason) }
            .to_string_lossy()
            .into_owned()
    };
    let mut state = host.state();
    if state.closed.iter().any(|&(closed, ..)| closed == link) {
        state
            .errors
            .push(format!("on_link_closed twice for link {link}"));
    }
    if status >= 0 {
        state
            .errors
            .push(format!("on_link_closed with non-error status {status}"));
    }
    state.closed.push((link, status, reason));
    drop(state);
    host.changed.notify_all();
}

/// The host struct for a context, as tandem would fill it.
pub(crate) fn host_struct(ctx: *mut c_void) -> TandemKvHost {
    TandemKvHost {
        abi_version: abi::TANDEM_KV_ABI_VERSION,
        struct_size: size_of::<TandemKvHost>() as u32,
        ctx,
        on_message: Some(on_message),
        on_payload: Some(on_payload),
        on_link_closed: Some(on_link_closed),
    }
}

/// A failed call: status and `last_error`.
pub(crate) type Failed = (c_int, String);

fn check(status: c_int) -> Result<(), Failed> {
    if status == abi::TANDEM_KV_OK {
        Ok(())
    } else {
        Err((status, last_error()))
    }
}

/// One plugin instance and its test host.
#[derive(Debug)]
pub(crate) struct Peer {
    instance: *mut TandemKvInstance,
    pub(crate) host: Arc<TestHost>,
    /// Must stay valid until destroy returns.
    _host_struct: Box<TandemKvHost>,
}

// SAFETY: the header allows every plugin function to be called from any thread, concurrently; the
// instance pointer is only passed to them.
unsafe impl Send for Peer {}
// SAFETY: as for Send.
unsafe impl Sync for Peer {}

impl Peer {
    /// An instance with the default policy.
    pub(crate) fn new(config: &str) -> Peer {
        Peer::with_policy(config, deliver_all).expect("create")
    }

    /// An instance whose host answers messages with `policy`.
    pub(crate) fn with_policy(config: &str, policy: Policy) -> Result<Peer, Failed> {
        let host = Arc::new(TestHost::new(policy));
        let host_struct = Box::new(host_struct(Arc::as_ptr(&host).cast_mut().cast()));
        let config = CString::new(config).expect("config without NUL");
        let create = plugin().create.expect("create");
        let mut instance = std::ptr::null_mut();
        // SAFETY: valid config string, host struct kept alive by the Peer until after destroy, `out` a
        // live local.
        check(unsafe { create(config.as_ptr(), &*host_struct, &mut instance) })?;
        assert!(!instance.is_null());
        host.instance.store(instance, Ordering::Release);
        Ok(Peer {
            instance,
            host,
            _host_struct: host_struct,
        })
    }

    /// The raw instance handle (for argument-checking tests).
    pub(crate) fn raw(&self) -> *mut TandemKvInstance {
        self.instance
    }

    /// `endpoint()`.
    pub(crate) fn endpoint(&self) -> String {
        let endpoint = plugin().endpoint.expect("endpoint");
        // SAFETY: live instance; the string lives as long as it.
        let text = unsafe { endpoint(self.instance) };
        assert!(!text.is_null(), "endpoint returned NULL");
        // SAFETY: non-NULL (checked), NUL-terminated, valid while the instance lives.
        unsafe { CStr::from_ptr(text) }
            .to_str()
            .expect("UTF-8 endpoint")
            .to_owned()
    }

    /// `connect(endpoint)`.
    pub(crate) fn connect(&self, endpoint: &str) -> Result<u64, Failed> {
        let endpoint = CString::new(endpoint).expect("endpoint without NUL");
        let connect = plugin().connect.expect("connect");
        let mut link = u64::MAX;
        // SAFETY: live instance, valid string, `out` a live local.
        let status = unsafe { connect(self.instance, endpoint.as_ptr(), &mut link) };
        check(status).map(|()| {
            assert_ne!(link, 0, "link ids are never 0");
            link
        })
    }

    /// `send` with the payload gathered from `pieces`.
    pub(crate) fn send(&self, link: u64, header: &[u8], pieces: &[&[u8]]) -> Result<(), Failed> {
        let iovs: Vec<TandemKvIov> = pieces
            .iter()
            .map(|piece| TandemKvIov {
                addr: piece.as_ptr().cast_mut().cast(),
                len: piece.len() as u64,
                mem_kind: abi::TANDEM_KV_MEM_HOST,
                device: 0,
            })
            .collect();
        self.send_iovs(link, header.as_ptr(), header.len(), &iovs)
    }

    /// `send` with raw arguments; the iovecs must describe memory live during the call.
    pub(crate) fn send_iovs(
        &self,
        link: u64,
        header: *const u8,
        header_len: usize,
        iovs: &[TandemKvIov],
    ) -> Result<(), Failed> {
        let send = plugin().send.expect("send");
        // SAFETY: live instance; the caller passes a header readable for `header_len` bytes (or an
        // argument the plugin must reject before reading) and iovecs over live memory.
        check(unsafe {
            send(
                self.instance,
                link,
                header,
                header_len,
                iovs.as_ptr(),
                iovs.len(),
            )
        })
    }

    /// `close_link`.
    pub(crate) fn close_link(&self, link: u64) {
        let close_link = plugin().close_link.expect("close_link");
        // SAFETY: live instance.
        unsafe { close_link(self.instance, link) }
    }

    /// `destroy`, then marks the host dead so later callbacks are counted.
    pub(crate) fn destroy(mut self) -> Arc<TestHost> {
        self.destroy_now();
        Arc::clone(&self.host)
    }

    fn destroy_now(&mut self) {
        let instance = self
            .host
            .instance
            .swap(std::ptr::null_mut(), Ordering::AcqRel);
        if !instance.is_null() {
            let destroy = plugin().destroy.expect("destroy");
            // SAFETY: our live instance, destroyed exactly once (the pointer was swapped out).
            unsafe { destroy(instance) };
            self.host.mark_dead();
        }
        self.instance = std::ptr::null_mut();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.destroy_now();
    }
}

/// `n` random bytes from a seeded generator.
pub(crate) fn random_bytes(rng: &mut SmallRng, n: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; n];
    rng.fill(&mut bytes[..]);
    bytes
}

/// Splits `bytes` into `pieces` random consecutive slices (some may be empty).
pub(crate) fn scatter<'a>(rng: &mut SmallRng, bytes: &'a [u8], pieces: usize) -> Vec<&'a [u8]> {
    let mut rest = bytes;
    split(rng, bytes.len(), pieces)
        .into_iter()
        .map(|len| {
            let (piece, tail) = rest.split_at(len);
            rest = tail;
            piece
        })
        .collect()
}
