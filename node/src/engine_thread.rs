//! The engine on its own OS thread ("sync core, async shell"): async handlers send it closed-enum
//! commands over a channel; it steps the engine whenever work is pending and sends each request's
//! outputs to that request's own channel. On a prefill node it also starts each request's KV transfer
//! when the request's final prompt chunk is scheduled and pushes every layer the moment the forward pass
//! has written it.
//!
//! Invariants:
//! - Only this thread touches the `Engine`; nothing here blocks except waiting for commands when the
//!   engine has no work (`Engine::has_work`: requests waiting for KV or a release do not spin it).
//! - A request whose output channel is gone (its handler was cancelled) is aborted at once.
//! - Commands queued before a step are applied before it, so an abort never waits more than one step.
//! - A remote allocation that does not fit the free blocks now waits in a FIFO queue (it holds no
//!   block) and is retried, front first, whenever blocks may have come back (after every command and
//!   step) instead of failing; only a prompt that cannot fit even an empty pool is refused at once
//!   (`CapacityExceeded`). A queued allocation whose caller went away is dropped unanswered.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use tandem_engine::engine::{EngineLoad, FinishReason, PrefillReady, SeqOutput, StepObserver, TokenLogprob};
use tandem_engine::sampling::SamplingParams;
use tandem_engine::sched::{RemoteAlloc, RequestId};
use tandem_engine::{Engine, Error as EngineError};
use tandem_kv_transfer::{Connector, KvMemory, SendHandle, TransferDescriptor};
use tokio::sync::{mpsc, oneshot};

/// What a request's handler receives.
#[derive(Debug)]
pub enum Event {
    /// The request left the engine's queue: its first chunk was scheduled (requests allocated with
    /// [`EngineThread::add_remote`] are never queued and never get this).
    Scheduled,
    /// Tokens (the last one carries `finish`).
    Output(SeqOutput),
    /// Prefill role: the first token is sampled and the prompt's blocks are held; `transfer` is the KV
    /// transfer that was pushed layer by layer (None when the request had no transfer plan).
    PrefillDone {
        /// The first token's output.
        output: SeqOutput,
        /// The transfer, to await before releasing the blocks.
        transfer: Option<SendHandle>,
    },
    /// The request failed inside the engine thread (it is already aborted there).
    Failed(String),
}

/// Where a prefill's KV goes: started when the request's final chunk is scheduled.
#[derive(Debug)]
pub struct TransferPlan {
    /// The decode node's descriptor.
    pub descriptor: TransferDescriptor,
    /// Leading prompt blocks the decode node already has (not sent).
    pub skip_blocks: usize,
    /// The binding of the prompt this node computes ([`crate::kv::kv_binding`] of its own prompt,
    /// never the descriptor's).
    pub binding: u64,
    /// Deadline of the transfer.
    pub timeout: Duration,
}

type Reply<T> = oneshot::Sender<Result<T, EngineError>>;

enum Cmd {
    Validate { prompt: Vec<u32>, params: SamplingParams, reply: Reply<()> },
    Add { prompt: Vec<u32>, params: SamplingParams, plan: Option<TransferPlan>, events: mpsc::UnboundedSender<Event>, reply: Reply<RequestId> },
    AddRemote { prompt: Vec<u32>, params: SamplingParams, events: mpsc::UnboundedSender<Event>, reply: Reply<(RequestId, RemoteAlloc)> },
    AddResumed { tokens: Vec<u32>, generated: usize, params: SamplingParams, events: mpsc::UnboundedSender<Event>, reply: Reply<RequestId> },
    KvReady { id: RequestId, first_token: u32, logprob: Option<TokenLogprob>, reply: Reply<()> },
    Abort { id: RequestId },
    Release { id: RequestId },
    Load { reply: oneshot::Sender<EngineLoad> },
    CachedPrefix { prompt: Vec<u32>, reply: oneshot::Sender<usize> },
}

/// Handle to the engine thread; cheap to clone. The thread ends when the last handle is dropped.
#[derive(Clone)]
pub struct EngineThread {
    cmds: std_mpsc::Sender<Cmd>,
}

impl std::fmt::Debug for EngineThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineThread")
    }
}

fn gone() -> EngineError {
    EngineError::Config("the engine thread has stopped".into())
}

/// Engine threads that may still be running, so the process can wait for them before it exits: an
/// engine freeing its GPU memory while the exiting process tears the CUDA driver down crashes it.
static THREADS: std::sync::Mutex<Vec<std::thread::JoinHandle<()>>> = std::sync::Mutex::new(Vec::new());

