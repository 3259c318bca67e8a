//! A link's reader thread: reads messages off the socket and hands them to the host.
//!
//! Per message: prefix, header, `on_message`, then the payload goes into the host's iovecs (DELIVER,
//! followed by exactly one `on_payload` for the token) or through a fixed buffer (DISCARD). When the
//! stream ends, fails or breaks the wire format, the thread shuts the socket down (failing pending and
//! later sends) and ends the link through `Shared::link_ended`.
//!
//! Invariants: the only buffers are one `TANDEM_KV_MAX_HEADER` header buffer and one
//! `TANDEM_KV_MAX_IOVS` iovec array per link, so no peer can make us allocate; once `destroy` began,
//! the thread makes no further callback and no longer touches host memory; a host bug in the delivered
//! iovecs costs that one payload (drained, reported with an error status), not the link.

use std::ffi::c_int;
use std::io::Read;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::abi::{self, TandemKvIov};
use crate::host::{Disposition, MAX_IOVS};
use crate::instance::{Link, Shared};
use crate::{payload, wire};

/// How a link's reading ended.
enum End {
    /// The link failed or the peer closed it: tell the host (if it still owns the link).
    Failed { status: c_int, reason: String },
    /// `destroy` began: end quietly.
    Stopping,
}

impl End {
    fn closed() -> End {
        End::Failed {
            status: abi::TANDEM_KV_ERR_CLOSED,
            reason: "the peer closed the link".into(),
        }
    }

    fn io(what: &str, error: &std::io::Error) -> End {
        End::Failed {
            status: abi::TANDEM_KV_ERR_IO,
            reason: format!("{what}: {error}"),
        }
    }
}

/// The body of a link's reader thread.
pub(crate) fn run(shared: &Shared, link: &Link) {
    let end =
        catch_unwind(AssertUnwindSafe(|| serve(shared, link))).unwrap_or_else(|_| End::Failed {
            status: abi::TANDEM_KV_ERR_INTERNAL,
            reason: "the link's reader thread panicked".into(),
        });
    link.shutdown();
    match end {
        End::Stopping => {}
        End::Failed { status, reason } => match link.fault() {
            Some(fault) => shared.link_ended(link, abi::TANDEM_KV_ERR_IO, fault),
            None => shared.link_ended(link, status, &reason),
        },
    }
}

fn serve(shared: &Shared, link: &Link) -> End {
    let mut stream = &link.stream;
    let mut header = vec![0u8; wire::MAX_HEADER];
    let mut iovs = Box::new([TandemKvIov::EMPTY; MAX_IOVS]);
    loop {
        let prefix = match wire::read_prefix(stream) {
            Ok(Some(bytes)) => match wire::Prefix::decode(&bytes) {
                Ok(prefix) => prefix,
                Err(why) => {
                    return End::Failed {
                        status: abi::TANDEM_KV_ERR_IO,
                        reason: format!("protocol error: {why}"),
                    };
                }
            },
            Ok(None) => return End::closed(),
            Err(e) => return End::io("reading a message", &e),
        };
        let header = &mut header[..prefix.header_len as usize];
        if let Err(e) = stream.read_exact(header) {
            return End::io("reading a message header", &e);
        }
        if !shared.callbacks_allowed() {
            return End::Stopping;
        }
        link.announce();
        *iovs = [TandemKvIov::EMPTY; MAX_IOVS];
        let disposition = shared
            .host()
            .message(link.id, header, prefix.payload_len, &mut iovs);
        if !shared.callbacks_allowed() {
            return End::Stopping;
        }
        match disposition {
            Disposition::NoPayload => {}
            Disposition::Discard | Disposition::Unknown(_) => {
                if let Err(e) = wire::drain(stream, prefix.payload_len) {
                    return End::io("reading a discarded payload", &e);
                }
            }
            Disposition::Deliver { n_iovs, token } => {
                if let Some(end) = deliver(shared, link, &iovs, n_iovs, token, prefix.payload_len) {
                    return end;
                }
            }
        }
    }
}

/// Reads one payload into the host's iovecs and reports it; `Some` when the link must end.
fn deliver(
    shared: &Shared,
    link: &Link,
    iovs: &[TandemKvIov; MAX_IOVS],
    n_iovs: usize,
    token: u64,
    payload_len: u64,
) -> Option<End> {
    let stream = &link.stream;
    let landed = if n_iovs > MAX_IOVS {
        Err(crate::error::Failure::invalid(format!(
            "host bug: n_iovs {n_iovs} exceeds max_iovs {MAX_IOVS}"
        )))
    } else {
        // SAFETY: by answering TANDEM_KV_DELIVER the host promised that these iovecs are writable and
        // reserved for this payload until we call on_payload for `token`, which happens below, after
        // the slices are gone; `scatter` checks kind, NULL, lengths and overlap before making slices.
        unsafe { payload::scatter(&iovs[..n_iovs], payload_len) }
    };
    let outcome = match landed {
        Ok(mut slices) => {
            wire::read_exact_vectored(stream, &mut slices).map(|()| abi::TANDEM_KV_OK)
        }
        // A host bug costs this payload, not the link: drain it, then report the bug's status.
        Err(failure) => wire::drain(stream, payload_len).map(|()| failure.status()),
    };
    if !shared.callbacks_allowed() {
        return Some(End::Stopping);
    }
    match outcome {
        Ok(status) => {
            shared.host().payload(link.id, token, status);
            None
        }
        Err(e) => {
            shared.host().payload(link.id, token, abi::TANDEM_KV_ERR_IO);
            Some(End::io("reading a payload", &e))
        }
    }
}
