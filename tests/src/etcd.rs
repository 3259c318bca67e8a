//! A real etcd server for tests: the Debian `etcd` binary (package etcd-server) on free loopback
//! ports with its own temporary data directory.
//!
//! Invariants:
//! - No orphan processes, ever. etcd runs under a small `sh` guard that holds the read end of a
//!   pipe whose write end only this process has: when the pipe closes (on [`EtcdServer::stop`],
//!   on drop, or when the test process dies in any way, even SIGKILL) the guard kills etcd.
//! - [`EtcdServer::start`] and [`EtcdServer::start_again`] return only once etcd answers
//!   `/health` (bounded; a server that does not come up is a panic with its log).
//! - A missing binary is a panic that says to run `scripts/test.sh`, never a silent skip.
//! - Restarts reuse the same ports, so endpoints handed out earlier stay valid.
//!
//! Starting and stopping block the calling thread (for up to 20 s); from an async test, call
//! them inside `tokio::task::block_in_place` on a multi-threaded runtime.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// The etcd binary the Debian package installs.
const ETCD_BIN: &str = "/usr/bin/etcd";
/// How long etcd may take to answer `/health` after a start.
const START_LIMIT: Duration = Duration::from_secs(20);
/// How long a stopped etcd may take to exit.
const STOP_LIMIT: Duration = Duration::from_secs(10);

/// Runs etcd (`$0 "$@"`) in the background with the guard described in the module docs, and
/// exits with etcd's status. fd 3 keeps our stdin (the pipe) for the guard; background jobs of a
/// non-interactive shell get /dev/null as stdin, hence the explicit `<&3`.
const GUARD: &str = r#"exec 3<&0
"$0" "$@" </dev/null 3<&- &
etcd=$!
{ read -r _ <&3; kill -9 "$etcd" 2>/dev/null; } &
guard=$!
exec 3<&-
wait "$etcd"
status=$?
kill "$guard" 2>/dev/null
exit "$status""#;

/// What [`EtcdServer::start_again`] and [`EtcdServer::restart`] do with the data directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataDir {
    /// Keep it: etcd comes back with its keys and leases.
    Keep,
    /// Empty it first: etcd comes back as a brand-new cluster.
    Wipe,
}

/// The TLS of an etcd started with [`EtcdServer::start_tls`]: clients are served over https with
/// `cert`/`key` and must present a certificate of `ca` (`--client-cert-auth`).
#[derive(Debug, Clone)]
pub struct EtcdTlsFiles {
    /// The CA client certificates must chain to.
    pub ca: PathBuf,
    /// etcd's server certificate.
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
}

/// A running (or stopped) etcd server; killed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    client_port: u16,
    peer_port: u16,
    /// Where `/health` and `/metrics` are served over plain HTTP: the client port, or with TLS a
    /// metrics port of its own.
    health_port: u16,
    tls: Option<EtcdTlsFiles>,
    dir: tempfile::TempDir,
    process: Option<Running>,
}

#[derive(Debug)]
struct Running {
    guard: Child,
    /// Closing this makes the guard kill etcd.
    lifeline: ChildStdin,
}

impl EtcdServer {
    /// Starts etcd on free random loopback ports and waits until it answers.
    ///
    /// Panics if `/usr/bin/etcd` is missing (run `scripts/test.sh`, which installs etcd-server)
    /// or if etcd does not come up within 20 s.
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// [`EtcdServer::start`] serving clients over TLS only, with client certificates required
    /// (`--client-cert-auth`); `/health` and `/metrics` stay plain HTTP on a port of their own.
    pub fn start_tls(tls: EtcdTlsFiles) -> Self {
        Self::start_with(Some(tls))
    }

    fn start_with(tls: Option<EtcdTlsFiles>) -> Self {
        assert!(
            Path::new(ETCD_BIN).is_file(),
            "{ETCD_BIN} is missing: run scripts/test.sh, which installs the etcd-server package \
             (or `apt-get install etcd-server`)"
        );
        let mut last_log = String::new();
        // A port picked here can be taken by someone else before etcd binds it: try a few pairs.
        for _ in 0..3 {
            let client_port = free_port();
            let mut server = Self {
                client_port,
                peer_port: free_port(),
                health_port: if tls.is_some() { free_port() } else { client_port },
                tls: tls.clone(),
                dir: tempfile::Builder::new().prefix("tandem-etcd-").tempdir().expect("temp dir for etcd"),
                process: None,
            };
            match server.spawn_and_wait() {
                Ok(()) => return server,
                Err(log) if log.contains("address already in use") => last_log = log,
                Err(log) => panic!("etcd did not start:\n{log}"),
            }
        }
        panic!("etcd could not bind free ports:\n{last_log}");
    }

    /// The client URL, `http://127.0.0.1:PORT` (`https://` with TLS).
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// Whether etcd is running (not stopped).
    pub fn is_running(&self) -> bool {
        self.process.is_some()
    }

    /// Kills etcd (SIGKILL, like a crash) and waits for it to exit. No-op when stopped.
    pub fn stop(&mut self) {
        let Some(Running { mut guard, lifeline }) = self.process.take() else { return };
        drop(lifeline);
        let deadline = Instant::now() + STOP_LIMIT;
        loop {
            match guard.try_wait() {
                Ok(Some(_)) => return,
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                _ => {
                    // The guard did not exit: kill it; its `read` side has already seen EOF.
                    let _ = guard.kill();
                    let _ = guard.wait();
                    return;
                }
            }
        }
    }

