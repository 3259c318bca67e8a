//! A minimal blocking HTTP/1.1 client for tests that must see exactly what a server wrote (status,
//! headers, the body's bytes after de-chunking): one request per connection (`Connection: close`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A response as it came.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// The status code.
    pub status: u16,
    /// Header lines as (lower-case name, value).
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked.
    pub body: String,
}

impl HttpResponse {
    /// The first header called `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON; panics (with the body) if it is not.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// Sends `METHOD path` to `addr` (HOST:PORT) with an optional JSON body and reads the whole response.
/// Panics on any I/O error or a malformed response.
pub fn request(addr: &str, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
    request_with_headers(addr, method, path, &[], body)
}

/// [`request`] with extra request headers.
pub fn request_with_headers(addr: &str, method: &str, path: &str, extra: &[(&str, &str)], body: Option<&str>) -> HttpResponse {
    let mut stream =
        TcpStream::connect(addr).unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let body = body.unwrap_or("");
    let extra: String = extra.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n",
        body.len()
    );
    stream
        .write_all(head.as_bytes())
        .and_then(|_| stream.write_all(body.as_bytes()))
        .expect("sending the request");
    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    reader.read_line(&mut status_line).expect("status line");
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("header line");
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (name, value) = line
            .split_once(':')
            .unwrap_or_else(|| panic!("bad header {line:?}"));
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let mut raw = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size).expect("chunk size");
            let size = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
                .unwrap_or_else(|_| panic!("bad chunk size {size:?}"));
            let mut chunk = vec![0; size + 2];
            reader.read_exact(&mut chunk).expect("chunk");
            if size == 0 {
                break;
            }
            raw.extend_from_slice(&chunk[..size]);
        }
    } else {
        reader.read_to_end(&mut raw).expect("body");
    }
    HttpResponse {
        status,
        headers,
        body: String::from_utf8(raw).expect("UTF-8 body"),
    }
}
