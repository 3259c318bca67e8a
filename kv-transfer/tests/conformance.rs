//! The one conformance suite, run against every backend: TCP and in-process here, the example plugin
//! (`examples/kv-uds`, loaded only through the C ABI) in `plugin_conformance.rs`.

use tandem_kv_transfer::ConnectorSpec;
use tandem_kv_transfer::conformance::Suite;

macro_rules! conformance {
    ($backend:ident, $spec:expr, $follow:expr, [$($case:ident),* $(,)?]) => {
        mod $backend {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    let spec: ConnectorSpec = $spec.parse().unwrap();
                    let suite = Suite::new(spec);
                    let suite = if $follow { suite.with_sums_following() } else { suite };
                    if let Err(e) = suite.run_case(stringify!($case)).await {
                        panic!("{} / {}: {e}", stringify!($backend), stringify!($case));
                    }
                }
            )*
        }
    };
}

macro_rules! all_cases {
    ($backend:ident, $spec:expr, $follow:expr) => {
        conformance!($backend, $spec, $follow, [
            round_trip_bit_exact,
            layers_land_in_order,
            concurrent_64,
            zero_block_transfer,
            sender_cancel_frees_both_sides,
            receiver_cancel_frees_both_sides,
            receiver_disappears,
            sender_disappears,
            corrupted_chunk_detected,
            truncated_chunk_detected,
            duplicated_chunk_detected,
            reordered_chunk_detected,
            foreign_chunk_detected,
            handshake_mismatch_refused,
            unknown_destination_fails_fast,
            unknown_transfer_rejected,
            other_content_refused,
            receiver_timeout_frees_blocks,
            large_transfer_256mib,
        ]);
    };
}

all_cases!(tcp, "tcp", false);
all_cases!(inproc, "inproc", false);
// Senders announcing chunks before they sum them (protocol 3, what device senders always do), over
// real sockets: the late checksums go through the same checks.
all_cases!(tcp_sums_follow, "tcp", true);

/// The macro above must list every case the suite has.
#[test]
fn every_case_is_listed() {
    let src = include_str!("conformance.rs");
    for case in tandem_kv_transfer::conformance::CASES {
        assert!(src.contains(&format!("            {case},")), "case {case} is not run by this file");
    }
}
