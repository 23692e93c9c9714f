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
//! gauge has no unseen load until they can. It must not judge health (a failed read is
//! not a failed health check) or touch bookings.

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

/// Reads one worker's queue and hands it to its pool's ledger.
async fn read_queue(gw: &Gateway, model: &ModelState, worker: &Worker, timeout: Duration) {
    let read = get_body(
        &gw.client,
        worker,
        Endpoint::Metrics,
        timeout,
        MAX_METRICS_BYTES,
    )
    .await;
    let queue = match &read {
        Ok((status, Ok(body))) if status.is_success() => {
            parse_engine_queue(&String::from_utf8_lossy(body))
        }
        _ => None,
    };
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
        // Garbage values are skipped, not trusted.
        assert_eq!(
            parse_engine_queue("vllm:num_requests_running{} NaN\nvllm:num_requests_running{} -3\n"),
            None
        );
    }
}
