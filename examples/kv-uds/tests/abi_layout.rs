//! Keeps `src/abi.rs` honest against `kv-transfer/include/tandem_kv.h`.
//!
//! The test reads the header, lists every `#define TANDEM_KV_*` and every field of every struct, makes
//! a C program print what the C compiler thinks of each (sizeof, _Alignof, offsetof, field sizes,
//! constant values, widths and signedness), compiles and runs it with `cc`, and compares the output with
//! the Rust mirror. A field or constant added to the header and not to the mirror fails the test, as
//! does any size, offset or value that differs. A second test loads the built `.so` with `dlopen` from
//! C, exactly as tandem does, and reads the vtable through the header's types.

#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::fmt::Write as _;
use std::mem::offset_of;
use std::path::{Path, PathBuf};
use std::process::Command;

use tandem_kv_uds::abi::*;

fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kv-transfer/include")
}

fn header_text() -> String {
    std::fs::read_to_string(include_dir().join("tandem_kv.h")).expect("read tandem_kv.h")
}

/// The header without `/* */` and `//` comments.
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let block = rest.find("/*");
        let line = rest.find("//");
        match (block, line) {
            (Some(b), l) if l.is_none_or(|l| b < l) => {
                out.push_str(&rest[..b]);
                let end = rest[b..].find("*/").expect("unterminated comment") + b + 2;
                out.push(' ');
                rest = &rest[end..];
            }
            (_, Some(l)) => {
                out.push_str(&rest[..l]);
                rest = &rest[l..];
                rest = rest.find('\n').map_or("", |n| &rest[n..]);
            }
            (None, None) => {
                out.push_str(rest);
                return out;
            }
            (Some(_), None) => unreachable!("covered by the first arm"),
        }
    }
}

/// `(name, value text)` of every `#define TANDEM_KV_*` that has a value (not the include guard).
fn header_defines(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|line| line.trim().strip_prefix("#define "))
        .filter_map(|rest| {
            let mut parts = rest.trim().splitn(2, char::is_whitespace);
            let name = parts.next()?.to_owned();
            let value = parts.next().unwrap_or("").trim().to_owned();
            (name.starts_with("TANDEM_KV_") && !value.is_empty()).then_some((name, value))
        })
        .collect()
}

/// `(struct name, field names in order)` of every `typedef struct NAME { ... } NAME;`.
fn header_structs(text: &str) -> Vec<(String, Vec<String>)> {
    let mut structs = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("typedef struct ") {
        rest = &rest[start + "typedef struct ".len()..];
        let name_end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap();
        let name = rest[..name_end].to_owned();
        let after = rest[name_end..].trim_start();
        if !after.starts_with('{') {
            continue; // an opaque type: `typedef struct x x;`
        }
        let body_end = after.find('}').expect("struct body ends");
        let fields = after[1..body_end]
            .split(';')
            .map(str::trim)
            .filter(|decl| !decl.is_empty())
            .map(|decl| match decl.find("(*") {
                Some(p) => decl[p + 2..].split(')').next().unwrap().trim().to_owned(),
                None => decl
                    .rsplit(|c: char| c.is_whitespace() || c == '*')
                    .next()
                    .unwrap()
                    .to_owned(),
            })
            .collect();
        structs.push((name, fields));
    }
    structs
}

