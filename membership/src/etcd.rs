//! The etcd backend: connection settings, request bounds and retry backoff shared by the
//! registration task ([`registrar`]) and the watch task ([`watcher`]).
//!
//! Layout in etcd: each node is the key `<cluster_prefix>/nodes/<id>` whose value is the node's
//! [`NodeInfo`] as JSON, attached to a lease owned by that node's registration.
//!
//! Invariants:
//! - Every etcd request made here is bounded by [`EtcdOptions::request_timeout`]; an unanswered
//!   request is a [`Error::Timeout`], never a hang.
//! - After any failure a background task builds a fresh client before retrying (tonic's balanced
//!   channel can stay wedged on an endpoint that went away), and waits with exponential backoff
//!   (100 ms doubling to [`EtcdOptions::max_backoff`], with jitter) between attempts.
//! - Background tasks never end on an etcd error; they end only when their owner is dropped
//!   (or, for a registration, deregistered).

pub(crate) mod registrar;
pub(crate) mod watcher;

use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions};
use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::node::{Load, NodeInfo};

pub(crate) use registrar::RegistrationTask;

/// The shortest retry pause; backoff doubles from here up to [`EtcdOptions::max_backoff`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);
/// HTTP/2 ping interval on etcd connections, to notice a silently dead peer. etcd closes
/// connections that ping more often than every 5 s (`--grpc-keepalive-min-time`).
const HTTP2_PING_INTERVAL: Duration = Duration::from_secs(10);
/// How long an HTTP/2 ping may go unanswered before the connection is dropped.
const HTTP2_PING_TIMEOUT: Duration = Duration::from_secs(5);

/// Settings of the etcd backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdOptions {
    /// Lease TTL of a registration: a node that stops renewing (crash, partition) disappears
    /// within about this long. Whole seconds, at least 1 s; etcd raises a TTL below its own
    /// minimum (2 s with default server settings). Keep-alives go out every `ttl / 3`.
    /// Default 5 s.
    pub ttl: Duration,
    /// Bound on every single etcd request and on TCP connects. Default 2 s.
    pub request_timeout: Duration,
    /// Longest pause between two reconnection attempts. Default 2 s.
    pub max_backoff: Duration,
    /// TLS toward etcd (`https://` endpoints); `None`: plain `http://`. Default `None`.
    pub tls: Option<EtcdTls>,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        Self { ttl: Duration::from_secs(5), request_timeout: Duration::from_secs(2), max_backoff: Duration::from_secs(2), tls: None }
    }
}

/// TLS toward etcd: the CA its server certificate must chain to (it is also checked against the
/// endpoint's host) and, for an etcd run with `--client-cert-auth`, a client certificate and key. PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// The CA certificate(s).
    pub ca_pem: Vec<u8>,
    /// This client's certificate and private key, if etcd asks for one.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls").field("client_cert", &self.identity.is_some()).finish_non_exhaustive()
    }
}

impl EtcdTls {
    fn options(&self) -> etcd_client::TlsOptions {
        let mut tls = etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(&self.ca_pem));
        if let Some((cert, key)) = &self.identity {
            tls = tls.identity(etcd_client::Identity::from_pem(cert, key));
        }
        tls
    }
}

/// Refuses endpoints whose scheme does not match the TLS settings (an `https://` endpoint without a
/// CA, or TLS settings with an `http://` endpoint): never a silent plaintext connection.
fn check_schemes(endpoints: &[String], tls: bool) -> Result<()> {
    for e in endpoints {
        if tls && e.starts_with("http://") {
            return Err(Error::InvalidOptions(format!("etcd endpoint {e:?} is http:// but TLS is configured: use https://")));
        }
        if !tls && e.starts_with("https://") {
            return Err(Error::InvalidOptions(format!("etcd endpoint {e:?} is https:// but no CA is configured to verify it")));
        }
    }
    Ok(())
}

