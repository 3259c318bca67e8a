//! The open/closed state of a stream-based link (TCP, the cuda-ipc control socket), shared by its
//! sends and its reader task: closed locally, failed with a reason, or open.
//!
//! Invariants: the state leaves `Open` exactly once (the first of `close` / `fail` wins); a message
//! abandoned half-written (its send future dropped, or an error mid-write) fails the link through
//! [`TornGuard`], so the next message can never follow half a frame.

use std::future::Future;

use tokio::sync::watch;

use crate::error::{Error, Result};

/// How a link stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Closed {
    Open,
    /// Closed by this side: no `on_link_closed` callback.
    Local,
    /// Failed: the reader reports `on_link_closed` with the reason.
    Failed(String),
}

/// One link's state and its peer's name (for errors).
pub(crate) struct LinkState {
    peer: String,
    closed: watch::Sender<Closed>,
}

impl LinkState {
    /// An open link to `peer`, and the receiver its reader task watches.
    pub(crate) fn new(peer: String) -> (LinkState, watch::Receiver<Closed>) {
        let (closed, rx) = watch::channel(Closed::Open);
        (LinkState { peer, closed }, rx)
    }

    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    fn leave_open(&self, to: Closed) {
        self.closed.send_if_modified(|c| {
            if *c == Closed::Open {
                *c = to;
                true
            } else {
                false
            }
        });
    }

    /// Marks the link failed (unless it is already closed).
    pub(crate) fn fail(&self, reason: String) {
        self.leave_open(Closed::Failed(reason));
    }

    /// Closes the link locally; idempotent.
    pub(crate) fn close(&self) {
        self.leave_open(Closed::Local);
    }

    /// The error a send on this link fails with.
    pub(crate) fn err(&self, reason: impl Into<String>) -> Error {
        Error::LinkFailed { peer: self.peer.clone(), reason: reason.into() }
    }

    /// Runs one send unless the link is, or becomes, closed meanwhile.
    pub(crate) async fn guarded(&self, send: impl Future<Output = Result<()>>) -> Result<()> {
        let mut closed = self.closed.subscribe();
        if *closed.borrow() != Closed::Open {
            return Err(self.err("link closed"));
        }
        tokio::select! {
            r = send => r,
            _ = closed.wait_for(|c| *c != Closed::Open) => Err(self.err("link closed")),
        }
    }

    /// A guard to hold while writing one message: unless disarmed, dropping it fails the link.
    pub(crate) fn torn_guard(&self) -> TornGuard<'_> {
        TornGuard { state: self, armed: true }
    }
}

/// Fails its link when dropped armed (a message left half-written).
pub(crate) struct TornGuard<'a> {
    state: &'a LinkState,
    armed: bool,
}

impl TornGuard<'_> {
    /// The message was written whole.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for TornGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.state.fail("a message was abandoned half-written".into());
        }
    }
}
