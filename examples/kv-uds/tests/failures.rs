//! Failure paths, driven through the exported vtable: bad arguments, unreachable endpoints, closing
//! and destroying links and instances, destroy from inside a callback, and garbage on the listening
//! socket from something that is not a peer.

#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod common;

use std::ffi::CStr;
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{Action, Peer, WAIT, host_struct, last_error, plugin, random_bytes};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use tandem_kv_uds::abi::{self, TandemKvIov};

fn dir_config(dir: &tempfile::TempDir) -> String {
    format!("dir={}", dir.path().display())
}

fn socket_path(peer: &Peer) -> PathBuf {
    PathBuf::from(peer.endpoint().strip_prefix("uds:").expect("uds: endpoint"))
}

#[test]
fn the_vtable_describes_a_v1_host_memory_plugin() {
    let vtable = plugin();
    assert_eq!(vtable.abi_version, abi::TANDEM_KV_ABI_VERSION);
    assert_eq!(
        vtable.struct_size as usize,
        size_of::<abi::TandemKvPlugin>()
    );
    assert_eq!(
        vtable.capabilities,
        abi::TANDEM_KV_CAP_HOST_MEMORY | abi::TANDEM_KV_CAP_CROSS_PROCESS
    );
    // SAFETY: `name` points to a static NUL-terminated string.
    assert_eq!(unsafe { CStr::from_ptr(vtable.name) }, c"uds");
    assert!(vtable.create.is_some() && vtable.destroy.is_some() && vtable.endpoint.is_some());
    assert!(vtable.connect.is_some() && vtable.send.is_some() && vtable.close_link.is_some());
    assert!(vtable.last_error.is_some());
    assert!(std::ptr::eq(vtable, plugin()), "one static vtable");
}

#[test]
fn the_endpoint_lives_in_the_configured_dir_and_destroy_removes_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::new(&dir_config(&dir));
    let endpoint = peer.endpoint();
    assert_eq!(peer.endpoint(), endpoint, "stable");
    let path = socket_path(&peer);
    assert_eq!(path.parent(), Some(dir.path()));
    let name = path.file_name().unwrap().to_str().unwrap();
    assert!(
        name.starts_with(&format!("tandem-kv-uds-{}-", std::process::id()))
            && name.ends_with(".sock")
    );
    assert!(path.exists());
    let other = Peer::new(&dir_config(&dir));
    assert_ne!(other.endpoint(), endpoint, "unique per instance");
    drop(peer.destroy());
    assert!(!path.exists(), "destroy removes the socket file");
}

#[test]
fn create_rejects_bad_configs_and_bad_hosts() {
    let (status, message) = Peer::with_policy("port=1", common::deliver_all).unwrap_err();
    assert_eq!(status, abi::TANDEM_KV_ERR_INVALID);
    assert!(message.contains("unknown key `port`"), "{message}");
    let (status, message) =
        Peer::with_policy("dir=/nonexistent/kv-uds-test", common::deliver_all).unwrap_err();
    assert_eq!(status, abi::TANDEM_KV_ERR_INVALID);
    assert!(message.contains("/nonexistent/kv-uds-test"), "{message}");

    let create = plugin().create.unwrap();
    let good = host_struct(std::ptr::null_mut());
    let hosts = [
        (
            abi::TandemKvHost {
                abi_version: 2,
                ..good
            },
            abi::TANDEM_KV_ERR_UNSUPPORTED,
        ),
        (
            abi::TandemKvHost {
                struct_size: 16,
                ..good
            },
            abi::TANDEM_KV_ERR_INVALID,
        ),
        (
            abi::TandemKvHost {
                on_payload: None,
                ..good
            },
            abi::TANDEM_KV_ERR_INVALID,
        ),
    ];
    for (host, expected) in hosts {
        let mut out = std::ptr::dangling_mut::<abi::TandemKvInstance>();
        // SAFETY: valid string, host struct and out pointer; the plugin must refuse the host.
        let status = unsafe { create(c"".as_ptr(), &host, &mut out) };
        assert_eq!(status, expected, "{}", last_error());
        assert!(out.is_null(), "a failed create leaves NULL in *out");
    }
    let mut out = std::ptr::null_mut();
    // SAFETY: NULL arguments must be refused before use.
    unsafe {
        assert_eq!(
            create(std::ptr::null(), &good, &mut out),
            abi::TANDEM_KV_ERR_INVALID
        );
        assert_eq!(
            create(c"".as_ptr(), std::ptr::null(), &mut out),
            abi::TANDEM_KV_ERR_INVALID
        );
        assert_eq!(
            create(c"".as_ptr(), &good, std::ptr::null_mut()),
            abi::TANDEM_KV_ERR_INVALID
        );
    }
    assert!(last_error().contains("NULL"), "{}", last_error());
}

