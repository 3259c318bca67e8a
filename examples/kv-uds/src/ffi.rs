//! The `extern "C"` functions behind the vtable: argument checks, panics and status codes.
//!
//! Invariants: no panic crosses the boundary (every body runs under `catch_unwind`; a panic becomes
//! `TANDEM_KV_ERR_INTERNAL`); every NULL pointer argument is `TANDEM_KV_ERR_INVALID` before anything is
//! dereferenced; every failing call records its message for `last_error` on the calling thread; counts
//! are checked against the header's limits before a slice is made from a pointer and a count.

use std::any::Any;
use std::ffi::{CStr, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::abi::{self, TandemKvHost, TandemKvInstance, TandemKvIov, TandemKvLink};
use crate::error::{self, Failure};
use crate::host::{Host, MAX_IOVS};
use crate::instance::Instance;
use crate::wire::MAX_HEADER;

/// Text of a caught panic.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic".to_owned());
    format!("internal error (panic): {text}")
}

/// Runs `body`, turning its failure or panic into a status code and a `last_error` message.
fn guard(body: impl FnOnce() -> Result<(), Failure>) -> c_int {
    let failure = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return abi::TANDEM_KV_OK,
        Ok(Err(failure)) => failure,
        Err(panic) => Failure::internal(panic_message(&*panic)),
    };
    error::record(failure.message());
    failure.status()
}

/// Runs `body` for a function that returns nothing: failures and panics only reach `last_error`.
fn guard_void(body: impl FnOnce() -> Result<(), Failure>) {
    let _ = guard(body);
}

/// The instance behind a handle.
///
/// # Safety
/// `inst` is NULL or a handle `create` returned that has not been destroyed.
unsafe fn instance<'a>(inst: *mut TandemKvInstance) -> Result<&'a Instance, Failure> {
    // SAFETY: non-NULL handles come from `Box::into_raw` in `create` and stay valid until `destroy`;
    // the caller guarantees this one was not destroyed. Instance is Sync: shared access is fine.
    unsafe { inst.cast::<Instance>().as_ref() }.ok_or_else(|| Failure::invalid("NULL instance"))
}

/// `create`: parses `config`, copies the host's callbacks, starts listening.
///
/// # Safety
/// Per the header: `config` a NUL-terminated string, `host` a valid `tandem_kv_host` that stays valid
/// until `destroy` returns, `out` writable; any may be NULL (then INVALID).
pub(crate) unsafe extern "C" fn create(
    config: *const c_char,
    host: *const TandemKvHost,
    out: *mut *mut TandemKvInstance,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(Failure::invalid("create: `out` is NULL"));
        }
        // SAFETY: `out` is non-NULL and writable per the contract; clear it so a failure leaves NULL.
        unsafe { out.write(std::ptr::null_mut()) };
        if config.is_null() || host.is_null() {
            return Err(Failure::invalid(
                "create: `config` and `host` must not be NULL",
            ));
        }
        // SAFETY: non-NULL and NUL-terminated per the contract; read only during this call.
        let config = unsafe { CStr::from_ptr(config) };
        // SAFETY: non-NULL and pointing to a valid host struct per the contract.
        let host = unsafe { Host::from_raw(host) }?;
        let instance = Box::new(Instance::create(config.to_bytes(), host)?);
        // SAFETY: `out` is non-NULL and writable (checked above).
        unsafe { out.write(Box::into_raw(instance).cast()) };
        Ok(())
    })
}

/// `destroy`: closes everything, joins every thread, frees the instance. NULL is ignored.
///
/// # Safety
/// `inst` is NULL or a live handle from `create`, not used by anyone after this call.
pub(crate) unsafe extern "C" fn destroy(inst: *mut TandemKvInstance) {
    guard_void(|| {
        if inst.is_null() {
            return Err(Failure::invalid("destroy: NULL instance"));
        }
        // SAFETY: a live handle from `Box::into_raw` in `create`, destroyed exactly once (contract).
        let instance = unsafe { Box::from_raw(inst.cast::<Instance>()) };
        instance.destroy();
        Ok(())
    });
}

