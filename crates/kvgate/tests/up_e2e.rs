//! `kvgate up` through the real binary: it starts 2 simulated engines and a kv_aware
//! gateway, prints curl commands, and every printed command answers 200 when sent as
//! printed; Ctrl-C (SIGINT) stops everything and exits 0; logs redirected to files carry
//! no ANSI colour codes. The metric table of docs/operations.md and the gateway's `/metrics` before
//! its first request name the same metrics, and the Grafana dashboard in deploy/grafana
//! queries only those.

use std::path::PathBuf;
use std::time::Duration;

use kvgate_bench::process::{free_ports, ManagedChild};
use kvgate_bench::up::READY_LINE;

/// The metric names (or `*` patterns) of the metric table in docs/operations.md.
fn readme_metrics() -> Vec<String> {
    let readme = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/operations.md"
    ))
    .unwrap();
    let section = readme
        .split("\n## Metrics\n")
        .nth(1)
        .expect("docs/operations.md has a Metrics section");
    let section = section.split("\n## ").next().unwrap_or(section);
    section
        .lines()
        .filter(|l| l.starts_with("| `kvgate_"))
        .flat_map(|l| {
            let first_cell = l.split(" | ").next().unwrap_or(l);
            first_cell
                .split('`')
                .filter(|t| t.starts_with("kvgate_"))
                .map(|t| t.split('{').next().unwrap_or(t).to_string())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// A metric name against a documented name that may hold one `*`.
fn matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        Some((pre, post)) => {
            name.len() > pre.len() + post.len() && name.starts_with(pre) && name.ends_with(post)
        }
        None => pattern == name,
    }
}

/// Every metric docs/operations.md lists is exported before any request, and every exported
/// metric is listed there.
async fn check_metrics_against_readme(http: &reqwest::Client, port: u16) {
    let text = http
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let exported: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let listed = readme_metrics();
    assert!(listed.len() >= 20, "{listed:?}");
    for pattern in &listed {
        let series = text.lines().any(|l| {
            !l.starts_with('#')
                && exported
                    .iter()
                    .any(|name| matches(pattern, name) && l.starts_with(name))
        });
        assert!(
            series,
            "docs/operations.md lists {pattern} but /metrics has no sample of it before the first request:\n{text}"
        );
    }
    for name in &exported {
        assert!(
            listed.iter().any(|p| matches(p, name)),
            "/metrics exports {name}, which the metric table of docs/operations.md does not list"
        );
    }
    check_dashboard(&exported);
}

/// Every string under `key` anywhere in a JSON document.
fn strings_under(v: &serde_json::Value, key: &str, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match x {
                    serde_json::Value::String(s) if k == key => out.push(s.clone()),
                    _ => strings_under(x, key, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| strings_under(x, key, out)),
        _ => {}
    }
}

/// The Grafana dashboard in deploy/grafana queries only metrics kvgate exports.
fn check_dashboard(exported: &[&str]) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/grafana/kvgate.json"
    );
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut queries = Vec::new();
    strings_under(&dashboard, "expr", &mut queries);
    strings_under(&dashboard, "definition", &mut queries);
    assert!(queries.len() >= 20, "{queries:?}");
    let mut named = 0;
    for q in &queries {
        for word in q.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if !word.starts_with("kvgate_") {
                continue;
            }
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| word.strip_suffix(s).filter(|f| exported.contains(f)))
                .unwrap_or(word);
            assert!(
                exported.contains(&family),
                "the dashboard queries {word}, which /metrics does not export: {q}"
            );
            named += 1;
        }
    }
    assert!(
        named >= queries.len(),
        "{named} metric names in {queries:?}"
    );
}

/// One printed command: method, URL and body, parsed as a shell would read it.
fn parse_curl(line: &str) -> Option<(String, Option<String>)> {
    let rest = &line[line.find("curl ")?..];
    let url = rest
        .split_whitespace()
        .find(|w| w.starts_with("http://"))?
        .to_string();
    let body = rest
        .find(" -d '")
        .map(|i| &rest[i + 5..])
        .and_then(|b| b.strip_suffix('\''))
        .map(str::to_string);
    Some((url, body))
}

