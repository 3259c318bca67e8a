//! `tandem cert`: a throwaway CA and certificates signed by it, for a test or laptop cluster (rcgen,
//! ECDSA P-256).
//!
//! `tandem cert --out DIR --hosts 127.0.0.1,localhost [--names node]` writes `DIR/ca.pem` and, for each
//! name, `DIR/NAME.pem` and `DIR/NAME-key.pem`: a certificate for every host given (IP addresses and
//! DNS names as subject alternative names), usable both as a server and as a client certificate, since
//! every component of a cluster is both. One shared `node` certificate serves a whole laptop cluster
//! (router, prefill, decode, etcd); `--names router,prefill,decode` gives each its own.
//!
//! Invariants:
//! - The CA's private key is never written: once the command returns, nothing can sign another
//!   certificate of this CA, so a directory of certificates is the whole trust domain.
//! - Existing files are never overwritten; key files are created readable by their owner only.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail, ensure};
use clap::Args;
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose};

/// `tandem cert`.
#[derive(Args, Debug)]
pub(crate) struct CertArgs {
    /// Directory to write ca.pem, NAME.pem and NAME-key.pem into (created if missing).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Hosts the certificates are valid for: IP addresses and DNS names, comma-separated (the
    /// addresses peers dial: --advertise hosts, the router's and etcd's hosts).
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1,localhost")]
    hosts: Vec<String>,
    /// One certificate per name, comma-separated (e.g. router,prefill,decode).
    #[arg(long, value_delimiter = ',', default_value = "node")]
    names: Vec<String>,
    /// Days the certificates (and the CA) stay valid.
    #[arg(long, default_value_t = 365)]
    days: u32,
}

/// A time `secs` seconds from the Unix epoch, as rcgen wants it.
fn at(secs: u64) -> anyhow::Result<time::OffsetDateTime> {
    time::OffsetDateTime::from_unix_timestamp(secs as i64).context("certificate validity out of range")
}

/// Writes `contents` to a new file `path` (never overwriting), owner-only when `secret`.
fn write_new(path: &Path, contents: &str, secret: bool) -> anyhow::Result<()> {
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(contents.as_bytes()).with_context(|| format!("writing {}", path.display()))
}

/// A throwaway CA's certificate and, per name, a certificate it signed with its key pair.
pub(crate) struct Issued {
    /// The CA certificate.
    pub(crate) ca: rcgen::Certificate,
    /// `(name, certificate, key)` per name.
    pub(crate) certs: Vec<(String, rcgen::Certificate, KeyPair)>,
}

/// Makes a CA valid for `days` (its key dropped on return) and one server-and-client certificate
/// for `hosts` per name.
pub(crate) fn issue(hosts: &[String], names: &[&str], days: u32) -> anyhow::Result<Issued> {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).context("the clock is before 1970")?;
    // An hour of slack for clocks that disagree a little.
    let not_before = at(now.as_secs().saturating_sub(3600))?;
    let not_after = at((now + Duration::from_secs(u64::from(days) * 86_400)).as_secs())?;

    let ca_key = KeyPair::generate().context("generating the CA key")?;
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name.push(DnType::CommonName, "tandem throwaway CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    ca_params.not_before = not_before;
    ca_params.not_after = not_after;
    let ca = ca_params.self_signed(&ca_key).context("signing the CA certificate")?;
    let issuer = Issuer::new(ca_params, ca_key);
    let mut certs = Vec::new();
    for n in names {
        let key = KeyPair::generate().with_context(|| format!("generating the key of {n}"))?;
        let mut params = CertificateParams::new(hosts.to_vec()).with_context(|| format!("--hosts {}", hosts.join(",")))?;
        params.distinguished_name.push(DnType::CommonName, format!("tandem {n}"));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = not_before;
        params.not_after = not_after;
        let cert = params.signed_by(&key, &issuer).with_context(|| format!("signing the certificate of {n}"))?;
        certs.push((n.to_string(), cert, key));
    }
    Ok(Issued { ca, certs })
}

pub(crate) fn run(args: CertArgs) -> anyhow::Result<()> {
    let hosts: Vec<String> = args.hosts.iter().map(|h| h.trim().to_string()).filter(|h| !h.is_empty()).collect();
    ensure!(!hosts.is_empty(), "--hosts names no host");
    ensure!(args.days >= 1, "--days must be at least 1");
    let mut names: Vec<&str> = args.names.iter().map(|n| n.trim()).collect();
    names.dedup();
    for n in &names {
        ensure!(
            !n.is_empty() && n != &"ca" && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            "--names: {n:?} is not a usable name (letters, digits, - and _; not \"ca\")"
        );
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let mut files = vec![args.out.join("ca.pem")];
    for n in &names {
        files.push(args.out.join(format!("{n}.pem")));
        files.push(args.out.join(format!("{n}-key.pem")));
    }
    if let Some(existing) = files.iter().find(|f| f.exists()) {
        bail!("{} exists already: choose another --out (tandem cert never overwrites)", existing.display());
    }
    let issued = issue(&hosts, &names, args.days)?;
    write_new(&files[0], &issued.ca.pem(), false)?;
    for (n, cert, key) in &issued.certs {
        write_new(&args.out.join(format!("{n}.pem")), &cert.pem(), false)?;
        write_new(&args.out.join(format!("{n}-key.pem")), &key.serialize_pem(), true)?;
    }
    for f in files {
        println!("{}", f.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(out: &Path, names: &[&str]) -> CertArgs {
        CertArgs {
            out: out.to_path_buf(),
            hosts: vec!["127.0.0.1".into(), "localhost".into()],
            names: names.iter().map(|s| s.to_string()).collect(),
            days: 1,
        }
    }

    #[test]
    fn certificates_load_as_cluster_tls_and_files_are_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        run(args(dir.path(), &["router", "node"])).unwrap();
        for n in ["router", "node"] {
            let files = tandem_node::tls::TlsFiles {
                cert: Some(dir.path().join(format!("{n}.pem"))),
                key: Some(dir.path().join(format!("{n}-key.pem"))),
                ca: Some(dir.path().join("ca.pem")),
            };
            assert!(tandem_node::tls::ClusterTls::load(&files).unwrap().is_some());
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("node-key.pem")).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "key readable by others: {mode:o}");
        }
        let again = run(args(dir.path(), &["node"])).unwrap_err().to_string();
        assert!(again.contains("exists already"), "{again}");
        assert!(run(args(dir.path(), &["ca"])).is_err());
    }

    #[test]
    fn a_certificate_of_another_ca_is_refused_at_load() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        run(args(a.path(), &["node"])).unwrap();
        run(args(b.path(), &["node"])).unwrap();
        let files = tandem_node::tls::TlsFiles {
            cert: Some(a.path().join("node.pem")),
            key: Some(a.path().join("node-key.pem")),
            ca: Some(b.path().join("ca.pem")),
        };
        let err = tandem_node::tls::ClusterTls::load(&files).unwrap_err();
        assert!(matches!(err, tandem_node::tls::TlsError::NotSignedByCa { .. }), "{err}");
        let files = tandem_node::tls::TlsFiles {
            cert: Some(a.path().join("node.pem")),
            key: Some(b.path().join("node-key.pem")),
            ca: Some(a.path().join("ca.pem")),
        };
        let err = tandem_node::tls::ClusterTls::load(&files).unwrap_err();
        assert!(matches!(err, tandem_node::tls::TlsError::KeyMismatch { .. }), "{err}");
    }
}
