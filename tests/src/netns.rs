//! A small private network for partition tests, made of Linux network namespaces (iproute2): one
//! switch namespace holding a bridge, one namespace per host (`eth0` on the bridge through a veth,
//! an address in a private 10.x.y.0/24, `lo` up), and one veth from the test's own namespace onto the
//! bridge, so the test process reaches every host directly. Links between two hosts can be cut and
//! healed, and impaired (random loss and a fixed delay, as `tc netem` would) with iptables and a
//! user-space delayer on NFQUEUE, which kernels without sch_netem still have.
//!
//! Invariants:
//! - Names are unique per test process and network (`tnd<pid>n<k>...`), so tests running in
//!   parallel never share a namespace, an interface or a subnet (a /24 that the test's namespace
//!   already routes is never taken).
//! - Dropping a [`Net`] deletes everything it created (namespaces, the veth in the test's
//!   namespace), also when the test panicked. Networks left behind by a test process that was
//!   killed are deleted by the next [`Net::new`].
//! - A cut is silent, as a partition is: each side gets a blackhole route to the other, so packets
//!   already in flight and every retransmission vanish and no reset is ever sent.

use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

/// Why namespaces cannot be used here (not root, no iproute2, EPERM): the test should skip.
#[derive(Debug, Clone)]
pub struct Unavailable(pub String);

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A private network of namespaces; deleted on drop.
#[derive(Debug)]
pub struct Net {
    /// Prefix of every name this network creates.
    tag: String,
    /// The third octet of its 10.211.x.0/24.
    subnet: u8,
    /// The veth end in the test's own namespace.
    uplink: String,
    /// Every namespace created, the switch first.
    namespaces: Vec<String>,
    hosts: Vec<Host>,
}

/// One host of a [`Net`]: a namespace with an address on the bridge.
#[derive(Debug, Clone)]
pub struct Host {
    /// The namespace's name (for `ip netns exec`).
    pub ns: String,
    /// Its IPv4 address.
    pub ip: String,
}

impl Host {
    /// `ip netns exec NS PROGRAM`: a command that runs `program` inside this host's namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns]).arg(program);
        c
    }
}

/// Runs `ip ARGS`; its stderr on failure.
fn ip(args: &[&str]) -> Result<Output, String> {
    run("ip", args)
}

