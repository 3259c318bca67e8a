//! A control socket's reading half that polls for a while before it sleeps.
//!
//! A device transport's data moves at hundreds of GB/s, so the few control messages that start it
//! are latency-bound: a reader task that parked in the runtime's I/O driver takes tens of
//! microseconds (more from a deep CPU idle state; ~50–90 µs measured on an H100 host) to be woken
//! when bytes arrive — the length of a 16 MiB copy over NVLink. [`SpinRead`] reads the socket
//! itself, without waiting, for a while after the last bytes it got (`TANDEM_KV_SPIN_US`, default
//! [`DEFAULT_SPIN`]; 0 turns it off), and only then sleeps. While a
//! link is busy its reader thus keeps one core polling, as NCCL's proxy threads do; an idle link
//! costs nothing. A polling reader runs on a thread of its own ([`spawn_reader`]), never on a
//! runtime worker, and only where the runtime is multi-threaded; after its polling window it
//! sleeps in poll(2) (one wake-up, of that thread, when bytes come; the runtime's readiness would
//! wake a worker first, which then wakes the thread: ~150 µs measured after an idle moment), in
//! steps of [`BLOCK_STEP`] so the reader notices a close. A reader that does not poll waits on the
//! runtime's readiness.
//!
//! A transfer's first message comes when its sender is ready, often after a quiet spell longer
//! than the window; a reader asleep then takes 30–300 µs to wake (measured on an H200 host:
//! a message is seen 7.5 µs after its write by a polling reader, 39 µs at the median and 226 µs
//! at p90 by one asleep in poll(2)). So a transport's receiving readers share an [`Alert`]: when
//! the connector expects a transfer ([`crate::transport::Transport::expecting`]) it arms them, and
//! each polls for a window from then — woken through its own eventfd if it slept.

use std::io::Read;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, ReadBuf};

/// The name of the threads [`spawn_reader`] starts.
const THREAD: &str = "tandem-kv-ctl";

/// How long a reader polls after the last bytes it got, unless `TANDEM_KV_SPIN_US` says otherwise.
pub(crate) const DEFAULT_SPIN: Duration = Duration::from_millis(5);

/// The polling window of this process's device transports' control readers.
pub(crate) fn spin_window() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        std::env::var("TANDEM_KV_SPIN_US").ok().and_then(|v| v.parse().ok()).map_or(DEFAULT_SPIN, Duration::from_micros)
    })
}

/// Runs a link's control reader, `make(window)`: the receiving side's on a thread of its own that
/// drives it with the runtime's handle and polls for [`spin_window`] (multi-thread runtimes only),
/// so the polling never holds up a runtime worker (a worker that polled would keep the tasks it
/// woke from running for up to the window: measured, ~5 ms more time to first token through a
/// cluster); others as a task that does not poll.
pub(crate) fn spawn_reader<F, M>(receiving: bool, make: M)
where
    F: std::future::Future<Output = ()> + Send + 'static,
    M: FnOnce(Duration) -> F + Send + 'static,
{
    let handle = tokio::runtime::Handle::current();
    let spin = spin_window();
    if !receiving || spin.is_zero() || handle.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
        tokio::spawn(make(Duration::ZERO));
        return;
    }
    let (tx, rx) = std::sync::mpsc::sync_channel::<M>(1);
    let spawned = std::thread::Builder::new().name(THREAD.into()).spawn(move || {
        if let Ok(make) = rx.recv() {
            handle.block_on(make(spin));
        }
    });
    match spawned {
        // (The thread holds the receiver until it took `make`: the send cannot fail.)
        Ok(_) => {
            let _ = tx.send(make);
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot start a KV control thread; the reader runs as a task, without polling");
            tokio::spawn(make(Duration::ZERO));
        }
    }
}

/// Nanoseconds since a process-wide origin (comparable across threads).
fn now_ns() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// What a transport's receiving readers share: a polling window that [`Alert::arm`] opens for all
/// of them at once (see the module doc).
#[derive(Default)]
pub(crate) struct Alert {
    /// End of the armed window ([`now_ns`]), 0 if never armed.
    until: AtomicU64,
    /// Each reader's eventfd, written to wake it from poll(2).
    bells: Mutex<Vec<Weak<OwnedFd>>>,
}