/// The Rust view of one struct: C name, size, alignment, `(field, offset, size)`.
struct Layout {
    c_name: &'static str,
    size: usize,
    align: usize,
    fields: Vec<(&'static str, usize, usize)>,
}

fn field_size<T, F>(_: impl Fn(&T) -> &F) -> usize {
    size_of::<F>()
}

macro_rules! layout {
    ($c_name:literal, $ty:ty { $($field:ident),* $(,)? }) => {
        Layout {
            c_name: $c_name,
            size: size_of::<$ty>(),
            align: align_of::<$ty>(),
            fields: vec![$((stringify!($field), offset_of!($ty, $field), field_size(|s: &$ty| &s.$field))),*],
        }
    };
}

fn rust_layouts() -> Vec<Layout> {
    vec![
        layout!(
            "tandem_kv_iov",
            TandemKvIov {
                addr,
                len,
                mem_kind,
                device
            }
        ),
        layout!(
            "tandem_kv_host",
            TandemKvHost {
                abi_version,
                struct_size,
                ctx,
                on_message,
                on_payload,
                on_link_closed
            }
        ),
        layout!(
            "tandem_kv_plugin",
            TandemKvPlugin {
                abi_version,
                struct_size,
                capabilities,
                name,
                create,
                destroy,
                endpoint,
                connect,
                send,
                close_link,
                last_error,
            }
        ),
    ]
}

/// A Rust constant as the C program prints it: value, width in bytes, signedness.
trait Describe {
    fn describe(&self) -> String;
}

macro_rules! describe_int {
    ($($t:ty),*) => {$(
        impl Describe for $t {
            fn describe(&self) -> String {
                format!("{} {} {}", self, size_of::<$t>(), u8::from(<$t>::MIN != 0))
            }
        }
    )*};
}
describe_int!(i32, u32, u64);

macro_rules! constants {
    ($($name:ident),* $(,)?) => { vec![$((stringify!($name), $name.describe())),*] };
}

fn rust_constants() -> Vec<(&'static str, String)> {
    constants![
        TANDEM_KV_ABI_VERSION,
        TANDEM_KV_MAX_HEADER,
        TANDEM_KV_MAX_IOVS,
        TANDEM_KV_OK,
        TANDEM_KV_ERR_INVALID,
        TANDEM_KV_ERR_UNREACHABLE,
        TANDEM_KV_ERR_IO,
        TANDEM_KV_ERR_CLOSED,
        TANDEM_KV_ERR_UNSUPPORTED,
        TANDEM_KV_ERR_INTERNAL,
        TANDEM_KV_CAP_HOST_MEMORY,
        TANDEM_KV_CAP_DEVICE_MEMORY,
        TANDEM_KV_CAP_CROSS_HOST,
        TANDEM_KV_CAP_CROSS_PROCESS,
        TANDEM_KV_MEM_HOST,
        TANDEM_KV_MEM_CUDA,
        TANDEM_KV_DELIVER,
        TANDEM_KV_DISCARD,
    ]
}

/// Compiles `source` with `cc` (extra args after the source) and runs it with `run_args`; `None`
/// when there is no C compiler on this machine.
fn compile_and_run(
    name: &str,
    source: &str,
    cc_args: &[&str],
    run_args: &[&str],
) -> Option<String> {
    let dir = tempfile::tempdir().unwrap();
    let c_file = dir.path().join(format!("{name}.c"));
    let exe = dir.path().join(name);
    std::fs::write(&c_file, source).unwrap();
    let compiled = Command::new("cc")
        .args([
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-pedantic",
            "-Werror",
            "-Wno-type-limits",
            "-I",
        ])
        .arg(include_dir())
        .arg(&c_file)
        .arg("-o")
        .arg(&exe)
        .args(cc_args)
        .output();
    let compiled = match compiled {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        other => other.expect("run cc"),
    };
    assert!(
        compiled.status.success(),
        "cc failed:\n{}\n--- source ---\n{source}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    let ran = Command::new(&exe)
        .args(run_args)
        .output()
        .expect("run the C program");
    assert!(
        ran.status.success(),
        "the C program failed: {}",
        String::from_utf8_lossy(&ran.stderr)
    );
    Some(String::from_utf8(ran.stdout).unwrap())
}

#[test]
fn the_rust_mirror_matches_the_c_header() {
    let text = strip_comments(&header_text());
    let defines = header_defines(&text);
    let structs = header_structs(&text);
    let layouts = rust_layouts();
    let constants = rust_constants();

    // 1. The mirror covers exactly what the header declares, in the header's field order.
    let header_view: Vec<(String, Vec<String>)> = structs.clone();
    let rust_view: Vec<(String, Vec<String>)> = layouts
        .iter()
        .map(|l| {
            (
                l.c_name.to_owned(),
                l.fields.iter().map(|f| f.0.to_owned()).collect(),
            )
        })
        .collect();
    assert_eq!(
        rust_view, header_view,
        "structs or fields differ between the header and src/abi.rs"
    );
    let mut header_names: Vec<&str> = defines.iter().map(|(name, _)| name.as_str()).collect();
    let mut rust_names: Vec<&str> = constants.iter().map(|(name, _)| *name).collect();
    rust_names.push("TANDEM_KV_PLUGIN_ENTRY");
    header_names.sort_unstable();
    rust_names.sort_unstable();
    assert_eq!(
        rust_names, header_names,
        "#define constants differ between the header and src/abi.rs"
    );

    // 2. The C compiler's numbers for all of it.
    let mut program = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include \"tandem_kv.h\"\n\nint main(void) {\n",
    );
    for (name, fields) in &structs {
        writeln!(
            program,
            "    printf(\"struct {name} %zu %zu\\n\", sizeof({name}), _Alignof({name}));"
        )
        .unwrap();
        for field in fields {
            writeln!(
                program,
                "    printf(\"field {name}.{field} %zu %zu\\n\", offsetof({name}, {field}), sizeof((({name} *)0)->{field}));"
            )
            .unwrap();
        }
    }
    for (name, value) in &defines {
        if value.starts_with('"') {
            writeln!(program, "    printf(\"string {name} %s\\n\", {name});").unwrap();
        } else {
            writeln!(
                program,
                "    printf(\"const {name} %lld %zu %d\\n\", (long long)({name}), sizeof({name}), (({name}) - ({name}) - 1) < 0);"
            )
            .unwrap();
        }
    }
    program.push_str("    return 0;\n}\n");
    let Some(output) = compile_and_run("layout", &program, &[], &[]) else {
        eprintln!(
            "SKIPPED: no `cc` on PATH; the Rust mirror of tandem_kv.h was not checked against a C compiler"
        );
        return;
    };
    let c_view: BTreeMap<String, String> = output
        .lines()
        .map(|line| {
            let mut parts = line.splitn(3, ' ');
            let key = format!("{} {}", parts.next().unwrap(), parts.next().unwrap());
            (key, parts.next().unwrap_or("").to_owned())
        })
        .collect();

    // 3. The same numbers from Rust.
    let mut rust: BTreeMap<String, String> = BTreeMap::new();
    for layout in &layouts {
        rust.insert(
            format!("struct {}", layout.c_name),
            format!("{} {}", layout.size, layout.align),
        );
        for (field, offset, size) in &layout.fields {
            rust.insert(
                format!("field {}.{field}", layout.c_name),
                format!("{offset} {size}"),
            );
        }
    }
    for (name, described) in &constants {
        rust.insert(format!("const {name}"), described.clone());
    }
    rust.insert(
        "string TANDEM_KV_PLUGIN_ENTRY".into(),
        TANDEM_KV_PLUGIN_ENTRY.to_str().unwrap().to_owned(),
    );

    let differences: Vec<String> = c_view
        .keys()
        .chain(rust.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .filter(|key| c_view.get(*key) != rust.get(*key))
        .map(|key| {
            format!(
                "{key}: C says {:?}, Rust says {:?}",
                c_view.get(key),
                rust.get(key)
            )
        })
        .collect();
    assert!(
        differences.is_empty(),
        "the mirror disagrees with the header:\n{}",
        differences.join("\n")
    );

    // The entry point has the header's `tandem_kv_plugin_entry_fn` type.
    let _: PluginEntryFn = tandem_kv_uds::tandem_kv_plugin_v1;
}

/// The cdylib cargo built next to this test binary.
fn built_cdylib() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    // cargo builds every crate type of the library before its integration tests, into `deps`.
    let library = deps.join("libtandem_kv_uds.so");
    assert!(library.exists(), "{} was not built", library.display());
    library
}

#[test]
fn the_cdylib_loads_with_dlopen_and_exports_the_entry_point() {
    let library = built_cdylib();
    let program = r#"
#include <dlfcn.h>
#include <stdio.h>
#include "tandem_kv.h"

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 1; }
    void *sym = dlsym(lib, TANDEM_KV_PLUGIN_ENTRY);
    if (!sym) { fprintf(stderr, "dlsym: %s\n", dlerror()); return 1; }
    tandem_kv_plugin_entry_fn entry;
    *(void **)&entry = sym;
    const tandem_kv_plugin *p = entry();
    printf("%u %u %llu %s %d%d%d%d%d%d%d\n", p->abi_version, p->struct_size,
           (unsigned long long)p->capabilities, p->name, p->create != NULL, p->destroy != NULL,
           p->endpoint != NULL, p->connect != NULL, p->send != NULL, p->close_link != NULL,
           p->last_error != NULL);
    const char *none = p->last_error();
    printf("last_error non-null: %d\n", none != NULL);
    return 0;
}
"#;
    let Some(output) = compile_and_run("load", program, &["-ldl"], &[library.to_str().unwrap()])
    else {
        eprintln!("SKIPPED: no `cc` on PATH; the cdylib was not loaded from C");
        return;
    };
    let expected = format!(
        "{} {} {} uds 1111111\nlast_error non-null: 1\n",
        TANDEM_KV_ABI_VERSION,
        size_of::<TandemKvPlugin>(),
        TANDEM_KV_CAP_HOST_MEMORY | TANDEM_KV_CAP_CROSS_PROCESS
    );
    assert_eq!(output, expected);
    // SAFETY: the vtable's `name` is a static NUL-terminated string.
    let name = unsafe { CStr::from_ptr((*tandem_kv_uds::tandem_kv_plugin_v1()).name) };
    assert_eq!(name, c"uds");
}