fn run(program: &str, args: &[&str]) -> Result<Output, String> {
    let out = Command::new(program).args(args).output().map_err(|e| format!("{program} {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(format!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Panics with `what` on an error: a step of building the network that must work once namespaces do.
fn must(r: Result<Output, String>) {
    if let Err(e) = r {
        panic!("building the test network: {e}");
    }
}

impl Net {
    /// A new empty network (the switch and the uplink from the test's namespace), or why namespaces
    /// cannot be used on this machine.
    pub fn new() -> Result<Net, Unavailable> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let pid = std::process::id();
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        remove_stale();
        let tag = format!("tnd{pid}n{k}");
        let switch = format!("{tag}-sw");
        if let Err(e) = ip(&["netns", "add", &switch]) {
            return Err(Unavailable(format!("cannot create a network namespace (needs root and iproute2): {e}")));
        }
        // Interface names have at most 15 bytes: the uplink is named by a hash of the tag.
        let uplink = format!("tnd{:x}", fnv(&tag) & 0xffff_ffff);
        let mut net = Net { tag, subnet: 0, uplink, namespaces: vec![switch.clone()], hosts: Vec::new() };
        net.subnet = free_subnet(pid, k);
        must(ip(&["-n", &switch, "link", "set", "lo", "up"]));
        must(ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"]));
        must(ip(&["-n", &switch, "link", "set", "br0", "up"]));
        must(ip(&["link", "add", &net.uplink, "type", "veth", "peer", "name", "up0", "netns", &switch]));
        must(ip(&["-n", &switch, "link", "set", "up0", "master", "br0", "up"]));
        must(ip(&["addr", "add", &format!("10.211.{}.254/24", net.subnet), "dev", &net.uplink]));
        must(ip(&["link", "set", &net.uplink, "up"]));
        Ok(net)
    }

    /// Adds a host named `name` (letters and digits, at most 8) with the next address.
    pub fn add(&mut self, name: &str) -> Host {
        assert!(name.len() <= 8 && name.chars().all(|c| c.is_ascii_alphanumeric()), "host name {name:?}");
        let ns = format!("{}-{name}", self.tag);
        let ip_addr = format!("10.211.{}.{}", self.subnet, self.hosts.len() + 1);
        let switch = self.namespaces[0].clone();
        must(ip(&["netns", "add", &ns]));
        self.namespaces.push(ns.clone());
        let port = format!("v{}", self.hosts.len());
        must(ip(&["-n", &switch, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns]));
        must(ip(&["-n", &switch, "link", "set", &port, "master", "br0", "up"]));
        must(ip(&["-n", &ns, "link", "set", "lo", "up"]));
        must(ip(&["-n", &ns, "addr", "add", &format!("{ip_addr}/24"), "dev", "eth0"]));
        must(ip(&["-n", &ns, "link", "set", "eth0", "up"]));
        let host = Host { ns, ip: ip_addr };
        self.hosts.push(host.clone());
        host
    }

    /// The address of the test's own end of the network.
    pub fn uplink_ip(&self) -> String {
        format!("10.211.{}.254", self.subnet)
    }

    /// Cuts the link between `a` and `b` in both directions: from now on their packets to each other
    /// vanish (connections stall as in a partition; nothing resets them).
    pub fn cut(&self, a: &Host, b: &Host) {
        must(ip(&["-n", &a.ns, "route", "add", "blackhole", &format!("{}/32", b.ip)]));
        must(ip(&["-n", &b.ns, "route", "add", "blackhole", &format!("{}/32", a.ip)]));
    }

    /// Heals a link [`Net::cut`] cut.
    pub fn heal(&self, a: &Host, b: &Host) {
        must(ip(&["-n", &a.ns, "route", "del", "blackhole", &format!("{}/32", b.ip)]));
        must(ip(&["-n", &b.ns, "route", "del", "blackhole", &format!("{}/32", a.ip)]));
    }

    /// Impairs what `from` sends to `to` as `tc netem delay DELAY loss LOSS` on `from`'s interface
    /// would, with what kernels without sch_netem still have: iptables in `to`'s namespace drops
    /// `loss` (a fraction) of the packets arriving from `from` at random (the statistic match) and
    /// queues the rest to NFQUEUE 0, where `delayer` (the `tandem-netdelay` binary, started inside
    /// that namespace) holds each one `delay` before letting it in. Done on arrival, not on
    /// departure: a sender's own packets held in a queue count against its socket (TCP small queues)
    /// and throttle it to a couple of packets per round trip, which netem avoids by orphaning them.
    /// Nothing else of either host's traffic is touched. `Err` says what this machine lacks (iptables,
    /// the statistic match, NFQUEUE); the impairment ends when the returned value drops (or with the
    /// network).
    pub fn impair(
        &self,
        from: &Host,
        to: &Host,
        delay: std::time::Duration,
        loss: f64,
        delayer: &std::path::Path,
    ) -> Result<Impairment, String> {
        use std::io::BufRead;
        let mut child = to
            .command(delayer)
            .args(["--queue", "0", "--delay-ms", &delay.as_millis().to_string()])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting {}: {e}", delayer.display()))?;
        let mut line = String::new();
        let stdout = child.stdout.take().expect("piped");
        let _ = std::io::BufReader::new(stdout).read_line(&mut line);
        if !line.starts_with("bound") {
            let _ = child.kill();
            let out = child.wait_with_output().map_err(|e| e.to_string())?;
            return Err(format!("the delayer did not bind NFQUEUE 0: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
        let imp = Impairment { ns: to.ns.clone(), delayer: Some(child) };
        let src = format!("{}/32", from.ip);
        let probability = format!("{loss}");
        imp.iptables(&["-A", "INPUT", "-s", &src, "-m", "statistic", "--mode", "random", "--probability", &probability, "-j", "DROP"])?;
        imp.iptables(&["-A", "INPUT", "-s", &src, "-j", "NFQUEUE", "--queue-num", "0"])?;
        Ok(imp)
    }
}

/// An impairment [`Net::impair`] set up: iptables rules in the receiving host's namespace and the
/// delayer process serving their queue. Dropping it removes both.
#[derive(Debug)]
pub struct Impairment {
    ns: String,
    delayer: Option<std::process::Child>,
}

impl Impairment {
    fn iptables(&self, args: &[&str]) -> Result<Output, String> {
        let mut all = vec!["netns", "exec", &self.ns, "iptables"];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Packets the random-drop rule has dropped so far.
    pub fn dropped(&self) -> Result<u64, String> {
        let out = self.iptables(&["-L", "INPUT", "-v", "-x", "-n"])?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| l.contains("DROP") && l.contains("statistic"))
            .and_then(|l| l.split_whitespace().next()?.parse().ok())
            .ok_or_else(|| format!("no drop rule in {}'s INPUT chain", self.ns))
    }
}

impl Drop for Impairment {
    fn drop(&mut self) {
        let _ = self.iptables(&["-F", "INPUT"]);
        if let Some(mut c) = self.delayer.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.uplink]);
        for ns in self.namespaces.iter().rev() {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// FNV-1a: a short stable hash for interface names.
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// A third octet for 10.211.x.0/24 that no route of the test's namespace uses yet.
fn free_subnet(pid: u32, k: u32) -> u8 {
    let routes = ip(&["-4", "route", "show"]).map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
    let start = (pid.wrapping_mul(31).wrapping_add(k.wrapping_mul(7)) % 250) as u8;
    (0..250u8)
        .map(|i| (start.wrapping_add(i)) % 250 + 1)
        .find(|x| !routes.contains(&format!("10.211.{x}.")))
        .expect("a free 10.211.x.0/24")
}

/// Deletes the namespaces and uplinks of test processes that no longer run (killed before their
/// `Net` dropped).
fn remove_stale() {
    let Ok(out) = ip(&["netns", "list"]) else { return };
    let list = String::from_utf8_lossy(&out.stdout).into_owned();
    for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some(rest) = name.strip_prefix("tnd") else { continue };
        let Some((pid, _)) = rest.split_once('n') else { continue };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        if let Some(tag) = name.strip_suffix("-sw") {
            let _ = ip(&["link", "del", &format!("tnd{:x}", fnv(tag) & 0xffff_ffff)]);
        }
        let _ = ip(&["netns", "del", name]);
    }
}
