//! `tandem-netdelay --queue N --delay-ms D`: holds every packet netfilter queues to NFQUEUE `N` (in
//! the network namespace it runs in) for `D` ms, then lets it go, in arrival order — the delay half
//! of `tc netem delay D` for kernels without sch_netem. The partition tests start it inside a host's
//! namespace (`ip netns exec`) before they send that host's packets to the queue with iptables.
//!
//! Prints `bound to queue N` on stdout once it holds the queue; runs until killed. Only the packets'
//! metadata is copied to user space (copy range 0), and verdicts leave payloads untouched.

use std::collections::VecDeque;
use std::io::{ErrorKind, Write};
use std::time::{Duration, Instant};

fn arg(args: &[String], name: &str) -> Result<u64, String> {
    let i = args.iter().position(|a| a == name).ok_or_else(|| format!("missing {name}"))?;
    let v = args.get(i + 1).ok_or_else(|| format!("{name} needs a value"))?;
    v.parse().map_err(|_| format!("{name} {v:?}: not a number"))
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (queue, delay) = match (arg(&args, "--queue"), arg(&args, "--delay-ms")) {
        (Ok(q), Ok(d)) if q <= u64::from(u16::MAX) => (q as u16, Duration::from_millis(d)),
        (q, d) => {
            let why = [q.err(), d.err()].into_iter().flatten().collect::<Vec<_>>().join("; ");
            eprintln!("usage: tandem-netdelay --queue N --delay-ms D ({})", if why.is_empty() { "queue out of range".into() } else { why });
            return std::process::ExitCode::from(2);
        }
    };
    match run(queue, delay) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tandem-netdelay: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(queue_num: u16, delay: Duration) -> std::io::Result<()> {
    let mut queue = nfq::Queue::open()?;
    queue.bind(queue_num)?;
    queue.set_copy_range(queue_num, 0)?;
    queue.set_queue_max_len(queue_num, 65_536)?;
    queue.set_nonblocking(true);
    println!("bound to queue {queue_num}");
    std::io::stdout().flush()?;
    let mut held: VecDeque<(Instant, nfq::Message)> = VecDeque::new();
    loop {
        loop {
            match queue.recv() {
                Ok(mut msg) => {
                    msg.set_verdict(nfq::Verdict::Accept);
                    held.push_back((Instant::now() + delay, msg));
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        let now = Instant::now();
        while held.front().is_some_and(|(due, _)| *due <= now) {
            let (_, msg) = held.pop_front().expect("checked");
            queue.verdict(msg)?;
        }
        let next = held.front().map_or(Duration::from_millis(1), |(due, _)| due.saturating_duration_since(now));
        std::thread::sleep(next.min(Duration::from_micros(500)));
    }
}