#[test]
fn null_and_out_of_range_arguments_are_invalid() {
    let dir = tempfile::tempdir().unwrap();
    let a = Peer::new(&dir_config(&dir));
    let b = Peer::new(&dir_config(&dir));
    let link = a.connect(&b.endpoint()).unwrap();
    let vtable = plugin();
    let (send, connect) = (vtable.send.unwrap(), vtable.connect.unwrap());
    let byte = [0u8; 1];
    let one = TandemKvIov {
        addr: byte.as_ptr().cast_mut().cast(),
        len: 1,
        ..TandemKvIov::EMPTY
    };

    // SAFETY: every call passes an argument the plugin must refuse before dereferencing anything.
    unsafe {
        assert_eq!(
            send(std::ptr::null_mut(), link, byte.as_ptr(), 1, &one, 1),
            abi::TANDEM_KV_ERR_INVALID
        );
        assert_eq!(
            send(a.raw(), link, std::ptr::null(), 1, &one, 1),
            abi::TANDEM_KV_ERR_INVALID
        );
        assert_eq!(
            send(a.raw(), link, byte.as_ptr(), 1, std::ptr::null(), 1),
            abi::TANDEM_KV_ERR_INVALID
        );
        let mut out = 0;
        assert_eq!(
            connect(std::ptr::null_mut(), c"uds:/x".as_ptr(), &mut out),
            abi::TANDEM_KV_ERR_INVALID
        );
        assert_eq!(
            connect(a.raw(), std::ptr::null(), &mut out),
            abi::TANDEM_KV_ERR_INVALID
        );
        assert_eq!(
            connect(a.raw(), c"uds:/x".as_ptr(), std::ptr::null_mut()),
            abi::TANDEM_KV_ERR_INVALID
        );
        // NULL is fine where the length is 0.
        assert_eq!(
            send(a.raw(), link, std::ptr::null(), 0, std::ptr::null(), 0),
            abi::TANDEM_KV_OK
        );
        // The others ignore NULL and never return NULL.
        (vtable.close_link.unwrap())(std::ptr::null_mut(), 1);
        (vtable.destroy.unwrap())(std::ptr::null_mut());
        let endpoint = (vtable.endpoint.unwrap())(std::ptr::null_mut());
        assert!(!endpoint.is_null() && *endpoint == 0);
    }

    let header = vec![7u8; abi::TANDEM_KV_MAX_HEADER as usize + 1];
    let (status, message) = a
        .send_iovs(link, header.as_ptr(), header.len(), &[])
        .unwrap_err();
    assert_eq!(status, abi::TANDEM_KV_ERR_INVALID);
    assert!(message.contains("TANDEM_KV_MAX_HEADER"), "{message}");
    let many = vec![one; abi::TANDEM_KV_MAX_IOVS as usize + 1];
    let (status, message) = a.send_iovs(link, byte.as_ptr(), 1, &many).unwrap_err();
    assert_eq!(status, abi::TANDEM_KV_ERR_INVALID);
    assert!(message.contains("TANDEM_KV_MAX_IOVS"), "{message}");
    let full = vec![one; abi::TANDEM_KV_MAX_IOVS as usize];
    a.send_iovs(link, byte.as_ptr(), 1, &full).unwrap();
    let cuda = TandemKvIov {
        mem_kind: abi::TANDEM_KV_MEM_CUDA,
        ..one
    };
    let (status, message) = a
        .send_iovs(link, byte.as_ptr(), 1, &[one, cuda])
        .unwrap_err();
    assert_eq!(status, abi::TANDEM_KV_ERR_UNSUPPORTED);
    assert!(message.contains("mem_kind"), "{message}");
    let null_piece = TandemKvIov {
        len: 5,
        ..TandemKvIov::EMPTY
    };
    assert_eq!(
        a.send_iovs(link, byte.as_ptr(), 1, &[null_piece])
            .unwrap_err()
            .0,
        abi::TANDEM_KV_ERR_INVALID
    );
    for unknown in [0, link + 1000] {
        let (status, message) = a.send(unknown, b"x", &[]).unwrap_err();
        assert_eq!(status, abi::TANDEM_KV_ERR_INVALID);
        assert!(message.contains("unknown link"), "{message}");
    }

    // Everything refused sent nothing: b saw exactly the two accepted messages.
    let state = b.host.wait("two messages", |s| s.received.len() == 2);
    assert_eq!(
        (
            state.received[0].header.len(),
            state.received[0].payload_len
        ),
        (0, 0)
    );
    assert_eq!(state.received[1].payload.as_deref(), Some(&[0u8; 256][..]));
}

