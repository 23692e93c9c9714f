//! The chat-template engine: HF-compatible Jinja rendering with minijinja.
//!
//! Owns the minijinja environment configured like transformers' sandbox
//! (`trim_blocks`, `lstrip_blocks`, `{% break %}`/`{% continue %}` as its
//! `loopcontrols` extension allows, Python string/dict methods via pycompat, and the
//! globals/filters HF templates rely on: `raise_exception`, `strftime_now`, a
//! Python-formatted `tojson`), the choice between named templates (`default`,
//! `tool_use`), and vLLM's detection of the content format a template expects.
//! Must not parse request bodies or encode text.

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};

use crate::pyjson::{self, DumpOptions};
use crate::request::ContentFormat;
use crate::TokenizeError;

/// One compiled named template.
#[derive(Debug)]
pub(crate) struct Entry {
    name: String,
    pub format: ContentFormat,
}

/// All chat templates of a model, compiled once.
pub(crate) struct TemplateSet {
    env: Environment<'static>,
    entries: Vec<Entry>,
}

impl std::fmt::Debug for TemplateSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TemplateSet")
            .field("entries", &self.entries)
            .finish_non_exhaustive()
    }
}

impl TemplateSet {
    /// Compile `(name, source)` pairs. A single unnamed template is named `default`.
    pub(crate) fn new(templates: Vec<(String, String)>) -> anyhow::Result<TemplateSet> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        let mut entries = Vec::with_capacity(templates.len());
        for (name, source) in templates {
            let format = detect_content_format(&source);
            let source = rewrite_generation_tags(&source);
            env.add_template_owned(name.clone(), source)
                .map_err(|e| anyhow::anyhow!("chat template {name:?} does not compile: {e:#}"))?;
            entries.push(Entry { name, format });
        }
        Ok(TemplateSet { env, entries })
    }

    /// HF's `get_chat_template`: `tool_use` when tools are given and it exists,
    /// otherwise `default`; a single template is always used.
    pub(crate) fn select(&self, has_tools: bool) -> Result<&Entry, TokenizeError> {
        if self.entries.len() == 1 {
            return Ok(&self.entries[0]);
        }
        let find = |n: &str| self.entries.iter().find(|e| e.name == n);
        let chosen = if has_tools { find("tool_use") } else { None };
        chosen.or_else(|| find("default")).ok_or_else(|| {
            TokenizeError::Invalid(
                "This model has multiple chat templates with no default specified!".into(),
            )
        })
    }

    pub(crate) fn render(&self, entry: &Entry, ctx: Value) -> Result<String, TokenizeError> {
        let tmpl = self
            .env
            .get_template(&entry.name)
            .map_err(|e| TokenizeError::Invalid(format!("chat template error: {e}")))?;
        tmpl.render(ctx).map_err(|e| {
            let msg = match (e.kind(), e.detail()) {
                (ErrorKind::InvalidOperation, Some(detail)) => detail.to_owned(),
                _ => format!("chat template error: {e}"),
            };
            TokenizeError::Invalid(msg)
        })
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(fmt: String) -> Result<Value, Error> {
    use chrono::format::{Item, StrftimeItems};
    let items: Vec<Item<'_>> = StrftimeItems::new(&fmt).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {fmt:?}"),
        ));
    }
    let mut out = String::new();
    std::fmt::Write::write_fmt(
        &mut out,
        format_args!(
            "{}",
            chrono::Local::now().format_with_items(items.into_iter())
        ),
    )
    .map_err(|_| Error::new(ErrorKind::InvalidOperation, "strftime_now failed"))?;
    Ok(Value::from(out))
}

