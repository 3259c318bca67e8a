//! Failures inside the plugin, and the thread-local text behind `last_error`.
//!
//! Invariants: a [`Failure`] always carries a negative `TANDEM_KV_ERR_*` status; the pointer
//! [`last_error_ptr`] returns is never NULL and stays valid until the next failure is recorded on the
//! same thread (the header asks for exactly "thread-local storage, never NULL").

use std::cell::RefCell;
use std::ffi::{CString, c_char, c_int};

use crate::abi;

/// What went wrong in one plugin call: the status returned to the host and a message for `last_error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    status: c_int,
    message: String,
}

impl Failure {
    fn new(status: c_int, message: impl Into<String>) -> Failure {
        debug_assert!(status < 0, "a failure needs a negative status");
        Failure {
            status,
            message: message.into(),
        }
    }

    /// `TANDEM_KV_ERR_INVALID`: a bad argument.
    pub(crate) fn invalid(message: impl Into<String>) -> Failure {
        Failure::new(abi::TANDEM_KV_ERR_INVALID, message)
    }

    /// `TANDEM_KV_ERR_UNREACHABLE`: nobody answers at an endpoint, or it is malformed.
    pub(crate) fn unreachable(message: impl Into<String>) -> Failure {
        Failure::new(abi::TANDEM_KV_ERR_UNREACHABLE, message)
    }

    /// `TANDEM_KV_ERR_IO`: a link failed while sending or receiving.
    pub(crate) fn io(message: impl Into<String>) -> Failure {
        Failure::new(abi::TANDEM_KV_ERR_IO, message)
    }

    /// `TANDEM_KV_ERR_CLOSED`: the link or the instance is already closed.
    pub(crate) fn closed(message: impl Into<String>) -> Failure {
        Failure::new(abi::TANDEM_KV_ERR_CLOSED, message)
    }

    /// `TANDEM_KV_ERR_UNSUPPORTED`: something this backend cannot do (device memory).
    pub(crate) fn unsupported(message: impl Into<String>) -> Failure {
        Failure::new(abi::TANDEM_KV_ERR_UNSUPPORTED, message)
    }

    /// `TANDEM_KV_ERR_INTERNAL`: anything else.
    pub(crate) fn internal(message: impl Into<String>) -> Failure {
        Failure::new(abi::TANDEM_KV_ERR_INTERNAL, message)
    }

    /// The status code handed back through the ABI.
    pub(crate) fn status(&self) -> c_int {
        self.status
    }

    /// The human-readable description.
    pub(crate) fn message(&self) -> &str {
        &self.message
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::from(c"no error"));
}

/// Used when the thread-local is already torn down (a call during thread exit).
const UNAVAILABLE: &std::ffi::CStr = c"last error unavailable on this thread";

/// Records `message` as the calling thread's last error (interior NUL bytes are escaped).
pub(crate) fn record(message: &str) {
    let text = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    // Ignoring the error is right: it only happens while the thread's locals are being destroyed.
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = text);
}

/// The calling thread's last error as a C string; never NULL.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|slot| slot.borrow().as_ptr())
        .unwrap_or(UNAVAILABLE.as_ptr())
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;

    use super::*;

    fn last() -> String {
        // SAFETY: last_error_ptr never returns NULL and the string lives until the next `record` on
        // this thread, which does not happen while we read it.
        unsafe { CStr::from_ptr(last_error_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn last_error_is_per_thread_and_survives_interior_nul() {
        record("first\0second");
        assert_eq!(last(), "first\\0second");
        std::thread::spawn(|| assert_eq!(last(), "no error"))
            .join()
            .unwrap();
        assert_eq!(last(), "first\\0second");
    }

    #[test]
    fn constructors_carry_their_status() {
        assert_eq!(Failure::invalid("x").status(), abi::TANDEM_KV_ERR_INVALID);
        assert_eq!(
            Failure::unreachable("x").status(),
            abi::TANDEM_KV_ERR_UNREACHABLE
        );
        assert_eq!(Failure::io("x").status(), abi::TANDEM_KV_ERR_IO);
        assert_eq!(Failure::closed("x").status(), abi::TANDEM_KV_ERR_CLOSED);
        assert_eq!(
            Failure::unsupported("x").status(),
            abi::TANDEM_KV_ERR_UNSUPPORTED
        );
        assert_eq!(Failure::internal("boom").message(), "boom");
    }
}