#[test]
fn connecting_to_a_missing_or_malformed_endpoint_fails_fast() {
    let dir = tempfile::tempdir().unwrap();
    let a = Peer::new(&dir_config(&dir));
    let missing = dir.path().join("nobody.sock");
    // A socket file nobody listens on any more.
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    for endpoint in [
        format!("uds:{}", missing.display()),
        format!("uds:{}", stale.display()),
        "uds:".to_owned(),
        "tcp:127.0.0.1:1".to_owned(),
        missing.display().to_string(),
        String::new(),
    ] {
        let started = Instant::now();
        let (status, message) = a.connect(&endpoint).unwrap_err();
        assert_eq!(
            status,
            abi::TANDEM_KV_ERR_UNREACHABLE,
            "{endpoint}: {message}"
        );
        assert!(!message.is_empty());
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{endpoint} took {:?}",
            started.elapsed()
        );
    }
}

#[test]
fn close_link_tells_the_peer_but_not_the_closer() {
    let dir = tempfile::tempdir().unwrap();
    let a = Peer::new(&dir_config(&dir));
    let b = Peer::new(&dir_config(&dir));
    let link = a.connect(&b.endpoint()).unwrap();
    a.send(link, b"hello", &[]).unwrap();
    let incoming = b.host.wait("hello", |s| s.received.len() == 1).received[0].link;

    a.close_link(link);
    a.close_link(link); // idempotent
    a.close_link(987_654); // unknown: no-op
    let state = b
        .host
        .wait("b learns the link closed", |s| !s.closed.is_empty());
    assert_eq!(state.closed[0].0, incoming);
    assert_eq!(state.closed[0].1, abi::TANDEM_KV_ERR_CLOSED);
    drop(state);
    let (status, message) = a.send(link, b"after", &[]).unwrap_err();
    assert_eq!(status, abi::TANDEM_KV_ERR_CLOSED, "{message}");
    let (status, _) = b.send(incoming, b"after", &[]).unwrap_err();
    assert_eq!(status, abi::TANDEM_KV_ERR_CLOSED);

    // A link the other side never heard of (no message on it) ends silently there.
    let quiet = a.connect(&b.endpoint()).unwrap();
    a.close_link(quiet);
    let settle = a.connect(&b.endpoint()).unwrap();
    a.send(settle, b"after quiet", &[]).unwrap();
    b.host
        .wait_until("a message after the quiet link", |s| s.received.len() == 2);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        b.host.state().closed.len(),
        1,
        "no on_link_closed for a link the host never saw"
    );
    assert!(
        a.host.state().closed.is_empty(),
        "no on_link_closed for links the host closed itself"
    );
    assert!(a.host.state().errors.is_empty() && b.host.state().errors.is_empty());
}