impl Alert {
    /// Makes every reader of this alert poll for `window` from now, waking those asleep.
    pub(crate) fn arm(&self, window: Duration) {
        let until = now_ns() + window.as_nanos() as u64;
        let before = self.until.fetch_max(until, Ordering::AcqRel);
        // (Readers already polling through most of the window need no wake-up.)
        if before >= until.saturating_sub(window.as_nanos() as u64 / 2) {
            return;
        }
        let mut bells = crate::core::lock(&self.bells);
        bells.retain(|b| match b.upgrade() {
            Some(fd) => {
                let one: u64 = 1;
                // SAFETY: an eventfd of a live reader; eight bytes from a valid u64.
                let _ = unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
                true
            }
            None => false,
        });
    }

    /// A new reader's bell (its eventfd), registered for wake-ups.
    fn bell(&self) -> std::io::Result<Arc<OwnedFd>> {
        // SAFETY: plain syscall; the descriptor is owned by the returned value.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let bell = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        crate::core::lock(&self.bells).push(Arc::downgrade(&bell));
        Ok(bell)
    }

    fn until(&self) -> u64 {
        self.until.load(Ordering::Acquire)
    }
}

/// `inner` (a socket's reading half, nonblocking): with a polling window
/// (only [`spawn_reader`]'s threads get one), read without waiting for that long after each read
/// that got bytes, then sleep in poll(2), never in the runtime; without, `inner` as it is. See the
/// module doc.
pub(crate) struct SpinRead<R> {
    inner: R,
    fd: RawFd,
    spin: Duration,
    /// With a window: fail with `TimedOut` once no bytes came for this long.
    idle: Option<Duration>,
    last: Instant,
    /// The transport's alert and this reader's bell (see [`SpinRead::alerted_by`]).
    alert: Option<(Arc<Alert>, Arc<OwnedFd>)>,
}

/// One poll(2) sleep: how soon a reader that sleeps so notices that its link was closed.
const BLOCK_STEP: Duration = Duration::from_millis(20);

impl<R> SpinRead<R> {
    /// `inner` reads the socket `S` it refers to (whose descriptor lives as long as `inner`);
    /// `spin` is the window [`spawn_reader`] passed its reader (zero elsewhere).
    pub(crate) fn new<S: AsRawFd>(inner: R, spin: Duration) -> SpinRead<R>
    where
        R: AsRef<S>,
    {
        let fd = inner.as_ref().as_raw_fd();
        SpinRead { inner, fd, spin, idle: None, last: Instant::now(), alert: None }
    }

    /// On a thread of [`spawn_reader`]'s, also polls through every window `alert` opens (woken
    /// from poll(2) for it); elsewhere, or without an eventfd, this does nothing.
    pub(crate) fn alerted_by(mut self, alert: &Arc<Alert>) -> SpinRead<R> {
        if self.on_own_thread()
            && let Ok(bell) = alert.bell()
        {
            self.alert = Some((Arc::clone(alert), bell));
        }
        self
    }

    /// On a thread of [`spawn_reader`]'s (which must not use the runtime's timers: they fail once
    /// the runtime shuts down), reads fail with `TimedOut` once no bytes came for `idle`; elsewhere
    /// this does nothing (time the reads out with the runtime's timers there): see
    /// [`Self::on_own_thread`].
    pub(crate) fn idle_after(mut self, idle: Option<Duration>) -> SpinRead<R> {
        self.idle = idle.filter(|_| self.on_own_thread());
        self
    }

    /// Whether this reader runs on a thread of [`spawn_reader`]'s (it polls, sleeps in poll(2),
    /// and times itself out).
    pub(crate) fn on_own_thread(&self) -> bool {
        !self.spin.is_zero()
    }

