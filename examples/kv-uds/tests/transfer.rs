//! Messages between two instances in one process, driven only through the exported vtable: payloads
//! round-trip bit-exact whatever the gather/scatter split, DISCARD drops a payload without losing the
//! next message, order holds, concurrent senders never interleave, host bugs cost one payload.

#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod common;

use std::collections::HashMap;

use common::{Action, Peer, Received, random_bytes, scatter};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tandem_kv_uds::abi;

/// Two instances in a private directory, `a` linked to `b`; returns (dir, a, b, link id at a).
fn pair(policy_b: common::Policy) -> (tempfile::TempDir, Peer, Peer, u64) {
    let dir = tempfile::tempdir().unwrap();
    let config = format!("dir={}", dir.path().display());
    let a = Peer::new(&config);
    let b = Peer::with_policy(&config, policy_b).unwrap();
    let link = a.connect(&b.endpoint()).unwrap();
    (dir, a, b, link)
}

fn assert_clean(peer: &Peer) {
    let state = peer.host.state();
    assert!(
        state.errors.is_empty(),
        "host saw contract violations: {:?}",
        state.errors
    );
}

#[test]
fn payloads_round_trip_bit_exact_through_scattered_iovecs_both_ways() {
    let (_dir, a, b, link) = pair(|header, _| Action::Deliver {
        pieces: 1 + header.len() % 7,
    });
    let mut rng = SmallRng::seed_from_u64(1);
    let sizes = [0usize, 1, 7, 4096, 65_537, (4 << 20) + 3, 300_000];
    let header_lens = [0usize, 4096, 1, 33, 4095, 17, 2];
    let mut sent = Vec::new();
    for (&size, &header_len) in sizes.iter().zip(&header_lens) {
        let header = random_bytes(&mut rng, header_len);
        let payload = random_bytes(&mut rng, size);
        let pieces = rng.random_range(1..=8);
        a.send(link, &header, &scatter(&mut rng, &payload, pieces))
            .unwrap();
        sent.push((header, payload));
    }
    let state = b
        .host
        .wait("every message at b", |s| s.received.len() == sent.len());
    let incoming = state.received[0].link;
    assert_ne!(incoming, 0);
    for (got, (header, payload)) in state.received.iter().zip(&sent) {
        assert_eq!(got.link, incoming, "one link, one id");
        assert_eq!(&got.header, header);
        assert_eq!(got.payload_len, payload.len() as u64);
        if payload.is_empty() {
            assert_eq!(
                (got.payload.as_deref(), got.status),
                (None, None),
                "no on_payload without payload"
            );
        } else {
            assert_eq!(got.status, Some(abi::TANDEM_KV_OK));
            assert!(
                got.payload.as_deref() == Some(&payload[..]),
                "payload of {} bytes differs",
                payload.len()
            );
        }
    }
    drop(state);

    // The link is bidirectional: b answers on the id it saw, a receives on the id connect gave it.
    let reply = random_bytes(&mut rng, 123_457);
    b.send(incoming, b"reply", &scatter(&mut rng, &reply, 5))
        .unwrap();
    let state = a.host.wait("the reply at a", |s| s.received.len() == 1);
    assert_eq!(state.received[0].link, link);
    assert_eq!(state.received[0].header, b"reply");
    assert_eq!(state.received[0].payload.as_deref(), Some(&reply[..]));
    drop(state);
    assert!(a.host.state().closed.is_empty() && b.host.state().closed.is_empty());
    assert_clean(&a);
    assert_clean(&b);
}

#[test]
fn discard_drops_the_payload_and_the_next_message_still_arrives() {
    let (_dir, a, b, link) = pair(|header, _| {
        if header.starts_with(b"drop") {
            Action::Discard
        } else {
            Action::Deliver { pieces: 2 }
        }
    });
    let mut rng = SmallRng::seed_from_u64(2);
    let big = random_bytes(&mut rng, 3 << 20);
    let small = random_bytes(&mut rng, 1000);
    a.send(link, b"drop-1", &[&big[..1 << 20], &big[1 << 20..]])
        .unwrap();
    a.send(link, b"keep-1", &[&small]).unwrap();
    a.send(link, b"drop-2", &[&small]).unwrap();
    a.send(link, b"keep-2", &[]).unwrap();
    a.send(link, b"keep-3", &[&big]).unwrap();
    let state = b.host.wait("five messages", |s| s.received.len() == 5);
    let view: Vec<(&[u8], Option<usize>, Option<i32>)> = state
        .received
        .iter()
        .map(|r| (&r.header[..], r.payload.as_ref().map(Vec::len), r.status))
        .collect();
    assert_eq!(
        view,
        [
            (&b"drop-1"[..], None, None),
            (b"keep-1", Some(1000), Some(0)),
            (b"drop-2", None, None),
            (b"keep-2", None, None),
            (b"keep-3", Some(3 << 20), Some(0)),
        ]
    );
    assert_eq!(state.received[1].payload.as_deref(), Some(&small[..]));
    assert!(state.received[4].payload.as_deref() == Some(&big[..]));
    drop(state);
    assert_clean(&b);
}

