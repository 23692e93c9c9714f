//! Prometheus text for GET /metrics, with vLLM's metric names and labels.
//!
//! Owns the exposition format only: it renders a [`SimSnapshot`]; it keeps no state
//! and does not touch the engine loop.

use std::fmt::Write;

use crate::scheduler::SimSnapshot;

fn escape(label: &str) -> String {
    label
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// One metric with its HELP and TYPE lines and a single series.
fn series(out: &mut String, (name, kind): (&str, &str), help: &str, labels: &str, v: f64) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    let _ = writeln!(out, "{name}{labels} {v:?}");
}

/// Render the metrics vLLM routers read (`vllm:num_requests_running`, ...).
pub fn render(model: &str, s: &SimSnapshot) -> String {
    let labels = format!("{{engine=\"0\",model_name=\"{}\"}}", escape(model));
    let mut out = String::with_capacity(2048);
    let mut gauge =
        |name: &str, help: &str, v: f64| series(&mut out, (name, "gauge"), help, &labels, v);
    gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        s.running as f64,
    );
    gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        s.waiting as f64,
    );
    gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        s.kv_usage,
    );
    // vLLM's info gauge: its cache configuration as labels (routers read num_gpu_blocks).
    let cache_labels = format!(
        "{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{}\"}}",
        s.block_size, s.num_blocks
    );
    series(
        &mut out,
        ("vllm:cache_config_info", "gauge"),
        "Information of the LLMEngine CacheConfig",
        &cache_labels,
        1.0,
    );
    let c = &s.counters;
    let mut counter = |name: &str, help: &str, v: u64| {
        let name = format!("{name}_total");
        series(&mut out, (&name, "counter"), help, &labels, v as f64)
    };
    counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        c.prefix_queries_tokens,
    );
    counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        c.prefix_hits_tokens,
    );
    counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        c.preemptions,
    );
    counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        c.prompt_tokens,
    );
    counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        c.generation_tokens,
    );
    counter(
        "kvgate_mock:prompt_tokens_computed",
        "Prompt tokens computed by prefill (the simulator's own; neither cached nor transferred).",
        c.prefill_computed_tokens,
    );
    counter(
        "kvgate_mock:prompt_tokens_transferred",
        "Prompt tokens whose KV arrived from a prefill engine (the simulator's own).",
        c.transferred_tokens,
    );
    // vLLM labels this counter by finished_reason; the simulator does not track why a
    // request finished, so every finished request is reported once under "length".
    let success_labels = format!(
        "{{engine=\"0\",finished_reason=\"length\",model_name=\"{}\"}}",
        escape(model)
    );
    series(
        &mut out,
        ("vllm:request_success_total", "counter"),
        "Count of successfully processed requests.",
        &success_labels,
        c.finished as f64,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_labels() {
        let s = SimSnapshot {
            running: 2,
            waiting: 1,
            kv_usage: 0.25,
            num_blocks: 512,
            block_size: 16,
            ..Default::default()
        };
        let text = render("my\"model", &s);
        assert!(
            text.contains("vllm:num_requests_running{engine=\"0\",model_name=\"my\\\"model\"} 2.0")
        );
        assert!(text.contains("vllm:kv_cache_usage_perc{"));
        assert!(text.contains(
            "vllm:cache_config_info{block_size=\"16\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"512\"} 1.0"
        ));
        assert!(text.contains("vllm:prefix_cache_hits_total{"));
        assert!(text.contains("vllm:request_success_total{engine=\"0\",finished_reason=\"length\""));
        assert!(text.contains("# TYPE vllm:prefix_cache_queries_total counter"));
    }
}
