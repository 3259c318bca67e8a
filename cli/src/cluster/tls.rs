//! The TLS flags of the cluster's processes and how they become configurations (the loading and checks
//! themselves live in `tandem_node::tls`).
//!
//! - `--tls-cert FILE --tls-key FILE --tls-ca FILE` (router, prefill, decode, up; all three or none):
//!   node APIs serve mutual TLS, every call inside the cluster and every KV link over tcp is TLS with
//!   this certificate, verified against the CA; the router's client APIs (gRPC and OpenAI HTTP) serve
//!   TLS with the router's certificate and ask clients for no certificate (they use API keys).
//! - `--etcd-ca FILE [--etcd-cert FILE --etcd-key FILE]`: TLS toward etcd (`https://` endpoints; the
//!   client certificate for an etcd run with `--client-cert-auth`). Without them, `https://` endpoints
//!   reuse the cluster's `--tls-ca`, `--tls-cert` and `--tls-key`.
//! - `tandem client --tls-ca FILE [--tls-cert FILE --tls-key FILE]`: dial the router over TLS.
//!
//! Invariant: a flag without its partner, or a file that is missing, unreadable or malformed, fails
//! before anything binds, connects or loads, with the flag named.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use tandem_membership::EtcdTls;
use tandem_node::tls::{ClusterTls, TlsFiles, read_certificates, read_private_key};

/// `--tls-cert`, `--tls-key`, `--tls-ca` of a server.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct TlsArgs {
    /// This component's TLS certificate (PEM; from `tandem cert`, or your own CA's). Turns on TLS for
    /// every gRPC server and client of this process and mutual TLS for node APIs and KV over tcp.
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "tls_ca"])]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_ca"])]
    pub(crate) tls_key: Option<PathBuf>,
    /// The cluster CA (PEM): peers' certificates must chain to it.
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_key"])]
    pub(crate) tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The files loaded and checked; `None` without the flags.
    pub(crate) fn load(&self) -> anyhow::Result<Option<Arc<ClusterTls>>> {
        let files = TlsFiles { cert: self.tls_cert.clone(), key: self.tls_key.clone(), ca: self.tls_ca.clone() };
        Ok(ClusterTls::load(&files)?.map(Arc::new))
    }
}

/// `--etcd-ca`, `--etcd-cert`, `--etcd-key`.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct EtcdTlsArgs {
    /// CA of etcd's server certificate (PEM), for https:// endpoints [default: --tls-ca, when the
    /// endpoints are https://].
    #[arg(long, value_name = "FILE")]
    etcd_ca: Option<PathBuf>,
    /// Client certificate for an etcd run with --client-cert-auth (PEM) [default: --tls-cert, when
    /// --etcd-ca is not given].
    #[arg(long, value_name = "FILE", requires_all = ["etcd_key", "etcd_ca"])]
    etcd_cert: Option<PathBuf>,
    /// The private key of --etcd-cert (PEM).
    #[arg(long, value_name = "FILE", requires_all = ["etcd_cert", "etcd_ca"])]
    etcd_key: Option<PathBuf>,
}

impl EtcdTlsArgs {
    /// TLS toward etcd: the `--etcd-*` files, else the cluster's when every endpoint is `https://`.
    pub(crate) fn load(&self, endpoints: &[String], cluster: Option<&ClusterTls>) -> anyhow::Result<Option<EtcdTls>> {
        if let Some(ca) = &self.etcd_ca {
            let identity = match (&self.etcd_cert, &self.etcd_key) {
                (Some(c), Some(k)) => Some((read_certificates("--etcd-cert", c)?, read_private_key("--etcd-key", k)?)),
                _ => None,
            };
            return Ok(Some(EtcdTls { ca_pem: read_certificates("--etcd-ca", ca)?, identity }));
        }
        match cluster {
            Some(tls) if !endpoints.is_empty() && endpoints.iter().all(|e| e.starts_with("https://")) => {
                let (cert, key) = tls.identity_pem();
                Ok(Some(EtcdTls { ca_pem: tls.ca_pem().to_vec(), identity: Some((cert.to_vec(), key.to_vec())) }))
            }
            _ => Ok(None),
        }
    }
}

/// `tandem client`'s TLS flags.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct ClientTlsArgs {
    /// Dial the router over TLS, verifying its certificate against this CA (PEM).
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// A client certificate to present (PEM; the router does not ask for one, a node API does).
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_ca"])]
    tls_key: Option<PathBuf>,
}

impl ClientTlsArgs {
    /// The client configuration; `None` without `--tls-ca`.
    pub(crate) fn load(&self) -> anyhow::Result<Option<tonic::transport::ClientTlsConfig>> {
        let Some(ca) = &self.tls_ca else { return Ok(None) };
        let identity = self.tls_cert.as_deref().zip(self.tls_key.as_deref());
        Ok(Some(tandem_node::tls::client_config(ca, identity)?))
    }
}
