//! Sending one benchmark request and timing it: over tandem's gRPC API (`tandem.v1.Tandem/Generate`,
//! the prompt as token ids) or the OpenAI HTTP API (`POST /v1/completions`, streamed as server-sent
//! events with `stream_options.include_usage`, the prompt as a token-id list). Both ask for greedy
//! sampling with `ignore_eos`, so the answer has exactly the asked length.
//!
//! Invariants:
//! - Every request ends as one [`RequestRecord`]: measured, or with an error kind and message; nothing
//!   here panics or returns early without one.
//! - Times are taken where bytes arrive: TTFT at the first message (gRPC) or SSE chunk (HTTP) that
//!   carries a token, each inter-token gap between consecutive ones.
//! - The HTTP client is hyper's HTTP/1 connection (plain TCP, no TLS) with Nagle off; connections are
//!   kept alive and reused, one request at a time each, as a pooled client would. gRPC requests share
//!   a few HTTP/2 connections.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tandem_proto::v1 as api;
use tandem_proto::v1::tandem_client::TandemClient;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

use super::stats::RequestRecord;
use super::workload::RequestSpec;

/// gRPC connections a benchmark opens (hyper's HTTP/2 server allows 200 streams per connection).
const GRPC_CONNECTIONS: usize = 8;

/// Where requests go.
#[derive(Clone)]
pub(crate) enum Target {
    /// A router's gRPC API, over a few HTTP/2 connections (request `i` on connection `i % n`), so
    /// a server's per-connection stream limit does not queue requests on the client.
    Grpc { channels: Arc<Vec<Channel>>, model: String },
    /// A router's OpenAI HTTP API.
    Http(Arc<HttpTarget>),
}

/// The OpenAI API's address and a pool of idle connections to it.
pub(crate) struct HttpTarget {
    /// HOST:PORT to connect to.
    addr: String,
    /// The completions path (`/v1/completions` under the base URL's path).
    path: String,
    model: Option<String>,
    idle: Mutex<Vec<http1::SendRequest<Full<Bytes>>>>,
}

