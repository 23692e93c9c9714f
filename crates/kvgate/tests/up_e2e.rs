//! `kvgate up` through the real binary: it starts 2 simulated engines and a kv_aware
//! gateway, prints curl commands, and every printed command answers 200 when sent as
//! printed; Ctrl-C (SIGINT) stops everything and exits 0; logs redirected to files carry
//! no ANSI colour codes.

use std::path::PathBuf;
use std::time::Duration;

use kvgate_bench::process::{free_ports, ManagedChild};
use kvgate_bench::up::READY_LINE;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvgate_up_serves_every_printed_command_and_stops_on_ctrl_c() {
    let logs = tempfile::tempdir().unwrap();
    let port = free_ports(1).unwrap()[0];
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_kvgate"));
    let args: Vec<String> = [
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
    let mut up = ManagedChild::spawn("up", &bin, &args, logs.path()).unwrap();
    up.wait_for_line(READY_LINE, Duration::from_secs(120))
        .await
        .unwrap_or_else(|e| panic!("kvgate up never got ready: {e:#}\n{}", up.log_tail(40)));
    let printed = std::fs::read_to_string(logs.path().join("up.out.log")).unwrap();
    let commands: Vec<(String, Option<String>)> = printed.lines().filter_map(parse_curl).collect();
    assert_eq!(commands.len(), 4, "{printed}");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
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
