//! Python's `json.dumps` output format, for the chat templates' `tojson` filter.
//!
//! HF transformers renders templates with `tojson = json.dumps(x, ensure_ascii=False,
//! indent=indent, separators=separators, sort_keys=sort_keys)`, whose spacing
//! (`", "` and `": "`) and float formatting differ from compact JSON. Tool schemas are
//! rendered into the prompt this way, so byte-exact output matters for token parity.
//! Owns only formatting of a `serde_json::Value`; must not know about templates.

use std::fmt::Write as _;

use serde_json::Value;

/// `json.dumps` options.
#[derive(Clone, Debug)]
pub(crate) struct DumpOptions {
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
    pub ensure_ascii: bool,
}

impl DumpOptions {
    /// Python's defaults for the given indent: `(", ", ": ")` without indent,
    /// `(",", ": ")` with one.
    pub(crate) fn new(indent: Option<String>) -> DumpOptions {
        let item_sep = if indent.is_some() { "," } else { ", " }.to_owned();
        DumpOptions {
            indent,
            item_sep,
            key_sep: ": ".to_owned(),
            sort_keys: false,
            ensure_ascii: false,
        }
    }
}

pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> String {
    let mut out = String::new();
    write_value(&mut out, value, opts, 0);
    out
}

fn newline(out: &mut String, opts: &DumpOptions, level: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write_value(out: &mut String, value: &Value, opts: &DumpOptions, level: usize) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(n) => {
            if n.is_f64() {
                out.push_str(&python_float_repr(n.as_f64().unwrap_or(0.0)));
            } else {
                let _ = write!(out, "{n}");
            }
        }
        Value::String(s) => write_str(out, s, opts.ensure_ascii),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, level + 1);
                write_value(out, item, opts, level + 1);
            }
            newline(out, opts, level);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, level + 1);
                write_str(out, k, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_value(out, v, opts, level + 1);
            }
            newline(out, opts, level);
            out.push('}');
        }
    }
}

fn write_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form when the decimal
/// exponent is < -4 or >= 16 (`1e+20`, `1e-05`), otherwise positional with `.0`.
pub(crate) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{f:e}"); // e.g. "1.5e-7", "-1e20"
    let (mantissa, exp) = match sci.split_once('e') {
        Some((m, e)) => (m, e.parse::<i32>().unwrap_or(0)),
        None => (sci.as_str(), 0),
    };
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn matches_python_default_spacing() {
        let v = json!({"type": "function", "function": {"name": "f", "a": [1, 2.5, true, null], "s": "ü\"\n<>"}});
        assert_eq!(
            dumps(&v, &DumpOptions::new(None)),
            r#"{"type": "function", "function": {"name": "f", "a": [1, 2.5, true, null], "s": "ü\"\n<>"}}"#
        );
    }

    #[test]
    fn indent_and_ascii() {
        let mut o = DumpOptions::new(Some("  ".into()));
        o.ensure_ascii = true;
        assert_eq!(
            dumps(&json!({"a": [1, {}], "b": "é😀"}), &o),
            "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": \"\\u00e9\\ud83d\\ude00\"\n}"
        );
    }

    #[test]
    fn floats_like_python() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e20), "1e+20");
        assert_eq!(python_float_repr(1e16), "1e+16");
        assert_eq!(python_float_repr(123456789012345.0), "123456789012345.0");
        assert_eq!(python_float_repr(1e-5), "1e-05");
        assert_eq!(python_float_repr(0.0001), "0.0001");
        assert_eq!(python_float_repr(-2.5e-7), "-2.5e-07");
    }
}
