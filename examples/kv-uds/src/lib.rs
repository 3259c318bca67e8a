//! `tandem-kv-uds`: an example third-party KV-transfer backend for tandem, over Unix domain sockets.
//!
//! It knows tandem only through the C header `kv-transfer/include/tandem_kv.h` (mirrored by hand in
//! [`abi`]) and is loaded by tandem as a shared library (`libtandem_kv_uds.so`) through the one exported
//! symbol [`tandem_kv_plugin_v1`]. It depends on no tandem crate and on nothing beyond `std`.
//!
//! Map: `abi` (the header's types), `ffi` (the `extern "C"` vtable functions), `instance` (listener,
//! links, accept thread, destroy), `reader` (one thread per link: messages to host callbacks), `wire`
//! (the private framing), `payload` (iovecs to slices), `host` (calling the host's callbacks),
//! `config` (`dir=...`), `error` (status codes and `last_error`). `docs/kv-transfer-backend.md` walks
//! through it.
//!
//! Invariants: no panic crosses the C boundary; no host callback runs after `destroy` returns; every
//! `unsafe` block states why it is sound in a `// SAFETY:` comment.
//!
//! SIGPIPE: writes go through `write(2)`/`writev(2)`, so writing to a link whose peer vanished raises
//! SIGPIPE. Rust programs (tandem included) ignore SIGPIPE from the start; a host written in C must
//! ignore it too.

#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod abi;
mod config;
mod error;
mod ffi;
mod host;
mod instance;
mod payload;
mod reader;
mod wire;

use abi::{
    TANDEM_KV_ABI_VERSION, TANDEM_KV_CAP_CROSS_PROCESS, TANDEM_KV_CAP_HOST_MEMORY, TandemKvPlugin,
};

/// The vtable tandem reads; immutable and valid for the life of the process.
static PLUGIN: TandemKvPlugin = TandemKvPlugin {
    abi_version: TANDEM_KV_ABI_VERSION,
    struct_size: size_of::<TandemKvPlugin>() as u32,
    capabilities: TANDEM_KV_CAP_HOST_MEMORY | TANDEM_KV_CAP_CROSS_PROCESS,
    name: c"uds".as_ptr(),
    create: Some(ffi::create),
    destroy: Some(ffi::destroy),
    endpoint: Some(ffi::endpoint),
    connect: Some(ffi::connect),
    send: Some(ffi::send),
    close_link: Some(ffi::close_link),
    last_error: Some(ffi::last_error),
};

/// The plugin's entry point (`TANDEM_KV_PLUGIN_ENTRY`): the address of its static vtable.
#[unsafe(no_mangle)]
pub extern "C" fn tandem_kv_plugin_v1() -> *const TandemKvPlugin {
    &PLUGIN
}