#[test]
fn destroying_one_side_closes_the_link_on_the_other_and_its_sends_fail() {
    let dir = tempfile::tempdir().unwrap();
    let a = Peer::new(&dir_config(&dir));
    let b = Peer::new(&dir_config(&dir));
    let b_endpoint = b.endpoint();
    let link = a.connect(&b_endpoint).unwrap();
    a.send(link, b"one", &[b"payload"]).unwrap();
    b.host.wait_until("one", |s| s.received.len() == 1);
    let b_host = b.destroy();

    let state = a
        .host
        .wait("a learns the link closed", |s| !s.closed.is_empty());
    assert_eq!(state.closed.len(), 1);
    assert_eq!(state.closed[0].0, link);
    assert!(state.closed[0].1 < 0);
    drop(state);
    let (status, _) = a.send(link, b"two", &[b"payload"]).unwrap_err();
    assert_eq!(status, abi::TANDEM_KV_ERR_CLOSED);
    assert_eq!(b_host.state().late_callbacks, 0);
    // b's endpoint is gone too.
    assert_eq!(
        a.connect(&b_endpoint).unwrap_err().0,
        abi::TANDEM_KV_ERR_UNREACHABLE
    );
}

#[test]
fn destroy_joins_every_thread_so_no_callback_follows_it() {
    let dir = tempfile::tempdir().unwrap();
    let a = Peer::new(&dir_config(&dir));
    for round in 0..10 {
        let b = Peer::new(&dir_config(&dir));
        b.host.state().on_message_delay = Duration::from_millis(2);
        let b_endpoint = b.endpoint();
        let links: Vec<u64> = (0..3).map(|_| a.connect(&b_endpoint).unwrap()).collect();
        let b_host = std::thread::scope(|scope| {
            for &link in &links {
                let a = &a;
                scope.spawn(move || {
                    let payload = vec![round as u8; 50_000];
                    // Sends until b is gone; bounded by WAIT so a hang cannot hide here.
                    let started = Instant::now();
                    while started.elapsed() < WAIT && a.send(link, b"flood", &[&payload]).is_ok() {}
                });
            }
            b.host
                .wait_until("traffic on every link", |s| s.received.len() >= 30);
            let started = Instant::now();
            let b_host = b.destroy();
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "destroy took {:?}",
                started.elapsed()
            );
            b_host
        });
        std::thread::sleep(Duration::from_millis(50));
        let state = b_host.state();
        assert_eq!(
            state.late_callbacks, 0,
            "round {round}: callbacks after destroy returned"
        );
        assert!(state.errors.is_empty(), "{:?}", state.errors);
    }
}

#[test]
fn destroy_from_inside_a_callback_does_not_deadlock() {
    let dir = tempfile::tempdir().unwrap();
    let a = Peer::new(&dir_config(&dir));
    let b = Peer::with_policy(&dir_config(&dir), |header, _| {
        if header == b"die" {
            Action::DestroySelf
        } else {
            Action::Deliver { pieces: 1 }
        }
    })
    .unwrap();
    let path = socket_path(&b);
    let link = a.connect(&b.endpoint()).unwrap();
    a.send(link, b"live", &[b"x"]).unwrap();
    a.send(link, b"die", &[b"y"]).unwrap();
    let state = a.host.wait("a learns b is gone", |s| !s.closed.is_empty());
    assert_eq!(state.closed[0].0, link);
    drop(state);
    let state = b.host.wait("b marked dead by its own callback", |s| s.dead);
    assert_eq!(state.received.len(), 2);
    drop(state);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(b.host.state().late_callbacks, 0);
    assert!(!path.exists());
}

