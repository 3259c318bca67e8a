//! Continuous-batching scheduler: decides, step by step, which tokens of which sequences the
//! model computes, and keeps the KV block bookkeeping (through [`crate::kv::BlockPool`]) in step.
//!
//! Features: first-come-first-served admission under a token budget and a running-sequence cap,
//! chunked prefill mixed with decodes, prefix caching on admission, `n > 1` sampling by forking
//! block tables (copy-on-write), preemption by recompute, and the hooks a disaggregated
//! deployment needs (hold/release on a prefill node, allocate_remote/kv_ready on a decode node).
//!
//! Invariants: every live sequence is in exactly one place (waiting, running, ready, held or
//! awaiting KV); each block a sequence references is counted once in the pool; a schedule
//! never exceeds the token budget or `max_num_seqs`; chunk block tables cover their positions;
//! when every request is gone the pool is fully free. `schedule` does no I/O and takes no locks.

mod config;
mod invariants;
mod output;
mod request;
mod scheduler;
mod seq;
mod step;

#[cfg(test)]
mod golden_tests;
#[cfg(test)]
mod random_tests;

pub use config::{Role, SchedulerConfig};
pub use output::{RemoteAlloc, Schedule, ScheduledChunk};
pub use request::{NewRequest, RequestId, SeqId};
pub use scheduler::Scheduler;

/// A sampled token the engine does not know yet (overlapped scheduling): reported through
/// [`Scheduler::on_sampled`] while the step that samples it still runs, so the next step can be
/// scheduled at once, and replaced through [`Scheduler::resolve_token`] when it is known. It is
/// only ever a sequence's last token; the chunk that computes it holds it alone, and the block
/// holding it joins the prefix cache only once it is resolved.
pub const PENDING_TOKEN: u32 = u32::MAX;