/// A running `kvgate up` (2 engines, speedup 10) and what it printed once ready.
struct Up {
    logs: tempfile::TempDir,
    port: u16,
    up: ManagedChild,
    printed: String,
}

/// Starts `kvgate up` with `extra` arguments and waits for its ready line.
async fn start_up(extra: &[&str]) -> Up {
    let logs = tempfile::tempdir().unwrap();
    let port = free_ports(1).unwrap()[0];
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_kvgate"));
    let mut args: Vec<String> = [
        "up",
        "--engines",
        "2",
        "--port",
        &port.to_string(),
        "--engine-speedup",
        "10",
        "--log-dir",
        &logs.path().join("fleet").display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut up = ManagedChild::spawn("up", &bin, &args, logs.path()).unwrap();
    up.wait_for_line(READY_LINE, Duration::from_secs(120))
        .await
        .unwrap_or_else(|e| panic!("kvgate up never got ready: {e:#}\n{}", up.log_tail(40)));
    let printed = std::fs::read_to_string(logs.path().join("up.out.log")).unwrap();
    Up {
        logs,
        port,
        up,
        printed,
    }
}

/// A port already taken is refused before any engine starts, with the way out named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvgate_up_refuses_a_taken_port_at_once() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let logs = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args([
            "up",
            "--engines",
            "1",
            "--port",
            &port.to_string(),
            "--log-dir",
        ])
        .arg(logs.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("port {port} is taken")),
        "{stderr}"
    );
    assert!(stderr.contains("--port"), "{stderr}");
    assert!(
        !stderr.contains("starting 1 simulated engines"),
        "refused before starting engines: {stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvgate_up_serves_every_printed_command_and_stops_on_ctrl_c() {
    let Up {
        logs,
        port,
        mut up,
        printed,
    } = start_up(&[]).await;
    let commands: Vec<(String, Option<String>)> = printed.lines().filter_map(parse_curl).collect();
    assert_eq!(commands.len(), 4, "{printed}");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    check_metrics_against_readme(&http, port).await;
    for (url, body) in &commands {
        let resp = match body {
            Some(b) => {
                http.post(url)
                    .header("content-type", "application/json")
                    .body(b.clone())
                    .send()
                    .await
            }
            None => http.get(url).send().await,
        }
        .unwrap();
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert_eq!(status, 200, "{url} {body:?}: {text}");
        if body
            .as_deref()
            .is_some_and(|b| b.contains("\"stream\":true"))
        {
            assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        }
    }
    up.signal(libc::SIGINT).unwrap();
    assert!(
        up.wait_exit(Duration::from_secs(30)).await,
        "kvgate up did not stop on Ctrl-C"
    );
    let stderr = std::fs::read_to_string(logs.path().join("up.err.log")).unwrap();
    assert!(
        !stderr.contains('\u{1b}'),
        "ANSI codes in a redirected log: {stderr}"
    );
    let gateway_log = std::fs::read_to_string(logs.path().join("fleet/gateway.err.log")).unwrap();
    assert!(!gateway_log.contains('\u{1b}'), "{gateway_log}");
    // The gateway is gone with it.
    assert!(http
        .get(format!("http://127.0.0.1:{port}/health"))
        .send()
        .await
        .is_err());
}

/// `kvgate up --policy kv_aware@pd=vllm`: the engines split into prefill and decode
/// engines and the printed chat command goes through both (the answer names its
/// prefill worker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvgate_up_runs_a_disaggregated_fleet() {
    let Up {
        mut up, printed, ..
    } = start_up(&["--policy", "kv_aware@pd=vllm"]).await;
    let (url, body) = printed
        .lines()
        .filter_map(parse_curl)
        .find(|(u, b)| u.ends_with("/v1/chat/completions") && b.is_some())
        .expect("a printed chat command");
    let resp = reqwest::Client::new()
        .post(&url)
        .header("content-type", "application/json")
        .body(body.unwrap_or_default())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers().contains_key("x-kvgate-prefill-worker"),
        "{:?}",
        resp.headers()
    );
    up.signal(libc::SIGINT).unwrap();
    assert!(up.wait_exit(Duration::from_secs(30)).await);
}
