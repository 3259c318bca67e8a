//! Long-running `tandem` processes for cluster tests: started with piped output, waited on until they
//! print a line, killed on drop (never orphaned), their stderr kept for failure messages.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::tandem_bin;

/// A running `tandem` process.
pub struct Proc {
    name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Proc {
    /// Starts `tandem ARGS` (`name` labels it in failure messages).
    pub fn start(name: &str, args: &[&str]) -> Proc {
        Proc::start_with_env(name, args, &[])
    }

    /// [`Proc::start`] with extra environment variables.
    pub fn start_with_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut command = Command::new(tandem_bin());
        command.args(args).envs(env.iter().copied());
        Proc::spawn(name, command)
    }

    /// Starts `command` as it is (any program: e.g. `tandem` prefixed by `ip netns exec NS`), with
    /// `TANDEM_LOG=info` unless the command sets it.
    pub fn spawn(name: &str, mut command: Command) -> Proc {
        if !command.get_envs().any(|(k, _)| k == "TANDEM_LOG") {
            command.env("TANDEM_LOG", "info");
        }
        let args: Vec<_> = command.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name} ({:?} {args:?}): {e}", command.get_program()));
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&stderr);
        let err = child.stderr.take().expect("piped stderr");
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap_or_else(|p| p.into_inner());
                s.push_str(&line);
                s.push('\n');
            }
        });
        Proc { name: name.to_string(), child, lines, stderr }
    }

    /// Waits for a stdout line containing `needle`; returns it. Panics (with stderr) after `limit`.
    pub fn wait_line(&mut self, needle: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.min(Duration::from_millis(200))) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Ok(Some(status)) = self.child.try_wait() {
                        panic!("{} exited ({status}) before printing {needle:?}; stderr:\n{}", self.name, self.stderr());
                    }
                    if Instant::now() >= deadline {
                        panic!("{} did not print {needle:?} within {limit:?}; stderr:\n{}", self.name, self.stderr());
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("{} closed stdout before printing {needle:?}; stderr:\n{}", self.name, self.stderr());
                }
            }
        }
    }

    /// Waits for `tandem ... serving on ADDR` and returns ADDR.
    pub fn wait_serving(&mut self, limit: Duration) -> String {
        let line = self.wait_line("serving on ", limit);
        line.rsplit("serving on ").next().expect("address").trim().to_string()
    }

    /// Whether stderr contains `needle` within `limit` (stderr is read by a thread, so a line the process
    /// already wrote may take a moment to arrive here).
    pub fn stderr_shows(&self, needle: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if self.stderr().contains(needle) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Everything the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the process at once (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM and waits up to `limit` for a clean exit; returns whether it exited successfully.
    pub fn terminate(&mut self, limit: Duration) -> bool {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        false
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A free TCP port on 127.0.0.1 (bound and released; good enough for tests that bind it right away).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}
