//! Load the engines report: each worker's queue, read from its Prometheus metrics.
//!
//! Owns the periodic `GET {worker}/metrics` of every pool's workers (every
//! `engine_metrics_interval_ms` of their model; 0 = never), reading the requests the
//! engine runs and queues (vLLM: `vllm:num_requests_running` and
//! `vllm:num_requests_waiting`; SGLang: `sglang:num_running_reqs` and
//! `sglang:num_queue_reqs`; summed over the label sets of a server with several
//! data-parallel engines), and handing them to the pool's ledger
//! ([`kvgate_core::Ledger::engine_reported`]), which counts what the fleet did not book
//! as the worker's unseen load. A worker whose metrics cannot be read or carry neither
//! gauge has no unseen load until they can. From the same page, vLLM's KV-cache size
//! (`vllm:cache_config_info`'s `num_gpu_blocks` label) goes to the worker's time model
//! ([`kvgate_core::Ledger::set_kv_capacity`]) unless the model's configuration names
//! one. It must not judge health (a failed read is not a failed health check) or
//! touch bookings.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvgate_core::EngineQueue;
use tokio::task::JoinSet;

use crate::gateway::Gateway;
use crate::proxy::get_body;
use crate::registry::{Endpoint, ModelState, Worker};

/// The gauges of requests running, by engine family.
const RUNNING: [&str; 2] = ["vllm:num_requests_running", "sglang:num_running_reqs"];
/// The gauges of requests waiting to be scheduled, by engine family.
const WAITING: [&str; 2] = ["vllm:num_requests_waiting", "sglang:num_queue_reqs"];
/// vLLM's info gauge whose labels are its cache configuration.
const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
/// A metrics page larger than this is not read (vLLM's is about 100 KiB).
const MAX_METRICS_BYTES: usize = 4 << 20;

/// The engine's queue from its Prometheus text: each gauge summed over its series.
/// `None` when the text has neither a running nor a waiting gauge.
pub fn parse_engine_queue(text: &str) -> Option<EngineQueue> {
    let mut running: Option<f64> = None;
    let mut waiting: Option<f64> = None;
    for line in text.lines() {
        let line = line.trim_start();
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        let slot = if RUNNING.contains(&name) {
            &mut running
        } else if WAITING.contains(&name) {
            &mut waiting
        } else {
            continue;
        };
        // The value follows the labels (which may hold spaces inside quotes).
        let after_labels = match line[name_end..].starts_with('{') {
            true => line[name_end..]
                .rfind('}')
                .map(|i| &line[name_end + i + 1..]),
            false => Some(&line[name_end..]),
        };
        let value = after_labels
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0);
        if let Some(v) = value {
            *slot = Some(slot.unwrap_or(0.0) + v);
        }
    }
    if running.is_none() && waiting.is_none() {
        return None;
    }
    let count = |v: Option<f64>| v.unwrap_or(0.0).round().min(f64::from(u32::MAX)) as u32;
    Some(EngineQueue {
        running: count(running),
        waiting: count(waiting),
    })
}

/// The KV-cache blocks of the engines behind one server, from vLLM's
/// `vllm:cache_config_info{..., num_gpu_blocks="N", ...}` (summed over its engines);
/// `None` without it (SGLang, an engine still starting: `num_gpu_blocks="None"`).
pub fn parse_kv_capacity(text: &str) -> Option<u32> {
    let mut total: Option<u64> = None;
    for line in text.lines() {
        let Some(labels) = line.trim_start().strip_prefix(CACHE_CONFIG_INFO) else {
            continue;
        };
        // The label itself, not num_gpu_blocks_override beside it.
        let Some(at) = [",num_gpu_blocks=\"", "{num_gpu_blocks=\""]
            .iter()
            .find_map(|key| labels.find(key).map(|i| i + key.len()))
        else {
            continue;
        };
        let value = &labels[at..];
        let blocks = value
            .split('"')
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&v| v > 0);
        if let Some(b) = blocks {
            total = Some(total.unwrap_or(0) + b);
        }
    }
    total.map(|t| t.min(u64::from(u32::MAX)) as u32)
}

/// Reads one worker's queue (and, unless configured, its KV-cache size) and hands them
/// to its pool's ledger.
async fn read_queue(gw: &Gateway, model: &ModelState, worker: &Worker, timeout: Duration) {
    let read = get_body(
        &gw.client,
        worker,
        Endpoint::Metrics,
        timeout,
        MAX_METRICS_BYTES,
    )
    .await;
    let text = match &read {
        Ok((status, Ok(body))) if status.is_success() => Some(String::from_utf8_lossy(body)),
        _ => None,
    };
    if model.config.num_gpu_blocks.is_none() {
        if let Some(blocks) = text.as_deref().and_then(parse_kv_capacity) {
            model.ledger().set_kv_capacity(worker.id, Some(blocks));
        }
    }
    let queue = text.as_deref().and_then(parse_engine_queue);
    match queue {
        Some(queue) => {
            model.ledger().engine_reported(worker.id, queue);
        }
        None => {
            tracing::debug!(model = %model.name, worker = %worker.url, read = ?read.as_ref().map(|(s, b)| (*s, b.as_ref().map(Bytes::len))), "no queue in the engine's metrics");
            model.ledger().engine_queue_unknown(worker.id);
        }
    }
}