#[test]
fn many_messages_arrive_in_send_order() {
    let (_dir, a, b, link) = pair(common::deliver_all);
    let count = 3000u32;
    for seq in 0..count {
        let payload = seq.to_le_bytes().repeat((seq % 50) as usize);
        a.send(link, &seq.to_le_bytes(), &[&payload]).unwrap();
    }
    let state = b
        .host
        .wait("every message", |s| s.received.len() == count as usize);
    for (seq, got) in (0..count).zip(&state.received) {
        assert_eq!(got.header, seq.to_le_bytes(), "message {seq} out of order");
        let expected = seq.to_le_bytes().repeat((seq % 50) as usize);
        assert_eq!(got.payload.as_deref().unwrap_or_default(), &expected[..]);
    }
    drop(state);
    assert_clean(&b);
}

/// The payload of message `seq` from sender `thread`: its length and bytes follow from the pair alone.
fn message_payload(thread: u8, seq: u32) -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(u64::from(thread) << 32 | u64::from(seq));
    let len = rng.random_range(0..40_000);
    random_bytes(&mut rng, len)
}

#[test]
fn concurrent_senders_on_one_link_never_interleave() {
    let (_dir, a, b, link) = pair(|_, _| Action::Deliver { pieces: 4 });
    let (threads, per_thread) = (8u8, 150u32);
    std::thread::scope(|scope| {
        for thread in 0..threads {
            let a = &a;
            scope.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(100 + u64::from(thread));
                for seq in 0..per_thread {
                    let mut header = vec![thread];
                    header.extend_from_slice(&seq.to_le_bytes());
                    let payload = message_payload(thread, seq);
                    let pieces = rng.random_range(1..=6);
                    a.send(link, &header, &scatter(&mut rng, &payload, pieces))
                        .unwrap();
                }
            });
        }
    });
    let total = usize::from(threads) * per_thread as usize;
    let state = b.host.wait("every message", |s| s.received.len() == total);
    let mut next: HashMap<u8, u32> = HashMap::new();
    for got in &state.received {
        let Received {
            header, payload, ..
        } = got;
        assert_eq!(header.len(), 5, "a header arrived mangled: {header:?}");
        let thread = header[0];
        let seq = u32::from_le_bytes([header[1], header[2], header[3], header[4]]);
        let expected = next.entry(thread).or_insert(0);
        assert_eq!(seq, *expected, "thread {thread}: messages reordered");
        *expected += 1;
        let want = message_payload(thread, seq);
        let got = payload.as_deref().unwrap_or_default();
        assert!(
            got == &want[..],
            "thread {thread} message {seq}: payload mixed with another message"
        );
    }
    assert!(next.values().all(|&n| n == per_thread));
    drop(state);
    assert_clean(&b);
}

#[test]
fn host_bugs_in_delivered_iovecs_cost_one_payload_not_the_link() {
    let (_dir, a, b, link) = pair(|header, _| match header {
        b"short" => Action::ShortIovs,
        b"cuda" => Action::CudaIovs,
        b"many" => Action::TooManyIovs,
        b"bogus" => Action::Answer(42),
        _ => Action::Deliver { pieces: 3 },
    });
    let payload = random_bytes(&mut SmallRng::seed_from_u64(3), 100_000);
    for header in [
        &b"short"[..],
        b"ok-1",
        b"cuda",
        b"ok-2",
        b"many",
        b"ok-3",
        b"bogus",
        b"ok-4",
    ] {
        a.send(link, header, &[&payload]).unwrap();
    }
    let state = b.host.wait("eight messages", |s| s.received.len() == 8);
    let statuses: Vec<(&[u8], Option<i32>)> = state
        .received
        .iter()
        .map(|r| (&r.header[..], r.status))
        .collect();
    assert_eq!(
        statuses,
        [
            (&b"short"[..], Some(abi::TANDEM_KV_ERR_INVALID)),
            (b"ok-1", Some(0)),
            (b"cuda", Some(abi::TANDEM_KV_ERR_UNSUPPORTED)),
            (b"ok-2", Some(0)),
            (b"many", Some(abi::TANDEM_KV_ERR_INVALID)),
            (b"ok-3", Some(0)),
            (b"bogus", None),
            (b"ok-4", Some(0)),
        ]
    );
    for got in state
        .received
        .iter()
        .filter(|r| r.header.starts_with(b"ok"))
    {
        assert_eq!(got.payload.as_deref(), Some(&payload[..]));
    }
    assert!(
        state.closed.is_empty(),
        "the link survived: {:?}",
        state.closed
    );
    drop(state);
    assert_clean(&b);
}