    /// Starts a stopped etcd again on the same ports, keeping or wiping its data, and waits until
    /// it answers. Panics if it is running or does not come up.
    pub fn start_again(&mut self, data: DataDir) {
        assert!(self.process.is_none(), "etcd is already running");
        if data == DataDir::Wipe {
            let data_dir = self.data_dir();
            if data_dir.exists() {
                std::fs::remove_dir_all(&data_dir).expect("wipe etcd data dir");
            }
        }
        if let Err(log) = self.spawn_and_wait() {
            panic!("etcd did not start again:\n{log}");
        }
    }

    /// [`stop`](Self::stop) then [`start_again`](Self::start_again).
    pub fn restart(&mut self, data: DataDir) {
        self.stop();
        self.start_again(data);
    }

    /// The value of a Prometheus gauge or counter on etcd's `/metrics` (summed over its label
    /// sets), e.g. `etcd_debugging_mvcc_watcher_total`; `None` when etcd is stopped or does not
    /// export it.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let body = http_get(self.health_port, "/metrics")?;
        let values: Vec<f64> = body
            .lines()
            .filter(|line| line.strip_prefix(name).is_some_and(|rest| rest.starts_with([' ', '{'])))
            .filter_map(|line| line.rsplit(' ').next()?.parse().ok())
            .collect();
        (!values.is_empty()).then(|| values.iter().sum())
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    /// Spawns etcd under the guard and waits for `/health`; on failure stops it and returns the
    /// log.
    fn spawn_and_wait(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log_path()).expect("etcd log file");
        let client_url = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new("/bin/sh");
        command
            .arg("-c")
            .arg(GUARD)
            .arg(ETCD_BIN)
            .args(["--name", "tandem-test"])
            .arg("--data-dir")
            .arg(self.data_dir())
            .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("tandem-test={peer_url}"), "--initial-cluster-state", "new"])
            .args(["--logger", "zap", "--log-outputs", "stderr", "--log-level", "error"]);
        if let Some(tls) = &self.tls {
            command
                .arg("--cert-file")
                .arg(&tls.cert)
                .arg("--key-file")
                .arg(&tls.key)
                .arg("--trusted-ca-file")
                .arg(&tls.ca)
                .arg("--client-cert-auth")
                .args(["--listen-metrics-urls", &format!("http://127.0.0.1:{}", self.health_port)]);
        }
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(log);
        // The environment must not reconfigure this etcd.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("ETCD") {
                command.env_remove(name);
            }
        }
        let mut guard = command.spawn().expect("spawn /bin/sh to run etcd");
        let lifeline = guard.stdin.take().expect("piped stdin");
        self.process = Some(Running { guard, lifeline });

        let deadline = Instant::now() + START_LIMIT;
        loop {
            if healthy(self.health_port) {
                return Ok(());
            }
            let exited = self.process.as_mut().is_some_and(|p| matches!(p.guard.try_wait(), Ok(Some(_))));
            if exited || Instant::now() > deadline {
                self.stop();
                let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
                let why = if exited { "etcd exited" } else { "etcd did not answer /health in time" };
                return Err(format!("{why}; log {}:\n{log}", self.log_path().display()));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A port that was free a moment ago.
fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a free loopback port");
    listener.local_addr().expect("local addr").port()
}

/// Whether etcd on `port` reports itself healthy (it has a leader).
fn healthy(port: u16) -> bool {
    http_get(port, "/health").is_some_and(|body| body.contains(r#""health":"true""#))
}

/// The response (headers and body) to `GET path` on the loopback `port`; `None` on any error.
fn http_get(port: u16, path: &str) -> Option<String> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    let timeout = Some(Duration::from_secs(2));
    stream.set_read_timeout(timeout).ok()?;
    stream.set_write_timeout(timeout).ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    Some(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_stops_restarts_and_leaves_no_process() {
        let mut server = EtcdServer::start();
        let port = server.client_port;
        assert!(healthy(port));
        assert!(server.endpoint().ends_with(&format!(":{port}")));

        server.stop();
        assert!(!server.is_running());
        assert!(!healthy(port), "etcd still answers after stop");

        server.start_again(DataDir::Keep);
        assert!(healthy(port));
        assert!(server.metric("etcd_server_has_leader") == Some(1.0), "metrics readable");
        assert_eq!(server.metric("no_such_metric"), None);
        server.restart(DataDir::Wipe);
        assert!(healthy(port));

        let data_dir = server.data_dir();
        drop(server);
        assert!(!healthy(port), "etcd still answers after drop");
        assert!(!data_dir.exists(), "temp dir removed on drop");
    }

    #[test]
    fn the_guard_kills_etcd_when_its_parent_goes_away() {
        let mut server = EtcdServer::start();
        let port = server.client_port;
        // What the death of the test process does: the pipe closes, nobody waits on the guard.
        let Running { guard, lifeline } = server.process.take().expect("running");
        drop(lifeline);
        drop(guard);
        let deadline = Instant::now() + STOP_LIMIT;
        while healthy(port) {
            assert!(Instant::now() < deadline, "etcd outlived its lifeline");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