/// Waits up to `limit` for every engine thread of this process to end (each ends once the last
/// handle to it and to its KV memory is gone, after dropping its engine); returns how many still run.
/// Call it after the runtime that served the nodes is dropped, just before the process exits.
pub fn wait_for_engine_threads(limit: Duration) -> usize {
    let deadline = Instant::now() + limit;
    loop {
        let mut threads = THREADS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        threads.retain(|t| !t.is_finished());
        if threads.is_empty() || Instant::now() >= deadline {
            return threads.len();
        }
        drop(threads);
        std::thread::sleep(Duration::from_millis(5));
    }
}

impl EngineThread {
    /// Moves `engine` onto a new thread. `connector` is used for transfer plans (prefill role).
    /// `memory` is the engine's KV cache as registered for transfers: when the last handle is dropped the
    /// thread keeps the engine alive until nobody else references that memory.
    pub fn spawn(engine: Engine, connector: Option<Arc<Connector>>, memory: Option<Arc<KvMemory>>) -> std::io::Result<EngineThread> {
        let (tx, rx) = std_mpsc::channel();
        let thread = std::thread::Builder::new().name("tandem-engine".into()).spawn(move || {
            let worker = Worker::new(engine, connector);
            let engine = worker.run(rx);
            if let Some(memory) = memory {
                while Arc::strong_count(&memory) > 1 {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            drop(engine);
        })?;
        THREADS.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(thread);
        Ok(EngineThread { cmds: tx })
    }

    async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Cmd) -> Result<T, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.cmds.send(make(tx)).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// Checks a request without queueing it.
    pub async fn validate(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<(), EngineError> {
        self.ask(|reply| Cmd::Validate { prompt, params, reply }).await
    }

    /// Queues a request that prefills here (and, with a plan, ships its KV while prefilling).
    pub async fn add(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        plan: Option<TransferPlan>,
    ) -> Result<(RequestId, mpsc::UnboundedReceiver<Event>), EngineError> {
        let (events, rx) = mpsc::unbounded_channel();
        let id = self.ask(|reply| Cmd::Add { prompt, params, plan, events, reply }).await?;
        Ok((id, rx))
    }

    /// Queues a migrated request that prefills here: `tokens` is its prompt followed by the
    /// `generated` tokens another node already streamed, `params.max_tokens` counts the rest (see
    /// `Engine::add_resumed_request`).
    pub async fn add_resumed(
        &self,
        tokens: Vec<u32>,
        generated: usize,
        params: SamplingParams,
    ) -> Result<(RequestId, mpsc::UnboundedReceiver<Event>), EngineError> {
        let (events, rx) = mpsc::unbounded_channel();
        let id = self.ask(|reply| Cmd::AddResumed { tokens, generated, params, events, reply }).await?;
        Ok((id, rx))
    }

    /// Decode role: allocates blocks for a prompt prefilled elsewhere, waiting (in FIFO order with
    /// other remote allocations) until the pool has room; dropping the future gives up its place.
    pub async fn add_remote(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<(RequestId, RemoteAlloc, mpsc::UnboundedReceiver<Event>), EngineError> {
        let (events, rx) = mpsc::unbounded_channel();
        let (id, alloc) = self.ask(|reply| Cmd::AddRemote { prompt, params, events, reply }).await?;
        Ok((id, alloc, rx))
    }

    /// Decode role: the KV landed; start decoding after `first_token` (with its logprobs from the
    /// prefill node, if the request asked for them).
    pub async fn kv_ready(&self, id: RequestId, first_token: u32, logprob: Option<TokenLogprob>) -> Result<(), EngineError> {
        self.ask(|reply| Cmd::KvReady { id, first_token, logprob, reply }).await
    }

    /// Aborts a request wherever it is and frees its blocks.
    pub fn abort(&self, id: RequestId) {
        let _ = self.cmds.send(Cmd::Abort { id });
    }

    /// Prefill role: frees the blocks a finished prefill holds.
    pub fn release(&self, id: RequestId) {
        let _ = self.cmds.send(Cmd::Release { id });
    }

    /// Queue and KV occupancy, for routing.
    pub async fn load(&self) -> Result<EngineLoad, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.cmds.send(Cmd::Load { reply: tx }).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }

    /// Leading prompt tokens the prefix cache would serve now.
    pub async fn cached_prefix_len(&self, prompt: Vec<u32>) -> Result<usize, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.cmds.send(Cmd::CachedPrefix { prompt, reply: tx }).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }
}

struct Live {
    events: mpsc::UnboundedSender<Event>,
    plan: Option<TransferPlan>,
    /// When the request was queued (its queue time ends when its first chunk is scheduled).
    queued_at: Instant,
}

/// A remote allocation waiting for free blocks.
struct PendingRemote {
    prompt: Vec<u32>,
    params: SamplingParams,
    events: mpsc::UnboundedSender<Event>,
    reply: Reply<(RequestId, RemoteAlloc)>,
}

struct Worker {
    engine: Engine,
    connector: Option<Arc<Connector>>,
    live: HashMap<RequestId, Live>,
    /// Remote allocations waiting for blocks, front first.
    pending_remote: VecDeque<PendingRemote>,
}

/// Starts and feeds the transfers of the requests completing their prefill in one step.
struct Observer<'a> {
    connector: Option<&'a Arc<Connector>>,
    live: &'a mut HashMap<RequestId, Live>,
    started: Vec<(RequestId, SendHandle)>,
    failed: Vec<(RequestId, String)>,
}