impl Target {
    /// A gRPC target at `addr` (HOST:PORT); connects lazily, on the first request.
    pub(crate) fn grpc(addr: &str, model: &str) -> anyhow::Result<Target> {
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .with_context(|| format!("--router {addr:?}"))?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true);
        let channels = (0..GRPC_CONNECTIONS).map(|_| endpoint.connect_lazy()).collect();
        Ok(Target::Grpc { channels: Arc::new(channels), model: model.to_string() })
    }

    /// An HTTP target at `base_url` (`http://HOST:PORT[/PREFIX]`, with or without a trailing `/v1`).
    pub(crate) fn http(base_url: &str, model: &str) -> anyhow::Result<Target> {
        let Some(rest) = base_url.strip_prefix("http://") else {
            bail!("--base-url {base_url:?}: want http://HOST:PORT (no TLS)");
        };
        let (addr, prefix) = rest.split_once('/').map(|(a, p)| (a, format!("/{p}"))).unwrap_or((rest, String::new()));
        if addr.is_empty() || !addr.contains(':') {
            bail!("--base-url {base_url:?}: want http://HOST:PORT");
        }
        let prefix = prefix.trim_end_matches('/');
        let prefix = prefix.strip_suffix("/v1").unwrap_or(prefix);
        Ok(Target::Http(Arc::new(HttpTarget {
            addr: addr.to_string(),
            path: format!("{prefix}/v1/completions"),
            model: (!model.is_empty()).then(|| model.to_string()),
            idle: Mutex::new(Vec::new()),
        })))
    }

    /// Sends `spec`, waits at most `limit` for the whole answer, and records what happened.
    pub(crate) async fn send(&self, index: usize, sent_s: f64, spec: &RequestSpec, limit: Duration) -> RequestRecord {
        let mut rec = RequestRecord {
            index,
            sent_s,
            prompt_len: spec.prompt.len(),
            output_len: spec.output_len,
            prompt_tokens: None,
            cached_tokens: None,
            output_tokens: None,
            ttft_ms: None,
            itl_ms: Vec::new(),
            e2e_ms: None,
            error: None,
            error_message: None,
        };
        let start = Instant::now();
        let mut clock = Clock { start, last: None };
        let outcome = tokio::time::timeout(limit, async {
            match self {
                Target::Grpc { channels, model } => grpc(channels[index % channels.len()].clone(), model, spec, &mut rec, &mut clock).await,
                Target::Http(t) => t.send(spec, &mut rec, &mut clock).await,
            }
        })
        .await;
        let failure = match outcome {
            Err(_) => Some(("timeout".to_string(), format!("no complete answer within {} s", limit.as_secs_f64()))),
            Ok(Err(f)) => Some((f.kind, f.message)),
            Ok(Ok(())) => None,
        };
        match failure {
            Some((kind, message)) => {
                rec.error = Some(kind);
                rec.error_message = Some(message);
            }
            None => {
                rec.e2e_ms = Some(ms(start.elapsed()));
                if rec.ttft_ms.is_none() {
                    rec.error = Some("protocol".into());
                    rec.error_message = Some("the answer carried no token".into());
                }
            }
        }
        rec
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Token arrival times of one request.
struct Clock {
    start: Instant,
    last: Option<Instant>,
}

impl Clock {
    /// A message carrying tokens arrived now.
    fn token(&mut self, rec: &mut RequestRecord) {
        let now = Instant::now();
        match self.last {
            None => rec.ttft_ms = Some(ms(now - self.start)),
            Some(prev) => rec.itl_ms.push(ms(now - prev)),
        }
        self.last = Some(now);
    }
}

/// Why a request failed: a kind (grouped in the report) and a message.
struct Failure {
    kind: String,
    message: String,
}

impl Failure {
    fn new(kind: impl Into<String>, message: impl std::fmt::Display) -> Failure {
        Failure { kind: kind.into(), message: message.to_string() }
    }
}

fn status_failure(s: &tonic::Status) -> Failure {
    let kind = if s.code() == tonic::Code::Unknown && s.message().contains("transport") { "transport".into() } else { format!("{:?}", s.code()) };
    Failure::new(kind, s.message())
}

async fn grpc(channel: Channel, model: &str, spec: &RequestSpec, rec: &mut RequestRecord, clock: &mut Clock) -> Result<(), Failure> {
    let req = api::GenerateRequest {
        model: model.to_string(),
        prompt: Some(api::generate_request::Prompt::TokenIds(api::TokenIds { ids: spec.prompt.clone() })),
        sampling: Some(api::SamplingParams {
            max_tokens: Some(spec.output_len as u32),
            temperature: Some(0.0),
            ignore_eos: true,
            ..Default::default()
        }),
        request_id: String::new(),
    };
    let mut stream = TandemClient::new(channel).generate(req).await.map_err(|s| status_failure(&s))?.into_inner();
    let mut finished = false;
    while let Some(msg) = stream.next().await {
        let msg = msg.map_err(|s| status_failure(&s))?;
        if !msg.token_ids.is_empty() {
            clock.token(rec);
        }
        if let Some(u) = msg.usage {
            rec.prompt_tokens = Some(u.prompt_tokens);
            rec.cached_tokens = Some(u.cached_tokens);
            rec.output_tokens = Some(u.completion_tokens);
        }
        finished |= msg.finish_reason != api::FinishReason::Unspecified as i32;
    }
    if !finished {
        return Err(Failure::new("protocol", "the stream ended without a finish reason"));
    }
    Ok(())
}

impl HttpTarget {
    /// An idle connection, or a new one.
    async fn connection(&self) -> Result<http1::SendRequest<Full<Bytes>>, Failure> {
        loop {
            let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
            let Some(mut sender) = idle else { break };
            if sender.ready().await.is_ok() {
                return Ok(sender);
            }
        }
        let stream = tokio::net::TcpStream::connect(&self.addr).await.map_err(|e| Failure::new("transport", format!("connecting to {}: {e}", self.addr)))?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = http1::handshake(TokioIo::new(stream)).await.map_err(|e| Failure::new("transport", e))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    async fn send(&self, spec: &RequestSpec, rec: &mut RequestRecord, clock: &mut Clock) -> Result<(), Failure> {
        let mut body = serde_json::json!({
            "prompt": spec.prompt,
            "max_tokens": spec.output_len,
            "temperature": 0.0,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if let Some(m) = &self.model {
            body["model"] = m.clone().into();
        }
        let req = hyper::Request::post(&self.path)
            .header(hyper::header::HOST, &self.addr)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| Failure::new("protocol", e))?;
        let mut sender = self.connection().await?;
        let resp = sender.send_request(req).await.map_err(|e| Failure::new("transport", e))?;
        let status = resp.status();
        let mut body = resp.into_body();
        if !status.is_success() {
            let bytes = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            let text = String::from_utf8_lossy(&bytes);
            let message = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
                .unwrap_or_else(|| text.into_owned());
            return Err(Failure::new(format!("http {}", status.as_u16()), message));
        }
        let mut sse = SseParser::default();
        let mut done = false;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Failure::new("transport", e))?;
            let Some(data) = frame.data_ref() else { continue };
            for event in sse.push(data) {
                if event == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(&event).map_err(|e| Failure::new("protocol", format!("a chunk is not JSON ({e}): {event}")))?;
                if let Some(err) = v.get("error") {
                    let kind = err["type"].as_str().unwrap_or("error");
                    return Err(Failure::new(format!("stream {kind}"), err["message"].as_str().unwrap_or_default()));
                }
                if v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
                    clock.token(rec);
                }
                let usage = &v["usage"];
                if usage.is_object() {
                    let n = |x: &serde_json::Value| x.as_u64().map(|n| n as u32);
                    rec.prompt_tokens = n(&usage["prompt_tokens"]);
                    rec.output_tokens = n(&usage["completion_tokens"]);
                    rec.cached_tokens = n(&usage["prompt_tokens_details"]["cached_tokens"]);
                }
            }
        }
        if !done {
            return Err(Failure::new("protocol", "the stream ended without data: [DONE]"));
        }
        if rec.output_tokens.is_none() {
            return Err(Failure::new("protocol", "no usage chunk (stream_options.include_usage)"));
        }
        if !sender.is_closed() {
            self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(sender);
        }
        Ok(())
    }
}