impl EtcdOptions {
    fn validate(&self) -> Result<()> {
        if self.ttl < Duration::from_secs(1) || self.ttl.subsec_nanos() != 0 || self.ttl.as_secs() > i64::MAX as u64 {
            return Err(Error::InvalidOptions(format!("ttl must be a whole number of seconds, at least 1 s (got {:?})", self.ttl)));
        }
        if self.request_timeout.is_zero() {
            return Err(Error::InvalidOptions("request_timeout must be positive".into()));
        }
        if self.max_backoff < MIN_BACKOFF {
            return Err(Error::InvalidOptions(format!("max_backoff must be at least {MIN_BACKOFF:?} (got {:?})", self.max_backoff)));
        }
        Ok(())
    }
}

/// The etcd backend: a client plus what is needed to build new ones.
#[derive(Clone)]
pub(crate) struct EtcdMembership {
    conn: Arc<Connector>,
    client: Client,
}

impl std::fmt::Debug for EtcdMembership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdMembership").field("conn", &self.conn).finish_non_exhaustive()
    }
}

impl EtcdMembership {
    /// Connects and checks that etcd answers (one bounded range request on the prefix).
    pub(crate) async fn connect(endpoints: &[String], cluster_prefix: &str, opts: EtcdOptions) -> Result<Self> {
        opts.validate()?;
        if endpoints.is_empty() {
            return Err(Error::InvalidOptions("no etcd endpoints".into()));
        }
        check_schemes(endpoints, opts.tls.is_some())?;
        let trimmed = cluster_prefix.trim_end_matches('/');
        if trimmed.is_empty() {
            return Err(Error::InvalidPrefix { prefix: cluster_prefix.to_owned(), reason: "empty" });
        }
        let conn = Arc::new(Connector { endpoints: endpoints.to_vec(), nodes_prefix: format!("{trimmed}/nodes/"), opts });
        let mut client = conn.connect().await?;
        let probe = GetOptions::new().with_prefix().with_count_only();
        conn.bounded("get", client.get(conn.nodes_prefix.as_str(), Some(probe))).await?;
        Ok(Self { conn, client })
    }

    /// Registers `info` now (lease, key, keep-alive) and leaves a task keeping it registered.
    pub(crate) async fn register(&self, info: NodeInfo, load: watch::Receiver<Load>) -> Result<RegistrationTask> {
        RegistrationTask::start(Arc::clone(&self.conn), self.client.clone(), info, load).await
    }

    /// Lists the nodes now and leaves a task following changes into the returned receiver.
    pub(crate) async fn watch(&self) -> Result<watch::Receiver<Vec<NodeInfo>>> {
        watcher::start(Arc::clone(&self.conn), self.client.clone()).await
    }
}

/// Endpoints, key layout and options: everything needed to (re)connect.
#[derive(Debug)]
pub(crate) struct Connector {
    endpoints: Vec<String>,
    /// `<cluster_prefix>/nodes/`, with exactly one `/` before `nodes`.
    nodes_prefix: String,
    opts: EtcdOptions,
}

impl Connector {
    /// A new client (connections are made lazily, on the first request).
    pub(crate) async fn connect(&self) -> Result<Client> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.opts.request_timeout)
            .with_keep_alive(HTTP2_PING_INTERVAL, HTTP2_PING_TIMEOUT);
        if let Some(tls) = &self.opts.tls {
            options = options.with_tls(tls.options());
        }
        self.bounded("connect", Client::connect(&self.endpoints, Some(options))).await
    }

    /// The key of node `id`.
    pub(crate) fn node_key(&self, id: &str) -> String {
        format!("{}{id}", self.nodes_prefix)
    }

    /// Runs one etcd request under the request timeout.
    pub(crate) async fn bounded<T>(
        &self,
        op: &'static str,
        request: impl Future<Output = std::result::Result<T, etcd_client::Error>>,
    ) -> Result<T> {
        let after = self.opts.request_timeout;
        match tokio::time::timeout(after, request).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(source)) => Err(Error::Etcd { op, source }),
            Err(_) => Err(Error::Timeout { op, after }),
        }
    }

    pub(crate) fn backoff(&self) -> Backoff {
        Backoff { next: MIN_BACKOFF, max: self.opts.max_backoff }
    }
}

