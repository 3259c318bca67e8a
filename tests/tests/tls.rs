//! TLS and mutual TLS between every component, with certificates from `tandem cert`: etcd run with
//! TLS and `--client-cert-auth`, a router, a prefill node and a decode node as real processes, all
//! with `--tls-cert/--tls-key/--tls-ca`. A request through the router is answered with the greedy
//! tokens of `tandem generate` (the reference the plain cluster is tested against in cluster.rs) and
//! its KV crossed the TLS link; clients without the CA, node API callers without a certificate of the
//! cluster CA, and etcd clients without a certificate are refused; bad TLS flags exit non-zero naming
//! the flag.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tandem_membership::{EtcdOptions, EtcdTls, Membership};
use tandem_proto::node::v1 as node;
use tandem_proto::node::v1::decode_client::DecodeClient;
use tandem_tests::cluster::{START, node_args};
use tandem_tests::etcd::{EtcdServer, EtcdTlsFiles};
use tandem_tests::process::Proc;
use tandem_tests::{run_tandem, smollm2_dir};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

const LIMIT: Duration = Duration::from_secs(300);

/// `tandem cert --out DIR` (hosts 127.0.0.1 and localhost, one shared `node` certificate).
fn make_certs(dir: &Path) {
    let out = run_tandem(&["cert", "--out", dir.to_str().unwrap(), "--hosts", "127.0.0.1,localhost"], LIMIT);
    assert!(out.status.success(), "tandem cert: {}", String::from_utf8_lossy(&out.stderr));
    for f in ["ca.pem", "node.pem", "node-key.pem"] {
        assert!(dir.join(f).is_file(), "tandem cert did not write {f}");
    }
}

struct Certs {
    dir: PathBuf,
}

impl Certs {
    fn path(&self, name: &str) -> String {
        self.dir.join(name).to_str().unwrap().to_string()
    }
    fn pem(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.join(name)).unwrap()
    }
    fn flags(&self) -> Vec<String> {
        ["--tls-cert", &self.path("node.pem"), "--tls-key", &self.path("node-key.pem"), "--tls-ca", &self.path("ca.pem")]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }
}

