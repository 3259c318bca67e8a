//! The conformance suite against the example third-party backend (`examples/kv-uds`), loaded only
//! through the C ABI by path, exactly as `--kv-connector plugin:/path/libtandem_kv_uds.so` would.

use std::path::PathBuf;
use std::process::Command;

use tandem_kv_transfer::conformance::{CASES, Suite};
use tandem_kv_transfer::{ConnectorSpec, Error};

/// The plugin built by this workspace for this test's profile; built on demand if missing.
fn plugin_path() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps/<test>");
    let lib = profile_dir.join(format!("{}tandem_kv_uds{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX));
    if !lib.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-p", "tandem-kv-uds"]);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("running cargo build -p tandem-kv-uds");
        assert!(status.success(), "building the example plugin failed");
    }
    assert!(lib.exists(), "{} missing after building it", lib.display());
    lib
}

fn spec() -> ConnectorSpec {
    let dir = std::env::temp_dir();
    format!("plugin:{}?dir={}", plugin_path().display(), dir.display()).parse().unwrap()
}

async fn passes_every_case(suite: Suite) {
    let mut failures = Vec::new();
    for (name, result, took) in suite.run_all().await {
        match result {
            Ok(()) => eprintln!("ok   {name} ({took:?})"),
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    assert!(failures.is_empty(), "plugin conformance failures:\n{}", failures.join("\n"));
    assert!(CASES.len() >= 18);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn example_plugin_passes_every_case() {
    passes_every_case(Suite::new(spec())).await;
}

/// The same with senders announcing chunks before they sum them (protocol 3's late checksums, what
/// device senders do), carried as opaque messages by the plugin.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn example_plugin_passes_every_case_with_sums_following() {
    passes_every_case(Suite::new(spec()).with_sums_following()).await;
}

#[tokio::test]
async fn bad_plugins_are_refused_with_clear_errors() {
    let memory = tandem_kv_transfer::KvMemory::host(
        tandem_kv_transfer::Geometry::new(tandem_kv_transfer::GeometrySpec {
            model_id: "m".into(),
            dtype: tandem_kv_transfer::DType::F32,
            block_size: 4,
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 8,
            layout: tandem_kv_transfer::Layout::KvHeadTokenDim,
        })
        .unwrap(),
        4,
    )
    .unwrap();
    let fabric = tandem_kv_transfer::Fabric::new();
    let config = tandem_kv_transfer::ConnectorConfig::default();
    // Not a library at all.
    let junk = std::env::temp_dir().join(format!("tandem-not-a-plugin-{}.so", std::process::id()));
    std::fs::write(&junk, b"definitely not ELF").unwrap();
    for (spec, needle) in [
        ("plugin:/nonexistent/libnothing.so".to_string(), "libnothing"),
        (format!("plugin:{}", junk.display()), "tandem-not-a-plugin"),
        // A real shared library without the entry symbol: the test binary's own libc.
        ("plugin:libc.so.6".to_string(), "tandem_kv_plugin_v1"),
    ] {
        let spec: ConnectorSpec = spec.parse().unwrap();
        let err = tandem_kv_transfer::Connector::from_spec(&spec, memory.clone(), config.clone(), &fabric)
            .await
            .expect_err("must be refused");
        assert!(matches!(err, Error::Plugin { .. }), "{err}");
        assert!(err.to_string().contains(needle), "{err}");
    }
    // A bad plugin config reaches the plugin's create and comes back as an error.
    let spec: ConnectorSpec = format!("plugin:{}?dir=/nonexistent/dir/for/sockets", plugin_path().display()).parse().unwrap();
    let err = tandem_kv_transfer::Connector::from_spec(&spec, memory, config, &fabric).await.expect_err("bad dir");
    assert!(err.to_string().contains("create failed"), "{err}");
    let _ = std::fs::remove_file(junk);
}

/// A node on a GPU asks the plugin library what it can move before registering its pool: the example
/// plugin declares host memory only, so it gets a host copy; a missing library is a clear error.
#[test]
fn plugin_capabilities_decide_host_or_device_registration() {
    let caps = tandem_kv_transfer::transport::plugin::probe_capabilities(plugin_path().to_str().unwrap()).unwrap();
    use tandem_kv_transfer::transport::Capabilities;
    assert!(caps.has(Capabilities::HOST_MEMORY));
    assert!(!caps.has(Capabilities::DEVICE_MEMORY));
    assert!(!spec().uses_device_memory().unwrap());
    let missing: ConnectorSpec = "plugin:/nonexistent/libnothing.so".parse().unwrap();
    let err = missing.uses_device_memory().unwrap_err();
    assert!(matches!(err, Error::Plugin { .. }), "{err}");
}
