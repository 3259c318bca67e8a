//! Handles on in-flight transfers. A handle is the transfer: dropping it cancels the transfer, and the
//! connector releases every block claim on both sides.
//!
//! Invariant: a handle's progress reaches a terminal state (`Complete` or `Failed`) only after the
//! transfer's block claim was released, so once a caller sees it, no backend touches those blocks again.

use std::sync::Weak;
use std::time::Duration;

use tokio::sync::watch;

use crate::connector::TransferDescriptor;
use crate::core::Core;
use crate::error::{Error, Result};

/// What one finished transfer achieved: the bandwidth self-check every backend reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferStats {
    /// Payload bytes moved (all layers).
    pub bytes: u64,
    /// From the transfer's start (sender: `send`; receiver: the peer's `Start`) to completion.
    pub elapsed: Duration,
}

impl TransferStats {
    /// Achieved payload bandwidth.
    pub fn bytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Where a transfer stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferState {
    /// Still moving (or waiting for its peer).
    Pending,
    /// Every layer landed and was verified.
    Complete(TransferStats),
    /// Failed or cancelled; the blocks are released.
    Failed(Error),
}

/// A snapshot of a transfer's progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// Layers fully sent (sender) or landed and verified (receiver), always a prefix `0..layers`.
    pub layers: u32,
    /// Payload bytes so far.
    pub bytes: u64,
    /// Pending, complete or failed.
    pub state: TransferState,
}

impl Progress {
    pub(crate) fn pending() -> Progress {
        Progress { layers: 0, bytes: 0, state: TransferState::Pending }
    }

    pub(crate) fn is_terminal(&self) -> bool {
        !matches!(self.state, TransferState::Pending)
    }
}

async fn wait_layer(rx: &mut watch::Receiver<Progress>, layer: u32) -> Result<()> {
    let p = rx.wait_for(|p| p.is_terminal() || p.layers > layer).await.map_err(|_| Error::Shutdown)?;
    match &p.state {
        TransferState::Failed(e) => Err(e.clone()),
        _ => Ok(()),
    }
}

fn stats_of(p: Progress) -> Result<TransferStats> {
    match p.state {
        TransferState::Complete(s) => Ok(s),
        TransferState::Failed(e) => Err(e),
        TransferState::Pending => Err(Error::Shutdown),
    }
}

/// The receiving side of one transfer: created by [`crate::Connector::expect`] before the sender starts.
#[derive(Debug)]
pub struct RecvHandle {
    pub(crate) descriptor: TransferDescriptor,
    pub(crate) progress: watch::Receiver<Progress>,
    pub(crate) core: Weak<Core>,
}

impl RecvHandle {
    /// What the sender needs (send it to the prefill node).
    pub fn descriptor(&self) -> &TransferDescriptor {
        &self.descriptor
    }

    /// Current progress.
    pub fn progress(&self) -> Progress {
        self.progress.borrow().clone()
    }

    /// Resolves once `layer` (and every layer before it) has landed and been verified.
    pub async fn layer_ready(&mut self, layer: u32) -> Result<()> {
        wait_layer(&mut self.progress, layer).await
    }

    /// Resolves when the whole transfer has landed (`Ok`) or failed.
    pub async fn wait(&mut self) -> Result<TransferStats> {
        let p = self.progress.wait_for(Progress::is_terminal).await.map_err(|_| Error::Shutdown)?.clone();
        stats_of(p)
    }

    /// Cancels the transfer and resolves once its blocks are released (safe to reuse).
    pub async fn cancel(mut self) {
        if let Some(core) = self.core.upgrade() {
            core.rx_cancel(self.descriptor.id);
        }
        let _ = self.progress.wait_for(Progress::is_terminal).await;
    }
}

impl Drop for RecvHandle {
    fn drop(&mut self) {
        if !self.progress.borrow().is_terminal()
            && let Some(core) = self.core.upgrade()
        {
            core.rx_cancel(self.descriptor.id);
        }
    }
}

/// The sending side of one transfer: created by [`crate::Connector::send`]. Push layers as they are
/// computed; the connector streams each one while the next is being computed.
#[derive(Debug)]
pub struct SendHandle {
    pub(crate) id: u64,
    pub(crate) num_layers: u32,
    pub(crate) pushed: watch::Sender<u32>,
    pub(crate) cancel: watch::Sender<bool>,
    pub(crate) progress: watch::Receiver<Progress>,
}

impl SendHandle {
    /// The transfer id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Announces that `layer` is computed and may be sent. Layers must be pushed in order, each once.
    /// Never blocks: the data stays in the block pool until the connector sends it.
    pub fn push_layer(&self, layer: u32) -> Result<()> {
        let next = *self.pushed.borrow();
        if layer != next || layer >= self.num_layers {
            return Err(Error::Invalid(format!(
                "layer {layer} pushed out of order: next is {next} of {}",
                self.num_layers
            )));
        }
        self.pushed.send_replace(layer + 1);
        Ok(())
    }

    /// Announces that every remaining layer is ready (bulk transfer after a full prefill).
    pub fn push_all(&self) {
        self.pushed.send_replace(self.num_layers);
    }

    /// Current progress.
    pub fn progress(&self) -> Progress {
        self.progress.borrow().clone()
    }

    /// Resolves when the receiver confirmed every layer (`Ok`) or the transfer failed.
    pub async fn wait(&mut self) -> Result<TransferStats> {
        let p = self.progress.wait_for(Progress::is_terminal).await.map_err(|_| Error::Shutdown)?.clone();
        stats_of(p)
    }

    /// Cancels the transfer and resolves once its source blocks are no longer read.
    pub async fn cancel(mut self) {
        self.cancel.send_replace(true);
        let _ = self.progress.wait_for(Progress::is_terminal).await;
    }
}

impl Drop for SendHandle {
    fn drop(&mut self) {
        self.cancel.send_replace(true);
    }
}
