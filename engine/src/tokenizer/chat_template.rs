//! HF chat templates rendered with minijinja, configured like transformers' Jinja environment.
//!
//! Invariants: the environment uses `trim_blocks` and `lstrip_blocks` (as transformers does);
//! templates get `raise_exception(msg)` (fails the render with `msg`), `strftime_now(fmt)`
//! (current UTC time) and the Python string/dict methods HF templates commonly call
//! (`strip`, `startswith`, `items`, `get`, ...); a render never panics, every failure is an
//! [`Error::ChatTemplate`]. A render is bounded whatever the template: at most [`FUEL`]
//! instructions, [`MAX_OUTPUT`] bytes of output and minijinja's recursion limit (500), so a hostile
//! or broken template fails one request instead of pinning a core or filling memory.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Value, ValueKind, from_args};
use minijinja::{Environment, ErrorKind, State, context};

use super::ChatMessage;
use crate::Error;

const NAME: &str = "chat";

/// Most template instructions one render may execute: real chat templates need tens per message,
/// so this covers conversations far past any context window and stops a runaway loop in well
/// under a second.
const FUEL: u64 = 5_000_000;

/// Most bytes one render may write (a prompt is far shorter: the router refuses long ones first).
const MAX_OUTPUT: usize = 8 << 20;