/// `endpoint`: the instance's `uds:<path>`; an empty string for a NULL handle (never NULL).
///
/// # Safety
/// `inst` is NULL or a live handle from `create`.
pub(crate) unsafe extern "C" fn endpoint(inst: *mut TandemKvInstance) -> *const c_char {
    let found = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: NULL or live handle (contract).
        unsafe { instance(inst) }.map(|instance| instance.endpoint().as_ptr())
    }));
    match found {
        Ok(Ok(endpoint)) => endpoint,
        Ok(Err(failure)) => {
            error::record(failure.message());
            c"".as_ptr()
        }
        Err(panic) => {
            error::record(&panic_message(&*panic));
            c"".as_ptr()
        }
    }
}

/// `connect`: opens a link to `uds:<path>`; `*out` is 0 on failure.
///
/// # Safety
/// `inst` NULL or live; `endpoint` NULL or NUL-terminated; `out` NULL or writable.
pub(crate) unsafe extern "C" fn connect(
    inst: *mut TandemKvInstance,
    endpoint: *const c_char,
    out: *mut TandemKvLink,
) -> c_int {
    guard(|| {
        if out.is_null() || endpoint.is_null() {
            return Err(Failure::invalid(
                "connect: `endpoint` and `out` must not be NULL",
            ));
        }
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(0) };
        // SAFETY: NULL or live handle (contract).
        let instance = unsafe { instance(inst) }?;
        // SAFETY: non-NULL and NUL-terminated per the contract; read only during this call.
        let endpoint = unsafe { CStr::from_ptr(endpoint) };
        let link = instance.connect(endpoint.to_bytes())?;
        // SAFETY: as above.
        unsafe { out.write(link) };
        Ok(())
    })
}

/// `send`: one message on `link`; blocks until written.
///
/// # Safety
/// `inst` NULL or live; `header` NULL or readable for `header_len` bytes; `iovs` NULL or readable for
/// `n_iovs` entries whose host memory is readable and unchanged until this call returns.
pub(crate) unsafe extern "C" fn send(
    inst: *mut TandemKvInstance,
    link: TandemKvLink,
    header: *const u8,
    header_len: usize,
    iovs: *const TandemKvIov,
    n_iovs: usize,
) -> c_int {
    guard(|| {
        // SAFETY: NULL or live handle (contract).
        let instance = unsafe { instance(inst) }?;
        if header_len > MAX_HEADER {
            return Err(Failure::invalid(format!(
                "header_len {header_len} exceeds TANDEM_KV_MAX_HEADER"
            )));
        }
        if n_iovs > MAX_IOVS {
            return Err(Failure::invalid(format!(
                "n_iovs {n_iovs} exceeds TANDEM_KV_MAX_IOVS"
            )));
        }
        let header: &[u8] = match (header.is_null(), header_len) {
            (_, 0) => &[],
            (true, _) => return Err(Failure::invalid("send: NULL header with header_len > 0")),
            // SAFETY: non-NULL, readable for `header_len` (<= 4096) bytes during the call (contract).
            (false, len) => unsafe { std::slice::from_raw_parts(header, len) },
        };
        let iovs: &[TandemKvIov] = match (iovs.is_null(), n_iovs) {
            (_, 0) => &[],
            (true, _) => return Err(Failure::invalid("send: NULL iovs with n_iovs > 0")),
            // SAFETY: non-NULL, `n_iovs` (<= 256) readable entries during the call (contract).
            (false, n) => unsafe { std::slice::from_raw_parts(iovs, n) },
        };
        instance.send(link, header, iovs)
    })
}

/// `close_link`: closes `link` without an `on_link_closed`; idempotent, unknown ids ignored.
///
/// # Safety
/// `inst` NULL or live.
pub(crate) unsafe extern "C" fn close_link(inst: *mut TandemKvInstance, link: TandemKvLink) {
    guard_void(|| {
        // SAFETY: NULL or live handle (contract).
        unsafe { instance(inst) }?.close_link(link);
        Ok(())
    });
}

/// `last_error`: the calling thread's last error message; never NULL.
///
/// # Safety
/// None beyond the ABI: callable from any thread at any time.
pub(crate) unsafe extern "C" fn last_error() -> *const c_char {
    catch_unwind(error::last_error_ptr).unwrap_or(c"internal error".as_ptr())
}