    /// One read(2) of the descriptor into `buf` (nonblocking: the runtime set O_NONBLOCK).
    fn read_now(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        // SAFETY: `fd` is the descriptor of `inner`'s socket (taken in `new`), open as long as
        // `inner` is, borrowed for one read; the
        // `ManuallyDrop` never closes it.
        let mut file = ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(self.fd) });
        file.read(buf)
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for SpinRead<R> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if !this.on_own_thread() {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let until = this.last + this.spin;
        loop {
            match this.read_now(buf.initialize_unfilled()) {
                Ok(n) => {
                    // n == 0 is the end of the stream, which an empty read reports.
                    buf.advance(n);
                    this.last = Instant::now();
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= until && this.alert.as_ref().is_none_or(|(a, _)| now_ns() >= a.until()) {
                        break;
                    }
                    std::hint::spin_loop();
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        if let Some(idle) = this.idle.filter(|&d| this.last.elapsed() >= d) {
            return Poll::Ready(Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("idle for {idle:?}"))));
        }
        // Sleep in poll(2) on the socket (and the bell), so the kernel wakes this thread directly
        // (the runtime's readiness would wake a worker first, which then wakes us).
        let bell = this.alert.as_ref().map_or(-1, |(_, b)| b.as_raw_fd());
        let mut fds = [
            libc::pollfd { fd: this.fd, events: libc::POLLIN, revents: 0 },
            // (A negative descriptor is ignored.)
            libc::pollfd { fd: bell, events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: `fds` are two valid pollfds for the call; `fd` is `inner`'s open descriptor and
        // `bell` this reader's eventfd (or -1).
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, BLOCK_STEP.as_millis() as libc::c_int) };
        if ready > 0 && fds[1].revents != 0 {
            // Rung: empty the bell and poll through the armed window.
            let mut v = 0u64;
            // SAFETY: the bell is open (held in `alert`); eight bytes into a valid u64.
            let _ = unsafe { libc::read(bell, (&mut v as *mut u64).cast(), 8) };
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if ready < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Poll::Ready(Err(e));
            }
        } else if ready > 0 {
            // Readable, closed or in error: the read says which.
            match this.read_now(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    this.last = Instant::now();
                    return Poll::Ready(Ok(()));
                }
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        // Nothing within a step: let the caller look at whatever else it waits for (a close), and
        // come back.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_without_a_window_reads_through_the_runtime() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (rd, _wr) = a.into_split();
        let mut r = SpinRead::new(rd, Duration::ZERO).idle_after(Some(Duration::from_millis(1)));
        assert!(!r.on_own_thread());
        let (_brd, mut bwr) = b.into_split();
        let writer = tokio::spawn(async move {
            bwr.write_all(b"hello").await.unwrap();
            // The reader sleeps on the runtime and is woken (and never times itself out).
            tokio::time::sleep(Duration::from_millis(60)).await;
            bwr.write_all(b" world").await.unwrap();
            drop(bwr);
        });
        let mut got = Vec::new();
        r.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"hello world");
        writer.await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_receiving_reader_polls_on_a_thread_of_its_own_and_a_sending_one_does_not() {
        for receiving in [true, false] {
            let (tx, rx) = tokio::sync::oneshot::channel();
            spawn_reader(receiving, move |spin| async move {
                let _ = tx.send((spin, std::thread::current().name().map(str::to_string)));
            });
            let (spin, thread) = rx.await.unwrap();
            if receiving {
                assert_eq!((spin, thread.as_deref()), (spin_window(), Some("tandem-kv-ctl")));
            } else {
                assert!(spin.is_zero());
                assert_ne!(thread.as_deref(), Some("tandem-kv-ctl"));
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_on_its_own_thread_reads_while_polling_sleeping_in_poll_and_after() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (rd, _wr) = a.into_split();
        let (_brd, mut bwr) = b.into_split();
        let (tx, rx) = tokio::sync::oneshot::channel();
        spawn_reader(true, move |spin| async move {
            let mut r = SpinRead::new(rd, spin);
            assert!(r.on_own_thread(), "spawn_reader's thread polls and sleeps in poll(2)");
            let mut got = Vec::new();
            let _ = tx.send(r.read_to_end(&mut got).await.map(|_| got));
        });
        bwr.write_all(b"a").await.unwrap();
        // Past the polling window, inside the poll(2) one; then past both.
        tokio::time::sleep(DEFAULT_SPIN + Duration::from_millis(30)).await;
        bwr.write_all(b"b").await.unwrap();
        tokio::time::sleep(DEFAULT_SPIN + 10 * BLOCK_STEP).await;
        bwr.write_all(b"c").await.unwrap();
        drop(bwr);
        assert_eq!(rx.await.unwrap().unwrap(), b"abc");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_on_its_own_thread_times_itself_out_when_idle() {
        let (a, _b) = tokio::net::UnixStream::pair().unwrap();
        let (rd, _wr) = a.into_split();
        let (tx, rx) = tokio::sync::oneshot::channel();
        spawn_reader(true, move |spin| async move {
            let mut r = SpinRead::new(rd, spin).idle_after(Some(Duration::from_millis(50)));
            let mut byte = [0u8; 1];
            let _ = tx.send(r.read(&mut byte).await.map_err(|e| e.kind()));
        });
        assert_eq!(rx.await.unwrap(), Err(std::io::ErrorKind::TimedOut));
    }

    #[test]
    fn arming_rings_every_live_readers_bell_once_per_window_and_forgets_dropped_ones() {
        let alert = Alert::default();
        let (a, b) = (alert.bell().unwrap(), alert.bell().unwrap());
        let rung = |fd: &OwnedFd| {
            let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd; no wait.
            let ready = unsafe { libc::poll(&mut p, 1, 0) } == 1;
            let mut v = 0u64;
            // SAFETY: the eventfd is open; eight bytes into a valid u64 (empties it).
            let _ = unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
            ready
        };
        assert!(!rung(&a) && !rung(&b));
        alert.arm(Duration::from_secs(60));
        assert!(rung(&a) && rung(&b));
        assert!(alert.until() > now_ns());
        // Armed already for most of the window: no second wake-up.
        alert.arm(Duration::from_secs(60));
        assert!(!rung(&a));
        drop(b);
        alert.arm(Duration::from_secs(600));
        assert!(rung(&a));
        assert_eq!(crate::core::lock(&alert.bells).len(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_alerted_reader_woken_from_poll_reads_what_comes_then_and_after() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (rd, _wr) = a.into_split();
        let (_brd, mut bwr) = b.into_split();
        let alert = Arc::new(Alert::default());
        let (tx, rx) = tokio::sync::oneshot::channel();
        let theirs = Arc::clone(&alert);
        spawn_reader(true, move |spin| async move {
            let mut r = SpinRead::new(rd, spin).alerted_by(&theirs);
            assert!(r.alert.is_some(), "a reader on its own thread takes a bell");
            let mut got = Vec::new();
            let _ = tx.send(r.read_to_end(&mut got).await.map(|_| got));
        });
        bwr.write_all(b"a").await.unwrap();
        // Asleep in poll(2) past its window; rung, it polls through the armed one.
        tokio::time::sleep(DEFAULT_SPIN + Duration::from_millis(30)).await;
        alert.arm(Duration::from_millis(50));
        tokio::time::sleep(Duration::from_millis(5)).await;
        bwr.write_all(b"b").await.unwrap();
        tokio::time::sleep(DEFAULT_SPIN + 3 * BLOCK_STEP).await;
        bwr.write_all(b"c").await.unwrap();
        drop(bwr);
        assert_eq!(rx.await.unwrap().unwrap(), b"abc");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn does_not_poll_on_a_single_threaded_runtime() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        spawn_reader(true, move |spin| async move {
            let _ = tx.send((spin, std::thread::current().name().map(str::to_string)));
        });
        let (spin, thread) = rx.await.unwrap();
        assert!(spin.is_zero());
        assert_ne!(thread.as_deref(), Some(THREAD));
    }
}