/// Exponential backoff with jitter: each pause is in `[d/2, d)` where `d` doubles from
/// [`MIN_BACKOFF`] to the maximum.
#[derive(Debug)]
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub(crate) fn reset(&mut self) {
        self.next = MIN_BACKOFF;
    }

    pub(crate) fn next_pause(&mut self) -> Duration {
        let full = self.next;
        self.next = (self.next * 2).min(self.max);
        // Jitter spreads the reconnections of many nodes after an etcd restart. std's RandomState
        // is freshly keyed per instance, which is random enough for this.
        let noise = RandomState::new().build_hasher().finish() % 1000;
        full.mul_f64(0.5 + noise as f64 / 2000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_validated() {
        assert!(EtcdOptions::default().validate().is_ok());
        let bad = [
            EtcdOptions { ttl: Duration::from_millis(500), ..Default::default() },
            EtcdOptions { ttl: Duration::from_millis(2500), ..Default::default() },
            EtcdOptions { request_timeout: Duration::ZERO, ..Default::default() },
            EtcdOptions { max_backoff: Duration::from_millis(10), ..Default::default() },
        ];
        for opts in bad {
            assert!(matches!(opts.validate(), Err(Error::InvalidOptions(_))), "{opts:?}");
        }
    }

    #[test]
    fn endpoint_schemes_must_match_the_tls_settings() {
        let (plain, tls) = (vec!["http://127.0.0.1:2379".to_owned()], vec!["https://127.0.0.1:2379".to_owned()]);
        assert!(check_schemes(&plain, false).is_ok());
        assert!(check_schemes(&tls, true).is_ok());
        assert!(matches!(check_schemes(&plain, true), Err(Error::InvalidOptions(m)) if m.contains("http://")));
        assert!(matches!(check_schemes(&tls, false), Err(Error::InvalidOptions(m)) if m.contains("no CA")));
    }

    #[test]
    fn backoff_doubles_to_the_cap_with_jitter_and_resets() {
        let mut backoff = Backoff { next: MIN_BACKOFF, max: Duration::from_millis(1000) };
        let expected_caps = [100, 200, 400, 800, 1000, 1000];
        for cap in expected_caps {
            let pause = backoff.next_pause();
            let cap = Duration::from_millis(cap);
            assert!(pause >= cap / 2 && pause < cap, "{pause:?} not in [{:?}, {cap:?})", cap / 2);
        }
        backoff.reset();
        assert!(backoff.next_pause() < MIN_BACKOFF);
    }

    #[tokio::test]
    async fn bad_arguments_are_typed_errors() {
        let endpoints = vec!["http://127.0.0.1:1".to_owned()];
        let err = EtcdMembership::connect(&endpoints, "/", EtcdOptions::default()).await.unwrap_err();
        assert!(matches!(err, Error::InvalidPrefix { .. }), "{err}");
        let err = EtcdMembership::connect(&[], "tandem", EtcdOptions::default()).await.unwrap_err();
        assert!(matches!(err, Error::InvalidOptions(_)), "{err}");
        let err = EtcdMembership::connect(&["not a url".to_owned()], "tandem", EtcdOptions::default()).await.unwrap_err();
        assert!(matches!(err, Error::Etcd { op: "connect", .. }), "{err}");
    }

    #[tokio::test]
    async fn an_unreachable_etcd_is_an_error_within_the_timeout() {
        // Port 1 on loopback: nothing listens, the connect is refused.
        let opts = EtcdOptions { request_timeout: Duration::from_millis(500), ..Default::default() };
        let started = std::time::Instant::now();
        let err = EtcdMembership::connect(&["http://127.0.0.1:1".to_owned()], "tandem", opts).await.unwrap_err();
        assert!(matches!(err, Error::Etcd { op: "get", .. } | Error::Timeout { op: "get", .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
    }
}