impl StepObserver for Observer<'_> {
    fn prefill_completing(&mut self, ready: &[PrefillReady]) {
        for r in ready {
            let Some(plan) = self.live.get_mut(&r.request).and_then(|l| l.plan.take()) else { continue };
            let Some(connector) = self.connector else {
                self.failed.push((r.request, "no KV connector on this node".into()));
                continue;
            };
            let Some(src) = r.block_table.get(plan.skip_blocks..) else {
                self.failed.push((r.request, "the decode node skips more blocks than the prompt has".into()));
                continue;
            };
            let src: Vec<u32> = src.iter().map(|b| b.0).collect();
            match connector.send(&plan.descriptor, src, plan.binding, Some(plan.timeout)) {
                Ok(handle) => self.started.push((r.request, handle)),
                Err(e) => self.failed.push((r.request, format!("starting the KV transfer: {e}"))),
            }
        }
    }

    fn layer_done(&mut self, layer: usize) {
        for (_, handle) in &self.started {
            // Out-of-order pushes cannot happen here; a failed transfer reports itself through wait().
            let _ = handle.push_layer(layer as u32);
        }
    }
}

impl Worker {
    fn new(engine: Engine, connector: Option<Arc<Connector>>) -> Worker {
        Worker { engine, connector, live: HashMap::new(), pending_remote: VecDeque::new() }
    }

    /// Serves commands until every handle is gone; returns the engine (whose memory may still be shared).
    fn run(mut self, rx: std_mpsc::Receiver<Cmd>) -> Engine {
        self.serve(rx);
        self.connector = None;
        self.engine
    }

