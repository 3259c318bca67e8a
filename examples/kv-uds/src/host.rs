//! The host's callbacks, copied out of `tandem_kv_host` once at `create` and called through safe methods.
//!
//! Invariants: a [`Host`] exists only for a host whose ABI major version is ours and whose struct is large
//! enough to hold every v1 field, with all three callbacks non-NULL; we read only the fields that fit in
//! the host's `struct_size`, as the header's compatibility rules require. The plugin never holds a lock
//! of its own while it calls into the host (see `instance.rs`), so a callback may call back into the
//! plugin (`close_link`, `connect`, even `destroy`) without deadlocking.

use std::ffi::{CString, c_int, c_void};

use crate::abi::{self, OnLinkClosedFn, OnMessageFn, OnPayloadFn, TandemKvHost, TandemKvIov};
use crate::error::Failure;

/// `TANDEM_KV_MAX_IOVS` as a length.
pub(crate) const MAX_IOVS: usize = abi::TANDEM_KV_MAX_IOVS as usize;

/// What the host answered to `on_message`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Disposition {
    /// The message has no payload; nothing more to do.
    NoPayload,
    /// Read and drop the payload.
    Discard,
    /// Write the payload into the first `n_iovs` iovecs, then report `token` through `on_payload`.
    Deliver { n_iovs: usize, token: u64 },
    /// Neither DELIVER nor DISCARD: a host bug; the payload is dropped, there is no token to report.
    Unknown(c_int),
}

/// The host's callbacks and context.
#[derive(Debug)]
pub(crate) struct Host {
    ctx: *mut c_void,
    on_message: OnMessageFn,
    on_payload: OnPayloadFn,
    on_link_closed: OnLinkClosedFn,
}

// SAFETY: `ctx` is only ever passed back to the host's own callbacks, which the header declares
// thread-safe and callable from the plugin's threads; the plugin never dereferences it.
unsafe impl Send for Host {}
// SAFETY: as for Send: shared access only copies the pointer and calls thread-safe host callbacks.
unsafe impl Sync for Host {}

impl Host {
    /// Copies the callbacks out of the host struct, after checking its version and size.
    ///
    /// # Safety
    /// `raw` is non-NULL and points to a readable `tandem_kv_host` of at least its own `struct_size`
    /// bytes, as the header guarantees for the `host` argument of `create`.
    pub(crate) unsafe fn from_raw(raw: *const TandemKvHost) -> Result<Host, Failure> {
        // SAFETY: the caller guarantees `raw` points to a readable host struct; `abi_version` and
        // `struct_size` are its first two fields, present in every version of the struct.
        let (abi_version, struct_size) = unsafe {
            (
                (&raw const (*raw).abi_version).read(),
                (&raw const (*raw).struct_size).read(),
            )
        };
        if abi_version != abi::TANDEM_KV_ABI_VERSION {
            return Err(Failure::unsupported(format!(
                "host speaks ABI version {abi_version}, this plugin only version {}",
                abi::TANDEM_KV_ABI_VERSION
            )));
        }
        let needed = size_of::<TandemKvHost>();
        if (struct_size as usize) < needed {
            return Err(Failure::invalid(format!(
                "host struct_size {struct_size} is smaller than the {needed} bytes of a v1 tandem_kv_host"
            )));
        }
        // SAFETY: the host struct is at least `needed` bytes (checked above), so reading our v1 mirror
        // from its start stays inside it; fields a newer host appended after them are not read.
        let host = unsafe { raw.read() };
        match (host.on_message, host.on_payload, host.on_link_closed) {
            (Some(on_message), Some(on_payload), Some(on_link_closed)) => Ok(Host {
                ctx: host.ctx,
                on_message,
                on_payload,
                on_link_closed,
            }),
            _ => Err(Failure::invalid("host callbacks must not be NULL")),
        }
    }

    /// Announces a message; `iovs` is where the host may describe the payload's destination.
    pub(crate) fn message(
        &self,
        link: u64,
        header: &[u8],
        payload_len: u64,
        iovs: &mut [TandemKvIov; MAX_IOVS],
    ) -> Disposition {
        let mut n_iovs = 0usize;
        let mut token = 0u64;
        // SAFETY: the callback was checked non-NULL at creation and the host keeps it valid until
        // destroy returns (no callback runs after that, see `Shared::callbacks_allowed`). Every pointer
        // argument is valid for the call: `header` for `header.len()` bytes, `iovs` for `MAX_IOVS`
        // writable entries, `n_iovs` and `token` are live locals.
        let answer = unsafe {
            (self.on_message)(
                self.ctx,
                link,
                header.as_ptr(),
                header.len(),
                payload_len,
                iovs.as_mut_ptr(),
                iovs.len(),
                &mut n_iovs,
                &mut token,
            )
        };
        match answer {
            _ if payload_len == 0 => Disposition::NoPayload,
            abi::TANDEM_KV_DELIVER => Disposition::Deliver { n_iovs, token },
            abi::TANDEM_KV_DISCARD => Disposition::Discard,
            other => Disposition::Unknown(other),
        }
    }

    /// Reports that the payload announced with `token` landed (`status` 0) or did not (`status` < 0).
    pub(crate) fn payload(&self, link: u64, token: u64, status: c_int) {
        // SAFETY: callback checked non-NULL at creation and valid until destroy returns; plain values.
        unsafe { (self.on_payload)(self.ctx, link, token, status) }
    }

    /// Reports that `link` is gone.
    pub(crate) fn link_closed(&self, link: u64, status: c_int, reason: &str) {
        let reason = CString::new(reason.replace('\0', "\\0")).unwrap_or_default();
        // SAFETY: callback checked non-NULL at creation and valid until destroy returns; `reason` is a
        // NUL-terminated string that outlives the call, as the header requires.
        unsafe { (self.on_link_closed)(self.ctx, link, status, reason.as_ptr()) }
    }
}