/// Reads every pool's workers' queues at their model's interval, until shutdown.
pub async fn run_engine_queue_reads(gw: Arc<Gateway>) {
    let pools: Vec<Arc<ModelState>> = gw
        .pools()
        .filter(|m| m.config.engine_metrics_interval_ms > 0)
        .cloned()
        .collect();
    let mut set = JoinSet::new();
    for model in pools {
        let gw = gw.clone();
        set.spawn(async move {
            let interval = Duration::from_millis(model.config.engine_metrics_interval_ms);
            // A read outlasting the interval is abandoned (the next one starts).
            let timeout = interval.max(Duration::from_millis(100));
            let mut ticks = gw.ticks(interval);
            while ticks.next().await {
                let mut reads = JoinSet::new();
                for worker in model.workers().iter() {
                    if worker.breaker.is_open() {
                        model.ledger().engine_queue_unknown(worker.id);
                        continue;
                    }
                    let (gw, model, worker) = (gw.clone(), model.clone(), worker.clone());
                    reads.spawn(async move { read_queue(&gw, &model, &worker, timeout).await });
                }
                while reads.join_next().await.is_some() {}
            }
        });
    }
    while set.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_and_sglang_queues_summed_over_engines() {
        let vllm =
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
# TYPE vllm:num_requests_running gauge\n\
vllm:num_requests_running{engine=\"0\",model_name=\"m {x}\"} 3.0\n\
vllm:num_requests_running{engine=\"1\",model_name=\"m {x}\"} 2.0\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 4.0\n\
vllm:num_requests_waiting_by_reason{engine=\"0\",reason=\"capacity\"} 9.0\n\
vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n";
        assert_eq!(
            parse_engine_queue(vllm),
            Some(EngineQueue {
                running: 5,
                waiting: 4
            })
        );
        let sglang = "sglang:num_running_reqs{model_name=\"m\",tp_rank=\"0\"} 7.0\nsglang:num_queue_reqs{model_name=\"m\"} 1\n";
        assert_eq!(
            parse_engine_queue(sglang),
            Some(EngineQueue {
                running: 7,
                waiting: 1
            })
        );
        assert_eq!(
            parse_engine_queue("vllm:num_requests_running 2\n").map(|q| q.running),
            Some(2)
        );
        assert_eq!(parse_engine_queue("process_cpu_seconds_total 1.0\n"), None);
        assert_eq!(parse_engine_queue(""), None);
        assert_eq!(parse_kv_capacity(vllm), None, "no cache_config_info");
        // Garbage values are skipped, not trusted.
        assert_eq!(
            parse_engine_queue("vllm:num_requests_running{} NaN\nvllm:num_requests_running{} -3\n"),
            None
        );
    }

    /// vLLM's cache configuration as its metrics give it (labels from its CacheConfig,
    /// one series per engine): the blocks summed, `num_gpu_blocks_override` beside it
    /// not mistaken for it, an engine still starting (`"None"`) skipped.
    #[test]
    fn reads_vllm_kv_cache_size_from_cache_config_info() {
        let one = "# TYPE vllm:cache_config_info gauge\n\
vllm:cache_config_info{block_size=\"32\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",num_cpu_blocks=\"None\",num_gpu_blocks=\"256\",num_gpu_blocks_override=\"999\"} 1.0\n";
        assert_eq!(parse_kv_capacity(one), Some(256));
        let two = format!(
            "{one}vllm:cache_config_info{{engine=\"1\",num_gpu_blocks_override=\"None\",num_gpu_blocks=\"100\"}} 1.0\n"
        );
        assert_eq!(parse_kv_capacity(&two), Some(356));
        // Captured from real vLLM 0.32 (the CPU build, `--num-gpu-blocks-override 256`).
        let real = "vllm:cache_config_info{_block_size_resolved=\"True\",block_size=\"32\",cache_dtype=\"auto\",cache_hit_alignment_tokens=\"None\",effective_attention_block_size=\"32\",enable_mamba_shared_prefix_checkpoint=\"False\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.92\",hash_block_size=\"None\",is_attention_free=\"False\",kv_cache_dtype_skip_layers=\"[]\",kv_cache_layout=\"None\",kv_cache_max_concurrency=\"4.0\",kv_cache_memory_bytes=\"1073741824\",kv_cache_size_tokens=\"8192\",kv_offloading_backend=\"native\",kv_offloading_size=\"None\",kv_sharing_fast_prefill=\"False\",mamba_block_size=\"None\",mamba_cache_dtype=\"auto\",mamba_cache_mode=\"none\",mamba_page_size_padded=\"None\",mamba_ssm_cache_dtype=\"float32\",num_cpu_blocks=\"None\",num_gpu_blocks=\"256\",num_gpu_blocks_override=\"256\",prefix_cache_retention_interval=\"0\",prefix_caching_hash_algo=\"sha256\",prefix_match_unit=\"None\",replayssm_buffer_len=\"16\",skip_page_size_padded=\"None\",sliding_window=\"None\",swa_bounded_replay=\"True\",use_kda_recoverssm=\"False\",use_replayssm=\"False\",user_specified_block_size=\"True\"} 1.0";
        assert_eq!(parse_kv_capacity(real), Some(256));
        let starting = "vllm:cache_config_info{engine=\"0\",num_gpu_blocks=\"None\"} 1.0\n";
        assert_eq!(parse_kv_capacity(starting), None);
        assert_eq!(parse_kv_capacity("sglang:num_running_reqs 1\n"), None);
    }
}