    fn serve(&mut self, rx: std_mpsc::Receiver<Cmd>) {
        loop {
            // Idle (nothing to step: no request, or every one waits for KV or a release): block for
            // the next command. Busy: apply whatever is queued, then step.
            if !self.engine.has_work() {
                match rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(std_mpsc::TryRecvError::Empty) => break,
                    Err(std_mpsc::TryRecvError::Disconnected) => return,
                }
            }
            if self.engine.has_work() {
                self.step();
            }
            self.allocate_pending();
        }
    }

    /// Gives queued remote allocations their blocks, front first, while they fit.
    fn allocate_pending(&mut self) {
        while let Some(front) = self.pending_remote.front() {
            if front.reply.is_closed() {
                self.pending_remote.pop_front(); // its caller gave up (deadline, client gone)
                continue;
            }
            match self.engine.add_remote_request(front.prompt.clone(), front.params.clone()) {
                Err(EngineError::KvPoolFull { .. }) => return,
                r => {
                    let p = self.pending_remote.pop_front().expect("front exists");
                    self.answer_remote(r, p.events, p.reply);
                }
            }
        }
    }

    fn answer_remote(
        &mut self,
        r: Result<(RequestId, RemoteAlloc), EngineError>,
        events: mpsc::UnboundedSender<Event>,
        reply: Reply<(RequestId, RemoteAlloc)>,
    ) {
        if let Ok((id, _)) = &r {
            self.live.insert(*id, Live { events, plan: None, queued_at: Instant::now() });
        }
        if let Err(Ok((id, _))) = reply.send(r) {
            // The caller went away between the check and the answer: give the blocks back.
            self.engine.abort(id);
            self.live.remove(&id);
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Validate { prompt, params, reply } => {
                let _ = reply.send(self.engine.validate_request(&prompt, &params));
            }
            Cmd::Add { prompt, params, plan, events, reply } => {
                let r = self.engine.add_request(&tandem_engine::engine::Prompt::Tokens(prompt), params);
                if let Ok(id) = &r {
                    self.live.insert(*id, Live { events, plan, queued_at: Instant::now() });
                }
                let _ = reply.send(r);
            }
            Cmd::AddResumed { tokens, generated, params, events, reply } => {
                let r = self.engine.add_resumed_request(tokens, generated, params);
                if let Ok(id) = &r {
                    self.live.insert(*id, Live { events, plan: None, queued_at: Instant::now() });
                }
                let _ = reply.send(r);
            }
            Cmd::AddRemote { prompt, params, events, reply } => {
                // Behind others already waiting for blocks, or when the pool is full now: wait.
                let r = match self.engine.validate_request(&prompt, &params) {
                    Err(e) => Err(e),
                    Ok(()) if !self.pending_remote.is_empty() => Err(EngineError::KvPoolFull { needed: 0, free: 0 }),
                    Ok(()) => self.engine.add_remote_request(prompt.clone(), params.clone()),
                };
                match r {
                    Err(EngineError::KvPoolFull { .. }) => self.pending_remote.push_back(PendingRemote { prompt, params, events, reply }),
                    r => self.answer_remote(r, events, reply),
                }
            }
            Cmd::KvReady { id, first_token, logprob, reply } => match self.engine.kv_ready_with_logprob(id, first_token, logprob) {
                Ok(outputs) => {
                    self.dispatch(outputs);
                    let _ = reply.send(Ok(()));
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Cmd::Abort { id } => {
                self.engine.abort(id);
                self.live.remove(&id);
            }
            Cmd::Release { id } => {
                self.engine.release(id);
                self.live.remove(&id);
            }
            Cmd::Load { reply } => {
                let mut load = self.engine.current_load();
                load.waiting += self.pending_remote.len();
                let _ = reply.send(load);
            }
            Cmd::CachedPrefix { prompt, reply } => {
                let _ = reply.send(self.engine.cached_prefix_len(&prompt));
            }
        }
    }

    fn step(&mut self) {
        let mut obs = Observer { connector: self.connector.as_ref(), live: &mut self.live, started: Vec::new(), failed: Vec::new() };
        let scheduled_at = Instant::now();
        let result = self.engine.step_observed(&mut obs);
        let Observer { mut started, failed, .. } = obs;
        let metrics = crate::metrics::node();
        let mut left_queue = Vec::new();
        for f in self.engine.first_scheduled() {
            if let Some(l) = self.live.get(&f.request) {
                metrics.queue_time.observe_duration(scheduled_at.saturating_duration_since(l.queued_at));
                left_queue.push(f.request);
            }
            metrics.prefix_lookup(f.prompt_tokens, f.cached_tokens);
        }
        for id in left_queue {
            self.send(id, Event::Scheduled, false);
        }
        for (id, why) in failed {
            self.fail(id, why);
        }
        match result {
            Ok(outputs) => {
                for out in outputs {
                    let id = out.request;
                    if out.finish == Some(FinishReason::PrefillDone) {
                        let transfer = started.iter().position(|(r, _)| *r == id).map(|i| started.swap_remove(i).1);
                        self.send(id, Event::PrefillDone { output: out, transfer }, false);
                    } else {
                        let done = out.finish.is_some();
                        self.send(id, Event::Output(out), done);
                    }
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "engine step failed; aborting every request");
                let ids: Vec<RequestId> = self.live.keys().copied().collect();
                for id in ids {
                    self.fail(id, format!("engine step failed: {e}"));
                }
            }
        }
    }

    fn dispatch(&mut self, outputs: Vec<SeqOutput>) {
        for out in outputs {
            let id = out.request;
            let done = out.finish.is_some();
            self.send(id, Event::Output(out), done);
        }
    }

    /// Delivers an event; a request whose handler is gone is aborted.
    fn send(&mut self, id: RequestId, event: Event, finished: bool) {
        let delivered = self.live.get(&id).is_some_and(|l| l.events.send(event).is_ok());
        if !delivered {
            self.engine.abort(id);
            self.live.remove(&id);
        } else if finished {
            self.live.remove(&id);
        }
    }

    fn fail(&mut self, id: RequestId, why: String) {
        self.engine.abort(id);
        if let Some(l) = self.live.remove(&id) {
            let _ = l.events.send(Event::Failed(why));
        }
    }
}
