//! docs/configuration.md cannot drift from the binary: every flag `kvgate serve --help`
//! shows is documented there and every flag documented there is in `--help`; likewise
//! every YAML field the configuration reads (the fields of a configuration with every
//! optional section present) and every YAML field the page documents.

use std::collections::BTreeSet;

use kvgate_gateway::config::{PdConfig, WorkerConfig, WorkersDnsConfig, WorkersKubernetesConfig};
use kvgate_gateway::{Config, ModelConfig};
use serde_json::{json, Value};

fn page() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/configuration.md");
    std::fs::read_to_string(path).expect("docs/configuration.md")
}

/// The long flags `kvgate SUBCOMMAND --help` lists (`--help` and `--version` aside).
fn help_flags(subcommand: &str) -> BTreeSet<String> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args([subcommand, "--help"])
        .output()
        .expect("kvgate SUBCOMMAND --help");
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l
                .strip_prefix('-')
                .filter(|r| r.chars().nth(1) == Some(','))
                .map_or(l, |r| r[2..].trim_start());
            let flag = l.strip_prefix("--")?;
            let name: String = flag
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            Some(format!("--{name}"))
        })
        .filter(|f| f != "--help" && f != "--version")
        .collect()
}

/// The first cell of each table row in the page's section `heading` (up to the next
/// `## `), backticks stripped: one flag or YAML path per row.
fn documented(heading: &str) -> BTreeSet<String> {
    let page = page();
    let start = page
        .find(&format!("\n## {heading}"))
        .unwrap_or_else(|| panic!("docs/configuration.md has no section {heading:?}"));
    let section = &page[start + 1..];
    let end = section[3..].find("\n## ").map_or(section.len(), |e| e + 3);
    section[..end]
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cell = l.split('|').nth(1).unwrap().trim();
            cell.trim_matches('`').to_owned()
        })
        .collect()
}

/// Every field path of `v`: objects nest with `.`, a list of objects adds `[]`.
fn paths(prefix: &str, v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(map) => {
            for (k, v) in map {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                paths(&p, v, out);
            }
        }
        Value::Array(items) if items.first().is_some_and(Value::is_object) => {
            paths(&format!("{prefix}[]"), &items[0], out);
        }
        _ => {
            out.insert(prefix.to_owned());
        }
    }
}

/// The YAML fields the configuration reads: a configuration with one model that has
/// every optional section (workers, DNS and Kubernetes discovery, a PD split).
fn yaml_fields() -> BTreeSet<String> {
    let worker = serde_json::to_value(WorkerConfig::new("http://h:1")).unwrap();
    let dns = serde_json::to_value(WorkersDnsConfig::default()).unwrap();
    let kubernetes = serde_json::to_value(WorkersKubernetesConfig::default()).unwrap();
    let mut pd = serde_json::to_value(PdConfig::default()).unwrap();
    pd["prefill_workers"] = json!([worker]);
    pd["prefill_workers_dns"] = dns.clone();
    pd["prefill_workers_kubernetes"] = kubernetes.clone();
    let mut model = serde_json::to_value(ModelConfig::default()).unwrap();
    model["workers"] = json!([worker]);
    model["workers_dns"] = dns;
    model["workers_kubernetes"] = kubernetes;
    model["pd"] = pd;
    let mut config = serde_json::to_value(Config::default()).unwrap();
    config["models"] = json!([model]);
    let mut out = BTreeSet::new();
    paths("", &config, &mut out);
    out
}

fn assert_same(what: &str, real: &BTreeSet<String>, doc: &BTreeSet<String>) {
    let missing: Vec<_> = real.difference(doc).collect();
    let stale: Vec<_> = doc.difference(real).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "docs/configuration.md and the binary disagree on {what}: missing from the page {missing:?}; on the page but not in the binary {stale:?}"
    );
}

#[test]
fn every_serve_flag_is_documented_and_every_documented_flag_exists() {
    let flags = help_flags("serve");
    assert!(
        flags.contains("--overlap-weight") && flags.len() > 40,
        "{flags:?}"
    );
    assert_same("flags", &flags, &documented("Flags"));
}

/// `kvgate epp` takes `serve`'s flags and its own, documented in their own section.
#[test]
fn every_epp_flag_is_documented_and_every_documented_flag_exists() {
    let serve = help_flags("serve");
    let epp = help_flags("epp");
    assert!(serve.is_subset(&epp), "kvgate epp takes every serve flag");
    let own: BTreeSet<String> = epp.difference(&serve).cloned().collect();
    assert!(own.contains("--grpc-port"), "{own:?}");
    assert_same(
        "kvgate epp's flags",
        &own,
        &documented("Endpoint Picker flags"),
    );
}

#[test]
fn every_yaml_field_is_documented_and_every_documented_field_exists() {
    let fields = yaml_fields();
    assert!(
        fields.contains("models[].kv_aware.overlap_weight"),
        "{fields:?}"
    );
    assert_same("YAML fields", &fields, &documented("YAML fields"));
}