fn stdout_of(args: &[&str]) -> String {
    let out = run_tandem(args, LIMIT);
    assert!(out.status.success(), "tandem {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Runs `tandem ARGS` expecting failure; returns stderr (which must be one clean error, no panic).
fn failure_of(args: &[&str]) -> String {
    let out = run_tandem(args, LIMIT);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "tandem {args:?} succeeded: {}", String::from_utf8_lossy(&out.stdout));
    assert!(!stderr.contains("panicked"), "tandem {args:?} panicked: {stderr}");
    stderr
}

fn client_tls(ca: Vec<u8>, identity: Option<(Vec<u8>, Vec<u8>)>) -> ClientTlsConfig {
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
    if let Some((c, k)) = identity {
        tls = tls.identity(Identity::from_pem(c, k));
    }
    tls
}

/// An `Info` call to a node over `tls` (`None`: plaintext).
async fn info(addr: &str, tls: Option<ClientTlsConfig>) -> Result<node::InfoResponse, String> {
    let endpoint = match tls {
        Some(t) => Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(t).map_err(|e| e.to_string())?,
        None => Endpoint::from_shared(format!("http://{addr}")).unwrap(),
    };
    let channel = endpoint.connect_timeout(Duration::from_secs(5)).timeout(Duration::from_secs(10)).connect().await.map_err(|e| format!("{e:?}"))?;
    DecodeClient::new(channel).info(node::InfoRequest {}).await.map(|r| r.into_inner()).map_err(|s| format!("{s:?}"))
}

/// A `Decode.Generate` call to a node over `tls` (`None`: plaintext): whether it started a stream.
async fn generate(addr: &str, tls: Option<ClientTlsConfig>) -> Result<(), String> {
    let endpoint = match tls {
        Some(t) => Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(t).map_err(|e| e.to_string())?,
        None => Endpoint::from_shared(format!("http://{addr}")).unwrap(),
    };
    let channel = endpoint.connect_timeout(Duration::from_secs(5)).timeout(Duration::from_secs(10)).connect().await.map_err(|e| format!("{e:?}"))?;
    let req = node::DecodeRequest {
        request_id: "tls-intruder".into(),
        prompt: vec![1, 2, 3, 4],
        sampling: Some(Default::default()),
        ..Default::default()
    };
    DecodeClient::new(channel).generate(req).await.map(|_| ()).map_err(|s| format!("{s:?}"))
}

/// Waits until the router's `tandem.v1.Tandem` health is SERVING over TLS (it sees a decode node).
async fn wait_router_serving(addr: &str, ca: Vec<u8>) {
    let deadline = Instant::now() + START;
    loop {
        let endpoint = Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(client_tls(ca.clone(), None)).unwrap();
        if let Ok(channel) = endpoint.connect().await {
            let req = HealthCheckRequest { service: "tandem.v1.Tandem".into() };
            if let Ok(r) = HealthClient::new(channel).check(req).await
                && r.into_inner().status == 1
            {
                return;
            }
        }
        assert!(Instant::now() < deadline, "the router did not become SERVING over TLS");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tls_cluster_serves_members_and_refuses_everyone_else() {
    let (dir, other_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    make_certs(dir.path());
    make_certs(other_dir.path());
    let (certs, other) = (Certs { dir: dir.path().to_path_buf() }, Certs { dir: other_dir.path().to_path_buf() });
    let etcd = tokio::task::block_in_place(|| {
        EtcdServer::start_tls(EtcdTlsFiles { ca: certs.dir.join("ca.pem"), cert: certs.dir.join("node.pem"), key: certs.dir.join("node-key.pem") })
    });
    let endpoint = etcd.endpoint();
    assert!(endpoint.starts_with("https://"), "{endpoint}");
    let prefix = "/tls-test";
    let tls = certs.flags();
    let tls: Vec<&str> = tls.iter().map(String::as_str).collect();
    let model = smollm2_dir();
    let model = model.to_str().unwrap();

    // Every process reaches etcd over TLS with the cluster's certificate (https:// reuses --tls-*).
    let mut router_args = vec!["router", "--etcd", &endpoint, "--cluster-prefix", prefix, "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"];
    router_args.extend_from_slice(&tls);
    let mut router = Proc::start("router", &router_args);
    let addr = router.wait_serving(START);
    let https = router.wait_line("OpenAI API on https://", START);
    let https = https.rsplit("OpenAI API on https://").next().unwrap().trim().trim_end_matches("/v1").to_string();
    let mut prefill = Proc::start("prefill", &node_args("prefill", &endpoint, prefix, model, &tls));
    let mut decode_extra = vec!["--local-prefill-below", "0"];
    decode_extra.extend_from_slice(&tls);
    let mut decode = Proc::start("decode", &node_args("decode", &endpoint, prefix, model, &decode_extra));
    prefill.wait_serving(START);
    let decode_addr = decode.wait_serving(START);

    // Membership over TLS with a client certificate lists both nodes; without one etcd refuses.
    let ca = certs.pem("ca.pem");
    let with_cert = EtcdTls { ca_pem: ca.clone(), identity: Some((certs.pem("node.pem"), certs.pem("node-key.pem"))) };
    let membership = Membership::etcd(std::slice::from_ref(&endpoint), prefix, EtcdOptions { tls: Some(with_cert), ..Default::default() })
        .await
        .expect("etcd over TLS with a client certificate");
    let mut nodes = membership.watch().await.expect("watch");
    tokio::time::timeout(START, nodes.wait_for(|n| n.len() == 2)).await.expect("both nodes registered").expect("watch open");
    let without_cert = EtcdTls { ca_pem: ca.clone(), identity: None };
    let opts = EtcdOptions { tls: Some(without_cert), request_timeout: Duration::from_secs(2), ..Default::default() };
    assert!(Membership::etcd(std::slice::from_ref(&endpoint), prefix, opts).await.is_err(), "etcd served a client without a certificate");
    let opts = EtcdOptions { request_timeout: Duration::from_secs(2), ..Default::default() };
    assert!(Membership::etcd(&[endpoint.replace("https://", "http://")], prefix, opts).await.is_err(), "etcd answered plaintext");

    // Through the router over TLS: the greedy tokens of one process, with the KV over the TLS link.
    wait_router_serving(&addr, ca.clone()).await;
    let prompt = "Tell me about the history of the lighthouse and the people who kept it lit through storms.";
    let expected = tokio::task::block_in_place(|| stdout_of(&["generate", "--model", model, "--max-tokens", "24", prompt]));
    let ca_path = certs.path("ca.pem");
    let got = tokio::task::block_in_place(|| stdout_of(&["client", "--router", &addr, "--tls-ca", &ca_path, "--max-tokens", "24", prompt]));
    assert_eq!(got.trim_end(), expected.trim_end());
    assert!(prefill.stderr_shows("transfer_bytes", Duration::from_secs(10)), "not prefilled remotely:\n{}", prefill.stderr());
    assert!(!decode.stderr().contains("remote prefill failed"), "{}", decode.stderr());

    // The OpenAI API is HTTPS with the router's certificate, no client certificate needed.
    let curl = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "20", "--cacert", &ca_path, &format!("https://{https}/v1/models")])
        .output()
        .expect("curl");
    assert!(curl.status.success(), "curl over HTTPS: {}", String::from_utf8_lossy(&curl.stderr));
    assert!(String::from_utf8_lossy(&curl.stdout).contains("smollm2"), "{}", String::from_utf8_lossy(&curl.stdout));
    let plain = std::process::Command::new("curl").args(["-sS", "--max-time", "20", &format!("http://{https}/v1/models")]).output().expect("curl");
    assert!(!String::from_utf8_lossy(&plain.stdout).contains("smollm2"), "plaintext HTTP was served");

    // Clients without the CA fail cleanly: plaintext, and TLS that trusts another CA.
    tokio::task::block_in_place(|| {
        failure_of(&["client", "--router", &addr, "--max-tokens", "4", prompt]);
        let other_ca = other.path("ca.pem");
        let err = failure_of(&["client", "--router", &addr, "--tls-ca", &other_ca, "--max-tokens", "4", prompt]);
        assert!(err.starts_with("error:"), "{err}");
    });

    // The node API: only callers with a certificate of the cluster CA.
    let member = Some((certs.pem("node.pem"), certs.pem("node-key.pem")));
    let info_ok = info(&decode_addr, Some(client_tls(ca.clone(), member))).await.expect("a member calls Info");
    assert_eq!(info_ok.role, "decode");
    let outsiders: Vec<(&str, Option<ClientTlsConfig>)> = vec![
        ("plaintext", None),
        ("TLS without a client certificate", Some(client_tls(ca.clone(), None))),
        ("a certificate of another CA", Some(client_tls(ca.clone(), Some((other.pem("node.pem"), other.pem("node-key.pem")))))),
    ];
    for (who, tls) in outsiders {
        generate(&decode_addr, tls.clone()).await.expect_err(who);
        assert!(info(&decode_addr, tls).await.is_err(), "{who}: Info answered");
    }
    // The node is unharmed: the router still gets answers through it.
    let again = tokio::task::block_in_place(|| stdout_of(&["client", "--router", &addr, "--tls-ca", &ca_path, "--max-tokens", "24", prompt]));
    assert_eq!(again.trim_end(), expected.trim_end());
    drop((router, prefill, decode, etcd));
}

#[test]
fn bad_tls_flags_exit_non_zero_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path());
    let certs = Certs { dir: dir.path().to_path_buf() };
    let (cert, key, ca) = (certs.path("node.pem"), certs.path("node-key.pem"), certs.path("ca.pem"));
    let etcd = ["--etcd", "http://127.0.0.1:1"];
    let model = ["--model", "smollm2-135m-instruct"];
    // A certificate without its key (or the CA): clap's usage error, exit 2, the missing flag named.
    for (given, missing) in [(vec!["--tls-cert", cert.as_str()], "--tls-key"), (vec!["--tls-key", key.as_str()], "--tls-cert"), (vec!["--tls-cert", &cert, "--tls-key", &key], "--tls-ca")] {
        let mut args = vec!["router"];
        args.extend_from_slice(&etcd);
        args.extend_from_slice(&given);
        let out = run_tandem(&args, LIMIT);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(missing), "{args:?}: {stderr}");
    }
    let out = run_tandem(&["client", "--router", "127.0.0.1:1", "--tls-cert", cert.as_str(), "hi"], LIMIT);
    assert_eq!(out.status.code(), Some(2), "client --tls-cert alone");

    // Unreadable or malformed files fail before anything binds or loads, naming the flag.
    let missing = dir.path().join("nope.pem");
    let missing = missing.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--tls-cert", missing, "--tls-key", &key, "--tls-ca", &ca], "--tls-cert"),
        (vec!["--tls-cert", &cert, "--tls-key", missing, "--tls-ca", &ca], "--tls-key"),
        (vec!["--tls-cert", &cert, "--tls-key", &key, "--tls-ca", missing], "--tls-ca"),
        (vec!["--tls-cert", &key, "--tls-key", &key, "--tls-ca", &ca], "--tls-cert"),
        (vec!["--tls-cert", &cert, "--tls-key", &cert, "--tls-ca", &ca], "--tls-key"),
        (vec!["--tls-cert", &cert, "--tls-key", &key, "--tls-ca", &key], "--tls-ca"),
    ];
    for (flags, named) in &cases {
        for role in ["router", "prefill", "decode"] {
            let mut args = vec![role];
            args.extend_from_slice(&etcd);
            if role != "router" {
                args.extend_from_slice(&model);
            }
            args.extend_from_slice(flags);
            args.push("--check");
            let err = failure_of(&args);
            assert!(err.contains(named), "{args:?} does not name {named}: {err}");
        }
        let mut args = vec!["up", "--check"];
        args.extend_from_slice(&model);
        args.extend_from_slice(flags);
        let err = failure_of(&args);
        assert!(err.contains(named), "{args:?} does not name {named}: {err}");
    }
    // The same without --check: the router exits before reaching etcd.
    let mut args = vec!["router"];
    args.extend_from_slice(&etcd);
    args.extend_from_slice(&cases[0].0);
    assert!(failure_of(&args).contains("--tls-cert"));
    // An https:// etcd with no CA at all, and an --etcd-ca that is not there.
    let err = failure_of(&["router", "--etcd", "https://127.0.0.1:1"]);
    assert!(err.contains("https://") && err.contains("CA"), "{err}");
    let err = failure_of(&["router", "--etcd", "https://127.0.0.1:1", "--etcd-ca", missing, "--check"]);
    assert!(err.contains("--etcd-ca"), "{err}");
    // A client whose --tls-ca is not there.
    let err = failure_of(&["client", "--router", "127.0.0.1:1", "--tls-ca", missing, "hi"]);
    assert!(err.contains("--tls-ca"), "{err}");

    // Good files pass --check on every server.
    let good = ["--tls-cert", cert.as_str(), "--tls-key", key.as_str(), "--tls-ca", ca.as_str()];
    for role in ["router", "prefill", "decode"] {
        let mut args = vec![role];
        args.extend_from_slice(&etcd);
        if role != "router" {
            args.extend_from_slice(&model);
        }
        args.extend_from_slice(&good);
        args.push("--check");
        assert!(stdout_of(&args).contains("command line ok"), "{args:?}");
    }
}