/// HF's `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let bad = |m: &str| Error::new(ErrorKind::InvalidOperation, format!("tojson: {m}"));
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            (None, Some(s)) => Some(s.to_owned()),
            _ => return Err(bad("indent must be an integer or a string")),
        },
    };
    let mut opts = DumpOptions::new(indent);
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")? {
        if !seps.is_none() {
            let item: Value = seps.get_item(&Value::from(0))?;
            let key: Value = seps.get_item(&Value::from(1))?;
            match (item.as_str(), key.as_str()) {
                (Some(i), Some(k)) => {
                    opts.item_sep = i.to_owned();
                    opts.key_sep = k.to_owned();
                }
                _ => return Err(bad("separators must be two strings")),
            }
        }
    }
    if let Some(b) = kwargs.get::<Option<bool>>("sort_keys")? {
        opts.sort_keys = b;
    }
    if let Some(b) = kwargs.get::<Option<bool>>("ensure_ascii")? {
        opts.ensure_ascii = b;
    }
    kwargs.assert_all_used()?;
    if value.is_undefined() {
        return Err(bad("Object of type Undefined is not JSON serializable"));
    }
    let json = serde_json::to_value(&value).map_err(|e| bad(&e.to_string()))?;
    Ok(Value::from(pyjson::dumps(&json, &opts)))
}