/// Connects raw to `peer`'s socket, writes `bytes` (optionally half-closing), and waits for the plugin
/// to close the connection.
fn expect_dropped_after(peer: &Peer, bytes: &[u8], half_close: bool) {
    let mut raw = UnixStream::connect(socket_path(peer)).unwrap();
    raw.set_read_timeout(Some(WAIT)).unwrap();
    // The plugin may close before reading everything: a failed write is fine.
    let _ = raw.write_all(bytes);
    if half_close {
        let _ = raw.shutdown(Shutdown::Write);
    }
    let mut sink = [0u8; 64];
    match raw.read(&mut sink) {
        Ok(0) => {}
        Ok(n) => panic!("the plugin answered garbage with {n} bytes"),
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the plugin did not close a garbage link within {WAIT:?}: {e}"),
    }
}

fn prefix(magic: &[u8; 4], header_len: u32, payload_len: u64) -> Vec<u8> {
    [
        &magic[..],
        &header_len.to_le_bytes(),
        &payload_len.to_le_bytes(),
    ]
    .concat()
}

#[test]
fn garbage_on_the_listening_socket_closes_that_link_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let a = Peer::new(&dir_config(&dir));
    let b = Peer::new(&dir_config(&dir));
    let link = a.connect(&b.endpoint()).unwrap();
    a.send(link, b"before", &[b"1"]).unwrap();
    b.host.wait_until("before", |s| s.received.len() == 1);

    let mut rng = SmallRng::seed_from_u64(4);
    for _ in 0..20 {
        expect_dropped_after(&b, &random_bytes(&mut rng, 4096), false);
    }
    // Huge lengths behind a valid magic: never trusted, never allocated, never waited for.
    expect_dropped_after(&b, &prefix(b"TKV1", u32::MAX, u64::MAX), false);
    expect_dropped_after(
        &b,
        &prefix(b"TKV1", abi::TANDEM_KV_MAX_HEADER + 1, 0),
        false,
    );
    // A truncated prefix, then end of stream.
    expect_dropped_after(&b, b"TKV1\x01", true);
    // A plausible message announcing an absurd payload, then the stream ends inside it: the host hears
    // of the message, discards it (too big), and the link ends with an I/O error.
    let mut absurd = prefix(b"TKV1", 3, u64::MAX);
    absurd.extend_from_slice(b"hdr");
    absurd.extend_from_slice(&[0u8; 1000]);
    expect_dropped_after(&b, &absurd, true);
    let state = b
        .host
        .wait("the absurd message's link closed", |s| !s.closed.is_empty());
    assert_eq!(
        state.received.len(),
        2,
        "only the plausible message reached the host"
    );
    assert_eq!(
        (&state.received[1].header[..], state.received[1].payload_len),
        (&b"hdr"[..], u64::MAX)
    );
    assert_eq!(state.closed.len(), 1);
    assert_eq!(state.closed[0].1, abi::TANDEM_KV_ERR_IO);
    assert_ne!(
        state.closed[0].0, state.received[0].link,
        "the good link stays open"
    );
    drop(state);

    // b keeps serving: the old link still works both ways, and new links open.
    a.send(link, b"after", &[b"2"]).unwrap();
    let incoming = b.host.wait("after", |s| s.received.len() == 3).received[2].link;
    assert_eq!(incoming, b.host.state().received[0].link);
    b.send(incoming, b"reply", &[]).unwrap();
    a.host.wait_until("reply", |s| s.received.len() == 1);
    let c = Peer::new(&dir_config(&dir));
    let fresh = c.connect(&b.endpoint()).unwrap();
    c.send(fresh, b"fresh", &[]).unwrap();
    b.host.wait_until("fresh", |s| s.received.len() == 4);
    assert!(b.host.state().errors.is_empty());
    assert!(a.host.state().closed.is_empty());
}

#[test]
fn last_error_is_per_thread() {
    let dir = tempfile::tempdir().unwrap();
    let a = Peer::new(&dir_config(&dir));
    let (_, message) = a.connect("uds:/nonexistent/thread-a.sock").unwrap_err();
    assert!(message.contains("thread-a"), "{message}");
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let (_, other) = a.connect("uds:/nonexistent/thread-b.sock").unwrap_err();
            assert!(other.contains("thread-b"), "{other}");
        });
    });
    assert!(
        last_error().contains("thread-a"),
        "another thread's failure must not leak here"
    );
}