/// Splits a server-sent event stream into the `data` of each event.
#[derive(Default)]
struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Feeds bytes; returns the data of every event they completed.
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        loop {
            let text_end = find_event_end(&self.buf);
            let Some((end, sep)) = text_end else { break };
            let raw: Vec<u8> = self.buf.drain(..end + sep).collect();
            let raw = String::from_utf8_lossy(&raw[..end]);
            let data: Vec<&str> = raw
                .lines()
                .filter_map(|l| l.strip_prefix("data:").map(|d| d.strip_prefix(' ').unwrap_or(d)))
                .collect();
            if !data.is_empty() {
                events.push(data.join("\n"));
            }
        }
        events
    }
}

/// Where the first event ends (a blank line) and the separator's length.
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_reads() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(p.push(b": 1}\n\ndata: [DONE]\n"), vec!["{\"a\": 1}".to_string()]);
        assert_eq!(p.push(b"\n"), vec!["[DONE]".to_string()]);
        assert_eq!(p.push(b": comment\n\ndata:x\r\n\r\n"), vec!["x".to_string()]);
    }

    #[test]
    fn base_urls() {
        for (url, addr, path) in [
            ("http://127.0.0.1:8000", "127.0.0.1:8000", "/v1/completions"),
            ("http://127.0.0.1:8000/v1", "127.0.0.1:8000", "/v1/completions"),
            ("http://h:1/api/v1/", "h:1", "/api/v1/completions"),
        ] {
            let Ok(Target::Http(t)) = Target::http(url, "") else { panic!("{url}") };
            assert_eq!((t.addr.as_str(), t.path.as_str()), (addr, path), "{url}");
        }
        for bad in ["https://h:1", "h:1", "http://h", "http://"] {
            assert!(Target::http(bad, "").is_err(), "{bad}");
        }
    }
}