/// transformers' `{% generation %}` block (assistant-token masks) only matters for
/// training; minijinja does not know the tag. Rewriting it to `{% if true %}` keeps the
/// body and the tag's whitespace control.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        // The closing `%}` comes after the opening `{%` (in `{%}` they overlap).
        let Some(end) = tag[2..].find("%}").map(|e| e + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let trimmed = inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let replacement = match trimmed {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str("{%");
                out.push_str(&inner.replacen(trimmed, r, 1));
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// vLLM's `_detect_content_format`: a template that loops over a message's `content`
/// (`{% for part in message['content'] %}`) wants the "openai" list-of-parts format;
/// otherwise content is passed as a string. Messages variables are followed through
/// `{% set x = messages... %}` and `{% for m in x %}`, like vLLM's AST walk.
pub(crate) fn detect_content_format(source: &str) -> ContentFormat {
    let tags = statement_tags(source);
    let mut messages_vars = vec!["messages".to_owned()];
    // `set` chains (`set loop_messages = messages[1:]`), to a fixpoint.
    loop {
        let before = messages_vars.len();
        for tag in &tags {
            if let Some(assign) = tag.strip_prefix("set ") {
                if let Some((lhs, rhs)) = assign.split_once('=') {
                    let lhs = lhs.trim();
                    if is_ident(lhs)
                        && messages_vars
                            .iter()
                            .any(|v| is_access_of(rhs.trim(), v, None))
                        && !messages_vars.iter().any(|v| v == lhs)
                    {
                        messages_vars.push(lhs.to_owned());
                    }
                }
            }
        }
        if messages_vars.len() == before {
            break;
        }
    }
    let loops: Vec<(&str, &str)> = tags
        .iter()
        .filter_map(|t| t.strip_prefix("for "))
        .filter_map(|t| t.split_once(" in "))
        .map(|(target, iter)| (target.trim(), iter.trim()))
        .collect();
    let message_vars: Vec<&str> = loops
        .iter()
        .filter(|(target, iter)| {
            is_ident(target) && messages_vars.iter().any(|v| is_access_of(iter, v, None))
        })
        .map(|(target, _)| *target)
        .collect();
    let iterates_content = loops.iter().any(|(_, iter)| {
        message_vars
            .iter()
            .any(|m| is_access_of(iter, m, Some("content")))
    });
    if iterates_content {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

/// The inner text of every `{% ... %}` tag, whitespace-control markers stripped.
fn statement_tags(source: &str) -> Vec<String> {
    let mut tags = Vec::new();
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let after = &rest[start + 2..];
        let Some(end) = after.find("%}") else { break };
        let inner = after[..end].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        tags.push(inner.split_whitespace().collect::<Vec<_>>().join(" "));
        rest = &after[end + 2..];
    }
    tags
}

fn is_ident(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_')
}

/// `expr` is `var`, `var[...]` slice, `var|filter`, or (with `key`) `var.key` /
/// `var['key']` / `var["key"]`, optionally followed by a filter or a `recursive`/`if`.
fn is_access_of(expr: &str, var: &str, key: Option<&str>) -> bool {
    let Some(rest) = expr.strip_prefix(var) else {
        return false;
    };
    let rest = match key {
        None => rest,
        Some(k) => {
            let forms = [format!(".{k}"), format!("['{k}']"), format!("[\"{k}\"]")];
            match forms.iter().find_map(|f| rest.strip_prefix(f.as_str())) {
                Some(r) => r,
                None => return false,
            }
        }
    };
    let rest = rest.trim_start();
    rest.is_empty()
        || rest.starts_with('|')
        || rest.starts_with(" if")
        || rest.starts_with("if ")
        || rest.starts_with("recursive")
        || (key.is_none() && rest.starts_with('['))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_format_detection() {
        let s = "{% for message in messages %}{{ message['content'] }}{% endfor %}";
        assert_eq!(detect_content_format(s), ContentFormat::String);
        let o = "{%- for message in messages -%}{%- for c in message['content'] -%}{{ c.text }}{%- endfor -%}{%- endfor -%}";
        assert_eq!(detect_content_format(o), ContentFormat::OpenAi);
        let chained = "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% for part in m.content | selectattr('type', 'equalto', 'text') %}{% endfor %}{% endfor %}";
        assert_eq!(detect_content_format(chained), ContentFormat::OpenAi);
    }

    /// A malformed tag is a clear error when the template loads, never a panic.
    #[test]
    fn malformed_tags_are_load_errors() {
        for source in ["{%}", "{%}%}", "a {%", "{%- %}", "{% generation %}{%}"] {
            let loaded = std::panic::catch_unwind(|| {
                TemplateSet::new(vec![("default".into(), source.into())])
            });
            match loaded {
                Ok(Ok(_)) => {} // minijinja may accept some; what matters is no panic
                Ok(Err(e)) => assert!(!e.to_string().is_empty()),
                Err(_) => panic!("loading {source:?} panicked"),
            }
        }
        assert!(TemplateSet::new(vec![("default".into(), "{%}".into())]).is_err());
    }

    #[test]
    fn generation_tags_are_kept_as_plain_blocks() {
        let t = rewrite_generation_tags("a{%- generation %}b{% endgeneration -%} c{{ x }}");
        assert_eq!(t, "a{%- if true %}b{% endif -%} c{{ x }}");
    }

    #[test]
    fn hf_globals_and_filters() {
        let set = TemplateSet::new(vec![(
            "default".into(),
            "{{ x | tojson }}|{{ x | tojson(indent=1) }}|{{ 'a-b'.split('-')[-1] }}|{{ strftime_now('%Y') | length }}".into(),
        )])
        .unwrap();
        let e = set.select(false).unwrap();
        let out = set
            .render(
                e,
                Value::from_serialize(serde_json::json!({"x": {"k": [1, "é"]}})),
            )
            .unwrap();
        assert_eq!(
            out,
            "{\"k\": [1, \"é\"]}|{\n \"k\": [\n  1,\n  \"é\"\n ]\n}|b|4"
        );
        let raising = TemplateSet::new(vec![(
            "t".into(),
            "{{ raise_exception('roles must alternate') }}".into(),
        )])
        .unwrap();
        let e = raising.select(false).unwrap();
        assert_eq!(
            raising.render(e, Value::from(())),
            Err(TokenizeError::Invalid("roles must alternate".into()))
        );
    }

    /// transformers' sandbox loads `jinja2.ext.loopcontrols`, so a chat template may
    /// `{% break %}` and `{% continue %}` (expected output from jinja2 3.1 with it).
    #[test]
    fn loop_controls_as_in_transformers() {
        let set = TemplateSet::new(vec![(
            "default".into(),
            "{% for m in messages %}{% if m.role == 'tool' %}{% continue %}{% endif %}\
             {% if loop.index > 3 %}{% break %}{% endif %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
                .into(),
        )])
        .unwrap();
        let roles = ["system", "tool", "user", "assistant", "user"];
        let messages: Vec<_> = roles
            .iter()
            .map(|r| serde_json::json!({"role": r, "content": &r[..1]}))
            .collect();
        let e = set.select(false).unwrap();
        let out = set
            .render(
                e,
                Value::from_serialize(serde_json::json!({ "messages": messages })),
            )
            .unwrap();
        assert_eq!(out, "[system:s][user:u]");
    }

    #[test]
    fn named_templates_selection() {
        let set = TemplateSet::new(vec![
            ("default".into(), "d".into()),
            ("tool_use".into(), "t".into()),
        ])
        .unwrap();
        assert_eq!(set.select(false).unwrap().name, "default");
        assert_eq!(set.select(true).unwrap().name, "tool_use");
    }
}
