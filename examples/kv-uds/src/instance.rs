//! One plugin instance: a listening Unix socket, its accept thread, and the links with their readers.
//!
//! Invariants:
//!  - Link ids come from a counter starting at 1 and are never reused; the `links` map holds exactly
//!    the links that are open as far as the host is concerned.
//!  - Whoever removes a link from the map decides how it ends: `close_link` (host closed it, no
//!    callback) or the link's reader (it failed, `on_link_closed` once, if the host knows the link).
//!  - No lock is held while a host callback runs, so callbacks may call back into the instance.
//!  - Every reader thread is registered under the state lock before `destroy` can take the list, and
//!    none is spawned once stopping is set; `destroy` joins them all (except the calling thread when a
//!    host callback calls `destroy` itself), so no callback runs after `destroy` returns.
//!  - One message is written per link at a time (the link's write lock), so messages never interleave.

use std::collections::HashMap;
use std::ffi::CString;
use std::io::{self, IoSlice};
use std::net::Shutdown;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::abi::TandemKvIov;
use crate::config::Config;
use crate::error::Failure;
use crate::host::{Host, MAX_IOVS};
use crate::wire::{self, MAX_HEADER, Prefix};
use crate::{payload, reader};

/// Endpoint strings start with this.
pub(crate) const ENDPOINT_SCHEME: &[u8] = b"uds:";

/// Makes socket names unique within the process (the pid makes them unique across processes).
static SOCKET_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Locks a mutex, ignoring poisoning: our critical sections leave the data consistent at every step.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One open connection to another instance.
#[derive(Debug)]
pub(crate) struct Link {
    /// The id the host knows it by.
    pub(crate) id: u64,
    /// The socket; read by the link's reader, written under `write_lock`, shut down by anyone.
    pub(crate) stream: UnixStream,
    write_lock: Mutex<()>,
    /// Whether the host knows this link: it opened it, or saw a message on it.
    announced: AtomicBool,
    /// Why a local send broke the link, if one did (reported instead of "peer closed").
    fault: OnceLock<String>,
}

impl Link {
    fn new(id: u64, stream: UnixStream, announced: bool) -> Link {
        Link {
            id,
            stream,
            write_lock: Mutex::new(()),
            announced: AtomicBool::new(announced),
            fault: OnceLock::new(),
        }
    }

    /// Marks the link as known to the host (called before its first `on_message`).
    pub(crate) fn announce(&self) {
        self.announced.store(true, Ordering::Release);
    }

    /// Whether the host knows this link.
    pub(crate) fn announced(&self) -> bool {
        self.announced.load(Ordering::Acquire)
    }

    /// Why a local send broke the link, if one did.
    pub(crate) fn fault(&self) -> Option<&str> {
        self.fault.get().map(String::as_str)
    }