/// The render's output, refused past [`MAX_OUTPUT`] (minijinja reports only that writing failed, so
/// the reason is kept here).
struct Capped {
    out: Vec<u8>,
    overflowed: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > MAX_OUTPUT {
            self.overflowed = true;
            return Err(std::io::Error::other("output bound"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub(super) struct ChatTemplate {
    env: Environment<'static>,
}

/// What a template render sees.
pub(super) struct RenderInput<'a> {
    pub(super) messages: &'a [ChatMessage],
    pub(super) add_generation_prompt: bool,
    pub(super) bos_token: &'a str,
    pub(super) eos_token: &'a str,
}

impl ChatTemplate {
    /// Compiles `source`; the error is a human-readable reason.
    pub(super) fn compile(source: String) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.set_unknown_method_callback(python_method);
        env.set_fuel(Some(FUEL));
        env.add_template_owned(NAME, source)
            .map_err(|e| format!("template does not compile: {e}"))?;
        Ok(ChatTemplate { env })
    }

    /// Renders the template.
    pub(super) fn render(&self, input: &RenderInput<'_>) -> Result<String, Error> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| Error::ChatTemplate(e.to_string()))?;
        let mut out = Capped { out: Vec::new(), overflowed: false };
        template
            .render_captured_to(
                context! {
                    messages => input.messages,
                    add_generation_prompt => input.add_generation_prompt,
                    bos_token => input.bos_token,
                    eos_token => input.eos_token,
                    tools => Value::from(()),
                    documents => Value::from(()),
                },
                &mut out,
            )
            .map_err(|e| {
                Error::ChatTemplate(if out.overflowed {
                    format!("the rendered prompt exceeds {} MiB", MAX_OUTPUT >> 20)
                } else {
                    describe(&e)
                })
            })?;
        String::from_utf8(out.out).map_err(|_| Error::ChatTemplate("the template rendered invalid UTF-8".into()))
    }
}

/// The error and its detail, without minijinja's multi-line source dump.
fn describe(e: &minijinja::Error) -> String {
    match e.line() {
        Some(line) => format!("{e} (template line {line})"),
        None => e.to_string(),
    }
}

fn raise_exception(msg: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(format: String) -> Result<String, minijinja::Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(strftime(&format, secs))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

/// `(year, month 1..=12, day 1..=31)` of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    // Shift to an era-based calendar starting 0000-03-01 so leap days fall at year end.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of era, 0..146097
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // year of era
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of (March-based) year
    let mp = (5 * doy + 2) / 153; // March-based month, 0..12
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

/// A C-`strftime` subset over a UTC Unix time: `%Y %y %m %d %e %j %H %I %M %S %p %a %A %b %h %B
/// %F %T %%`; any other directive is copied unchanged.
pub(super) fn strftime(format: &str, unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let sod = unix_secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (sod / 3600, sod % 3600 / 60, sod % 60);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[month as usize - 1] + day + u32::from(month > 2 && is_leap(year));
    let month_name = MONTHS[month as usize - 1];
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{hour12:02}")),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('b' | 'h') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('F') => out.push_str(&format!("{year}-{month:02}-{day:02}")),
            Some('T') => out.push_str(&format!("{hour:02}:{minute:02}:{second:02}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Python methods HF templates call on strings and dicts, which minijinja lacks.
fn python_method(
    state: &State<'_, '_>,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, minijinja::Error> {
    match value.kind() {
        ValueKind::String => string_method(value.as_str().unwrap_or_default(), method, args),
        ValueKind::Map => map_method(state, value, method, args),
        _ => Err(minijinja::Error::from(ErrorKind::UnknownMethod)),
    }
}

fn string_method(s: &str, method: &str, args: &[Value]) -> Result<Value, minijinja::Error> {
    let strip_set = |args: &[Value]| -> Result<Option<Vec<char>>, minijinja::Error> {
        let (chars,): (Option<&str>,) = from_args(args)?;
        Ok(chars.map(|c| c.chars().collect()))
    };
    let strip = |s: &str, left: bool, right: bool, set: Option<Vec<char>>| -> String {
        let pred = |c: char| match &set {
            Some(set) => set.contains(&c),
            None => c.is_whitespace(),
        };
        let s = if left { s.trim_start_matches(pred) } else { s };
        let s = if right { s.trim_end_matches(pred) } else { s };
        s.to_string()
    };
    Ok(match method {
        "strip" => Value::from(strip(s, true, true, strip_set(args)?)),
        "lstrip" => Value::from(strip(s, true, false, strip_set(args)?)),
        "rstrip" => Value::from(strip(s, false, true, strip_set(args)?)),
        "upper" => {
            let () = from_args(args)?;
            Value::from(s.to_uppercase())
        }
        "lower" => {
            let () = from_args(args)?;
            Value::from(s.to_lowercase())
        }
        "capitalize" => {
            let () = from_args(args)?;
            let mut cs = s.chars();
            Value::from(match cs.next() {
                Some(first) => first
                    .to_uppercase()
                    .chain(cs.flat_map(char::to_lowercase))
                    .collect(),
                None => String::new(),
            })
        }
        "title" => {
            let () = from_args(args)?;
            let mut out = String::with_capacity(s.len());
            let mut prev_alpha = false;
            for c in s.chars() {
                if prev_alpha {
                    out.extend(c.to_lowercase());
                } else {
                    out.extend(c.to_uppercase());
                }
                prev_alpha = c.is_alphabetic();
            }
            Value::from(out)
        }
        "startswith" | "endswith" => {
            let (pat,): (Value,) = from_args(args)?;
            let pats: Vec<String> = match pat.as_str() {
                Some(p) => vec![p.to_string()],
                None => pat.try_iter()?.map(|v| v.to_string()).collect(),
            };
            let hit = if method == "startswith" {
                pats.iter().any(|p| s.starts_with(p.as_str()))
            } else {
                pats.iter().any(|p| s.ends_with(p.as_str()))
            };
            Value::from(hit)
        }
        "replace" => {
            let (old, new, count): (&str, &str, Option<i64>) = from_args(args)?;
            Value::from(match count {
                Some(n) if n >= 0 => s.replacen(old, new, usize::try_from(n).unwrap_or(usize::MAX)),
                _ => s.replace(old, new),
            })
        }
        "split" => {
            let (sep, maxsplit): (Option<&str>, Option<i64>) = from_args(args)?;
            let limit = maxsplit
                .filter(|&n| n >= 0)
                .map(|n| usize::try_from(n).unwrap_or(usize::MAX));
            let parts: Vec<Value> = match (sep, limit) {
                (Some(""), _) => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "empty separator",
                    ));
                }
                (Some(sep), Some(n)) => s
                    .splitn(n.saturating_add(1), sep)
                    .map(Value::from)
                    .collect(),
                (Some(sep), None) => s.split(sep).map(Value::from).collect(),
                (None, Some(n)) => split_whitespace_n(s, n)
                    .into_iter()
                    .map(Value::from)
                    .collect(),
                (None, None) => s.split_whitespace().map(Value::from).collect(),
            };
            Value::from(parts)
        }
        "find" => {
            let (needle,): (&str,) = from_args(args)?;
            Value::from(
                s.find(needle)
                    .map_or(-1, |byte| s[..byte].chars().count() as i64),
            )
        }
        "join" => {
            let (items,): (Value,) = from_args(args)?;
            let parts: Vec<String> = items.try_iter()?.map(|v| v.to_string()).collect();
            Value::from(parts.join(s))
        }
        _ => return Err(minijinja::Error::from(ErrorKind::UnknownMethod)),
    })
}

/// Python's `str.split(None, n)`: at most `n` splits on whitespace runs, the rest kept whole
/// (leading whitespace dropped).
fn split_whitespace_n(s: &str, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = s.trim_start();
    while !rest.is_empty() {
        if out.len() == n {
            out.push(rest.to_string());
            break;
        }
        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        out.push(rest[..end].to_string());
        rest = rest[end..].trim_start();
    }
    out
}

fn map_method(
    state: &State<'_, '_>,
    map: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, minijinja::Error> {
    match method {
        "items" => {
            let () = from_args(args)?;
            state.apply_filter("items", std::slice::from_ref(map))
        }
        "keys" => {
            let () = from_args(args)?;
            Ok(Value::from(map.try_iter()?.collect::<Vec<_>>()))
        }
        "values" => {
            let () = from_args(args)?;
            let values: Result<Vec<Value>, _> = map.try_iter()?.map(|k| map.get_item(&k)).collect();
            Ok(Value::from(values?))
        }
        "get" => {
            let (key, default): (Value, Option<Value>) = from_args(args)?;
            let v = map.get_item(&key)?;
            Ok(if v.is_undefined() {
                default.unwrap_or(Value::from(()))
            } else {
                v
            })
        }
        _ => Err(minijinja::Error::from(ErrorKind::UnknownMethod)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, messages: &[ChatMessage]) -> Result<String, Error> {
        let t = ChatTemplate::compile(src.to_string()).map_err(Error::ChatTemplate)?;
        t.render(&RenderInput {
            messages,
            add_generation_prompt: true,
            bos_token: "<s>",
            eos_token: "</s>",
        })
    }

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage::new(role, content)
    }

    #[test]
    fn trim_and_lstrip_blocks_like_transformers() {
        let src = "{{ bos_token }}\n{% for m in messages %}\n    {% if m.role == 'user' %}\n[U]{{ m.content }}\n    {% endif %}\n{% endfor %}\n";
        assert_eq!(
            render(src, &[msg("user", "a"), msg("system", "s")]).unwrap(),
            "<s>\n[U]a\n"
        );
    }

    #[test]
    fn loop_controls_and_generation_prompt() {
        let src = "{% for m in messages %}{% if loop.first and m.role == 'system' %}{% continue %}{% endif %}{{ m.content }};{% endfor %}{% if add_generation_prompt %}>{% endif %}{{ eos_token }}";
        assert_eq!(
            render(src, &[msg("system", "s"), msg("user", "u")]).unwrap(),
            "u;></s>"
        );
    }

    #[test]
    fn python_string_methods() {
        let cases = [
            ("{{ '  hi \\n'.strip() }}|", "hi|"),
            ("{{ 'xxhixx'.strip('x') }}", "hi"),
            ("{{ '  hi '.lstrip() }}|", "hi |"),
            ("{{ ' hi  '.rstrip() }}|", " hi|"),
            ("{{ 'Hi'.upper() }}{{ 'Hi'.lower() }}", "HIhi"),
            ("{{ 'hello wORLD'.title() }}", "Hello World"),
            ("{{ 'hELLO'.capitalize() }}", "Hello"),
            (
                "{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith('x') }}",
                "TrueFalse",
            ),
            ("{{ 'abc'.startswith(('x', 'a')) }}", "True"),
            (
                "{{ 'a-b-c'.replace('-', '+') }}{{ 'a-b-c'.replace('-', '+', 1) }}",
                "a+b+ca+b-c",
            ),
            ("{{ 'a,b,c'.split(',') | join('|') }}", "a|b|c"),
            ("{{ 'a,b,c'.split(',', 1) | join('|') }}", "a|b,c"),
            ("{{ '  a  b c '.split() | join('|') }}", "a|b|c"),
            ("{{ ' a  b c '.split(none, 1) | join('|') }}", "a|b c "),
            ("{{ 'héllo'.find('l') }}{{ 'x'.find('y') }}", "2-1"),
            ("{{ ', '.join(['a', 'b']) }}", "a, b"),
        ];
        for (src, want) in cases {
            assert_eq!(render(src, &[]).unwrap(), want, "{src}");
        }
    }

    #[test]
    fn python_dict_methods() {
        let src = "{% set d = {'a': 1, 'b': 2} %}{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{{ d.keys() | join(',') }}|{{ d.values() | join(',') }}|{{ d.get('a') }}{{ d.get('z', 9) }}{{ d.get('z') is none }}";
        assert_eq!(render(src, &[]).unwrap(), "a=1;b=2;a,b|1,2|19True");
    }

    #[test]
    fn unknown_methods_and_bad_arguments_are_errors_not_panics() {
        for src in [
            "{{ 'a'.nope() }}",
            "{{ [1].strip() }}",
            "{{ 'a'.split('') }}",
            "{{ 'a'.upper(1) }}",
        ] {
            assert!(
                matches!(render(src, &[]), Err(Error::ChatTemplate(_))),
                "{src}"
            );
        }
    }

    #[test]
    fn raise_exception_fails_the_render_with_its_message() {
        let err = render("{{ raise_exception('roles must alternate') }}", &[]).unwrap_err();
        assert!(
            matches!(&err, Error::ChatTemplate(m) if m.contains("roles must alternate")),
            "{err}"
        );
    }

    #[test]
    fn tools_and_documents_are_none() {
        assert_eq!(
            render("{{ tools is none }}{{ documents is none }}", &[]).unwrap(),
            "TrueTrue"
        );
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(
            strftime("%A %a %B %h %j %y %I%p %e %F %T %% %Q", t),
            "Thursday Thu February Feb 060 24 01PM 29 2024-02-29 13:05:09 % %Q"
        );
        assert_eq!(strftime("%Y-%m-%d %A", 0), "1970-01-01 Thursday");
        // 2000-12-31 (leap year, day 366) and 2100-03-01 (not a leap year).
        assert_eq!(strftime("%F %j", 978_220_800), "2000-12-31 366");
        assert_eq!(strftime("%F %j %a", 4_107_542_400), "2100-03-01 060 Mon");
        assert_eq!(strftime("trailing %", 0), "trailing %");
    }

    #[test]
    fn strftime_now_renders_the_current_year() {
        let out = render("{{ strftime_now('%Y') }}", &[]).unwrap();
        let year: i64 = out.parse().unwrap();
        assert!((2024..3000).contains(&year), "{out}");
    }

    #[test]
    fn syntax_errors_fail_compile() {
        assert!(ChatTemplate::compile("{% if %}".to_string()).is_err());
        assert!(ChatTemplate::compile("{{ x ".to_string()).is_err());
    }

    #[test]
    fn hostile_templates_fail_their_render_within_bounds() {
        let m = [msg("user", "hi")];
        let t0 = std::time::Instant::now();
        // A loop of 10^10 iterations: out of fuel.
        let spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let e = render(spin, &m).unwrap_err().to_string();
        assert!(e.contains("fuel"), "{e}");
        // Unbounded recursion: minijinja's recursion limit.
        let deep = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
        let e = render(deep, &m).unwrap_err().to_string();
        assert!(e.contains("recursion"), "{e}");
        // 100 MB of output from little work: refused at the output bound.
        let flood = "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}";
        let e = render(flood, &m).unwrap_err().to_string();
        assert!(e.contains("exceeds 8 MiB"), "{e}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(30), "bounded renders took {:?}", t0.elapsed());
        // The bounds leave room for real use: a long conversation renders.
        let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
        let long: Vec<ChatMessage> = (0..20_000).map(|i| msg(if i % 2 == 0 { "user" } else { "assistant" }, "some words here")).collect();
        let out = render(chatml, &long).expect("a long conversation");
        assert_eq!(out.matches("<|im_start|>").count(), 20_000);
    }
}
