//! What a hostile gRPC client sends the router (real etcd, router and decode node): every bad input
//! is a typed INVALID_ARGUMENT before anything is routed — an undecodable request (a prompt that is
//! not UTF-8), an oversized or unprintable request id, an unknown chat role, prompt text too long for
//! the context (refused by size, before tokenizing) — and the router keeps serving.

use std::time::{Duration, Instant};

use tandem_proto::v1 as api;
use tandem_proto::v1::tandem_client::TandemClient;
use tandem_tests::cluster::{Cluster, ClusterSpec};
use tandem_tests::http::request;
use tonic::Code;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;

/// `tandem.v1.GenerateRequest` with its text prompt (field 2) as raw bytes, so a test can send
/// what a conforming client never would.
#[derive(Clone, PartialEq, prost::Message)]
struct RawTextRequest {
    #[prost(bytes = "vec", tag = "2")]
    text: Vec<u8>,
}

fn text(prompt: String, request_id: &str) -> api::GenerateRequest {
    api::GenerateRequest {
        prompt: Some(api::generate_request::Prompt::Text(prompt)),
        sampling: Some(api::SamplingParams { max_tokens: Some(2), temperature: Some(0.0), ..Default::default() }),
        request_id: request_id.into(),
        ..Default::default()
    }
}

fn routed(http: &str) -> f64 {
    request(http, "GET", "/metrics", None)
        .body
        .lines()
        .filter(|l| l.starts_with("tandem:routing_decisions_total"))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

async fn unary(channel: &Channel, req: api::GenerateRequest) -> Result<api::GenerateUnaryResponse, tonic::Status> {
    TandemClient::new(channel.clone()).generate_unary(req).await.map(tonic::Response::into_inner)
}

#[test]
fn bad_client_input_is_invalid_argument_before_routing() {
    let c = Cluster::start("/tandem-test-router-input", ClusterSpec { decodes: 1, http: true, ..Default::default() });
    let http = c.http.clone().expect("HTTP listener");
    let deadline = Instant::now() + Duration::from_secs(60);
    while request(&http, "GET", "/health", None).status != 200 {
        assert!(Instant::now() < deadline, "the router never became healthy");
        std::thread::sleep(Duration::from_millis(100));
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let channel = rt.block_on(Channel::from_shared(format!("http://{}", c.addr)).expect("uri").connect()).expect("router");
    // Warm the router's model entry so every refusal below is the router's own check.
    rt.block_on(unary(&channel, text("Hello".into(), ""))).expect("a good request");
    let before = routed(&http);

    // A prompt that is not UTF-8 does not decode: INVALID_ARGUMENT, not INTERNAL.
    let status = rt
        .block_on(async {
            let mut grpc = tonic::client::Grpc::new(channel.clone());
            grpc.ready().await.expect("ready");
            let codec = tonic_prost::ProstCodec::<RawTextRequest, api::GenerateUnaryResponse>::default();
            let path = PathAndQuery::from_static("/tandem.v1.Tandem/GenerateUnary");
            grpc.unary(tonic::Request::new(RawTextRequest { text: vec![b'h', 0xff, 0xfe, b'i'] }), path, codec).await
        })
        .expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    let bad_ids = ["x".repeat(129), "two\nlines".to_string(), "tab\there".to_string(), "ünicode".to_string()];
    for id in &bad_ids {
        let s = rt.block_on(unary(&channel, text("Hello".into(), id))).expect_err("refused");
        assert_eq!(s.code(), Code::InvalidArgument, "{id:?}: {s:?}");
        assert!(s.message().contains("request_id"), "{s:?}");
        assert!(s.message().len() < 200, "the id is not echoed back: {s:?}");
    }

    for role in ["hacker", "", "User"] {
        let req = api::GenerateRequest {
            prompt: Some(api::generate_request::Prompt::Chat(api::Chat {
                messages: vec![api::ChatMessage { role: role.into(), content: "Hello".into() }],
            })),
            ..Default::default()
        };
        let s = rt.block_on(unary(&channel, req)).expect_err("refused");
        assert_eq!(s.code(), Code::InvalidArgument, "{role:?}: {s:?}");
        assert!(s.message().contains("role"), "{s:?}");
    }

    // 3 MiB of text for an 8k-token context: refused by its size (the message says bytes).
    let s = rt.block_on(unary(&channel, text("word ".repeat(600_000), ""))).expect_err("refused");
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(s.message().contains("bytes"), "{s:?}");
    // Token ids past the context: the same.
    let req = api::GenerateRequest {
        prompt: Some(api::generate_request::Prompt::TokenIds(api::TokenIds { ids: vec![1; 100_000] })),
        ..Default::default()
    };
    let s = rt.block_on(unary(&channel, req)).expect_err("refused");
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");

    assert_eq!(routed(&http), before, "a refused request was routed");
    // A client id at the limit is fine, and the router still serves.
    let out = rt.block_on(unary(&channel, text("Hello".into(), &"a".repeat(128)))).expect("served");
    assert_eq!(out.request_id, "a".repeat(128));
}