    /// Shuts the socket down both ways: blocked reads see end of stream, blocked writes fail.
    pub(crate) fn shutdown(&self) {
        // An error means the socket is already disconnected, which is what we want.
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

#[derive(Debug, Default)]
struct State {
    links: HashMap<u64, Arc<Link>>,
    /// The id the next link gets; ids below it were issued.
    next_link: u64,
    readers: Vec<JoinHandle<()>>,
}

/// What the instance's threads share.
#[derive(Debug)]
pub(crate) struct Shared {
    host: Host,
    state: Mutex<State>,
    /// Set once by `destroy` (under the state lock); no callback starts and no link is added after it.
    stopping: AtomicBool,
}

impl Shared {
    /// The host's callbacks.
    pub(crate) fn host(&self) -> &Host {
        &self.host
    }

    /// Whether host callbacks may still be made (false once `destroy` began).
    pub(crate) fn callbacks_allowed(&self) -> bool {
        !self.stopping.load(Ordering::Acquire)
    }

    /// Registers a new link and starts its reader. `announced`: the host opened it (connect).
    fn add_link(self: &Arc<Self>, stream: UnixStream, announced: bool) -> Result<u64, Failure> {
        let mut state = lock(&self.state);
        if self.stopping.load(Ordering::Acquire) {
            return Err(Failure::closed("the instance is being destroyed"));
        }
        let id = state.next_link;
        let link = Arc::new(Link::new(id, stream, announced));
        let reader = {
            let (shared, link) = (Arc::clone(self), Arc::clone(&link));
            thread::Builder::new()
                .name(format!("kv-uds-link-{id}"))
                .spawn(move || reader::run(&shared, &link))
                .map_err(|e| Failure::internal(format!("cannot start a reader thread: {e}")))?
        };
        state.next_link += 1;
        state.links.insert(id, link);
        // Reap readers of links that ended, so the list does not grow with the instance's age.
        let (done, running): (Vec<_>, Vec<_>) =
            state.readers.drain(..).partition(JoinHandle::is_finished);
        state.readers = running;
        state.readers.push(reader);
        drop(state);
        for handle in done {
            let _ = handle.join();
        }
        Ok(id)
    }

    /// The open link `id`; INVALID for an id never issued, CLOSED for one that was closed.
    fn link(&self, id: u64) -> Result<Arc<Link>, Failure> {
        let state = lock(&self.state);
        if let Some(link) = state.links.get(&id) {
            return Ok(Arc::clone(link));
        }
        if self.stopping.load(Ordering::Acquire) {
            Err(Failure::closed("the instance is being destroyed"))
        } else if id != 0 && id < state.next_link {
            Err(Failure::closed(format!("link {id} is closed")))
        } else {
            Err(Failure::invalid(format!("unknown link {id}")))
        }
    }

    /// Whether `id` is still open.
    fn is_open(&self, id: u64) -> bool {
        lock(&self.state).links.contains_key(&id)
    }

    /// Called by a link's reader when it ends: forgets the link and, unless the host closed it (it is no
    /// longer in the map) or never heard of it, tells the host once.
    pub(crate) fn link_ended(&self, link: &Link, status: std::ffi::c_int, reason: &str) {
        let removed = lock(&self.state).links.remove(&link.id).is_some();
        if removed && link.announced() && self.callbacks_allowed() {
            self.host.link_closed(link.id, status, reason);
        }
    }

    /// Begins `destroy`: sets stopping, then hands back every link and reader thread.
    fn stop(&self) -> (Vec<Arc<Link>>, Vec<JoinHandle<()>>) {
        let mut state = lock(&self.state);
        self.stopping.store(true, Ordering::Release);
        (
            state.links.drain().map(|(_, link)| link).collect(),
            std::mem::take(&mut state.readers),
        )
    }
}

/// Removes the socket file when dropped.
#[derive(Debug)]
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A live instance; `*mut tandem_kv_instance` points to one of these.
#[derive(Debug)]
pub(crate) struct Instance {
    shared: Arc<Shared>,
    endpoint: CString,
    /// A second handle on the listening socket, used only to shut it down (wakes the accept thread).
    listener_control: UnixStream,
    accept_thread: Option<JoinHandle<()>>,
    /// Declared last: removed after the threads are gone.
    socket: SocketFile,
}

impl Instance {
    /// Parses the config, binds the listening socket and starts accepting.
    pub(crate) fn create(config: &[u8], host: Host) -> Result<Instance, Failure> {
        let config = Config::parse(config)?;
        let (listener, socket) = bind_unique(&config.dir)?;
        let endpoint = CString::new([ENDPOINT_SCHEME, socket.0.as_os_str().as_bytes()].concat())
            .map_err(|_| Failure::internal("socket path contains a NUL byte"))?;
        // Shutting down a listening socket wakes a blocked accept (Linux). std has no shutdown for a
        // listener, so shut down a duplicate of its descriptor through the stream type, which applies
        // the same shutdown(2) to the same socket.
        let listener_control = listener
            .try_clone()
            .map(|clone| UnixStream::from(OwnedFd::from(clone)))
            .map_err(|e| {
                Failure::internal(format!("cannot duplicate the listening socket: {e}"))
            })?;
        let shared = Arc::new(Shared {
            host,
            state: Mutex::new(State {
                next_link: 1,
                ..State::default()
            }),
            stopping: AtomicBool::new(false),
        });
        let accept_thread = {
            let shared = Arc::clone(&shared);
            thread::Builder::new()
                .name("kv-uds-accept".into())
                .spawn(move || accept_loop(&shared, &listener))
                .map_err(|e| Failure::internal(format!("cannot start the accept thread: {e}")))?
        };
        Ok(Instance {
            shared,
            endpoint,
            listener_control,
            accept_thread: Some(accept_thread),
            socket,
        })
    }

    /// `uds:<socket path>`, stable for the instance's lifetime.
    pub(crate) fn endpoint(&self) -> &CString {
        &self.endpoint
    }

    /// Opens a link to another instance's endpoint.
    pub(crate) fn connect(&self, endpoint: &[u8]) -> Result<u64, Failure> {
        let path = parse_endpoint(endpoint)?;
        let stream = UnixStream::connect(path).map_err(|e| {
            Failure::unreachable(format!("cannot connect to {}: {e}", path.display()))
        })?;
        self.shared.add_link(stream, true)
    }

    /// Sends one message; blocks until every byte is in the socket (backpressure).
    pub(crate) fn send(&self, id: u64, header: &[u8], iovs: &[TandemKvIov]) -> Result<(), Failure> {
        if header.len() > MAX_HEADER {
            return Err(Failure::invalid(format!(
                "header_len {} exceeds TANDEM_KV_MAX_HEADER",
                header.len()
            )));
        }
        if iovs.len() > MAX_IOVS {
            return Err(Failure::invalid(format!(
                "n_iovs {} exceeds TANDEM_KV_MAX_IOVS",
                iovs.len()
            )));
        }
        // SAFETY: the header's `send` contract: the payload memory is readable and not reused until
        // `send` returns, and the slices do not outlive this call.
        let (payload, payload_len) = unsafe { payload::gather(iovs) }?;
        let link = self.shared.link(id)?;
        let header_len =
            u32::try_from(header.len()).map_err(|_| Failure::invalid("header too long"))?;
        let prefix = Prefix {
            header_len,
            payload_len,
        }
        .encode();
        let mut bufs = Vec::with_capacity(payload.len() + 2);
        bufs.push(IoSlice::new(&prefix));
        bufs.push(IoSlice::new(header));
        bufs.extend(payload);

        let written = {
            let _writing = lock(&link.write_lock);
            wire::write_all_vectored(&link.stream, &mut bufs)
        };
        written.map_err(|e| self.send_failed(&link, &e))
    }

    /// A write failed part-way: the stream is no longer at a message boundary, so the link is done.
    fn send_failed(&self, link: &Link, error: &io::Error) -> Failure {
        if !self.shared.is_open(link.id) {
            return Failure::closed(format!("link {} was closed while sending", link.id));
        }
        let message = format!("send on link {} failed: {error}", link.id);
        let _ = link.fault.set(message.clone());
        link.shutdown(); // its reader now ends the link and reports it
        Failure::io(message)
    }

    /// Closes a link the host no longer wants; no `on_link_closed` follows. Unknown ids are ignored.
    pub(crate) fn close_link(&self, id: u64) {
        let link = lock(&self.shared.state).links.remove(&id);
        if let Some(link) = link {
            link.shutdown();
        }
    }

    /// Closes every link, stops and joins every thread, removes the socket file.
    pub(crate) fn destroy(mut self) {
        let (links, readers) = self.shared.stop();
        for link in &links {
            link.shutdown();
        }
        let _ = self.listener_control.shutdown(Shutdown::Both);
        // Where shutting down a listener does not wake accept, a connection does; it is refused where
        // it did. Either way the accept thread sees `stopping` and returns.
        let _ = UnixStream::connect(&self.socket.0);
        if let Some(accept) = self.accept_thread.take() {
            let _ = accept.join();
        }
        let me = thread::current().id();
        for reader in readers {
            // A host callback may call destroy on a reader thread: that thread cannot join itself; it
            // makes no further callback (stopping is set) and ends when the callback returns.
            if reader.thread().id() != me {
                let _ = reader.join();
            }
        }
        // `self` drops here: the socket file is removed.
    }
}

/// Binds a listening socket at a fresh `tandem-kv-uds-<pid>-<n>.sock` in `dir`.
fn bind_unique(dir: &Path) -> Result<(UnixListener, SocketFile), Failure> {
    for _ in 0..64 {
        let n = SOCKET_COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("tandem-kv-uds-{}-{n}.sock", std::process::id()));
        match UnixListener::bind(&path) {
            Ok(listener) => return Ok((listener, SocketFile(path))),
            // A stale file of an earlier process with our pid: take the next name.
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {}
            Err(e) => {
                return Err(Failure::invalid(format!(
                    "cannot listen at {}: {e}",
                    path.display()
                )));
            }
        }
    }
    Err(Failure::internal(format!(
        "no free socket name in {}",
        dir.display()
    )))
}

/// `uds:<path>` to the path; anything else is UNREACHABLE (an endpoint we cannot know).
fn parse_endpoint(endpoint: &[u8]) -> Result<&Path, Failure> {
    match endpoint.strip_prefix(ENDPOINT_SCHEME) {
        Some(path) if !path.is_empty() => Ok(Path::new(std::ffi::OsStr::from_bytes(path))),
        _ => Err(Failure::unreachable(format!(
            "malformed endpoint `{}` (expected uds:<socket path>)",
            String::from_utf8_lossy(endpoint)
        ))),
    }
}

/// Accepts links until `destroy` sets stopping.
fn accept_loop(shared: &Arc<Shared>, listener: &UnixListener) {
    loop {
        let accepted = listener.accept();
        if !shared.callbacks_allowed() {
            return;
        }
        match accepted {
            // Fails only while stopping or when no thread can be started; the stream is dropped
            // (closed) and the peer sees its link end.
            Ok((stream, _)) => drop(shared.add_link(stream, false)),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // Out of descriptors and the like: wait instead of spinning, then try again.
            Err(_) => thread::sleep(Duration::from_millis(10)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi;

    #[test]
    fn endpoints_parse_or_are_unreachable() {
        assert_eq!(
            parse_endpoint(b"uds:/tmp/a.sock").unwrap(),
            Path::new("/tmp/a.sock")
        );
        for bad in [
            &b""[..],
            b"uds:",
            b"tcp:1.2.3.4:5",
            b"/tmp/a.sock",
            b"UDS:/x",
        ] {
            let failure = parse_endpoint(bad).unwrap_err();
            assert_eq!(failure.status(), abi::TANDEM_KV_ERR_UNREACHABLE);
            assert!(failure.message().contains("malformed"));
        }
    }

    #[test]
    fn bind_unique_gives_fresh_names_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let (_a, file_a) = bind_unique(dir.path()).unwrap();
        let (_b, file_b) = bind_unique(dir.path()).unwrap();
        assert_ne!(file_a.0, file_b.0);
        assert!(file_a.0.exists());
        let path = file_a.0.clone();
        drop(file_a);
        assert!(!path.exists());
        let missing = bind_unique(&dir.path().join("missing")).unwrap_err();
        assert_eq!(missing.status(), abi::TANDEM_KV_ERR_INVALID);
    }
}
