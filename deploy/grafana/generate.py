"""Writes kvgate.json, the Grafana dashboard for kvgate's metrics.

Run from the repository root after changing a panel: `python3 deploy/grafana/generate.py`.
Every query must name metrics kvgate exports: crates/kvgate/tests/up_e2e.rs checks the
written JSON against a live /metrics.
"""

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "${datasource}"}
MODEL = '{model=~"$model"}'
WORKER_MODEL = '{model=~"$model",worker!=""}'


class Layout:
    def __init__(self):
        self.panels = []
        self.x = 0
        self.y = 0

    def row(self, title):
        self.newline()
        self.panels.append({
            "type": "row", "title": title, "collapsed": False, "panels": [],
            "id": len(self.panels) + 1, "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
        })
        self.y += 1

    def newline(self):
        if self.x:
            self.x = 0
            self.y += 8

    def series(self, title, targets, unit="short", description="", width=8):
        if self.x + width > 24:
            self.newline()
        self.panels.append({
            "type": "timeseries", "title": title, "description": description,
            "id": len(self.panels) + 1, "datasource": DS,
            "gridPos": {"h": 8, "w": width, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                        "tooltip": {"mode": "multi"}},
            "targets": [
                {"refId": chr(65 + i), "expr": expr, "legendFormat": legend, "datasource": DS}
                for i, (expr, legend) in enumerate(targets)
            ],
        })
        self.x += width


def dashboard():
    d = Layout()
    d.row("Traffic")
    d.series("Requests per second by status",
             [(f"sum by (status) (rate(kvgate_requests_total{MODEL}[1m]))", "{{status}}")], "reqps",
             "Every request however it ended; 499: the client left before an answer.")
    d.series("Requests per second by worker",
             [(f"sum by (worker) (rate(kvgate_requests_total{WORKER_MODEL}[1m]))", "{{worker}}")],
             "reqps", "A worker added under load should reach its share within seconds.")
    d.series("How responses ended",
             [(f"sum by (outcome) (rate(kvgate_response_ends_total{MODEL}[5m]))", "{{outcome}}")],
             "reqps", "Anything but complete ended early; a streaming client got an error event.")
    d.row("Routing quality")
    d.series("Prefix cache hit rate (engine-reported)",
             [(f"sum(rate(kvgate_reported_cached_tokens_total{MODEL}[5m])) / "
               f"sum(rate(kvgate_reported_prompt_tokens_total{MODEL}[5m]))", "hit rate")],
             "percentunit", "cached_tokens / prompt_tokens as the engines report them in usage.")
    d.series("Predicted vs reported cached tokens per second",
             [(f"sum(rate(kvgate_predicted_cached_tokens_total{MODEL}[5m]))", "predicted"),
              (f"sum(rate(kvgate_reported_cached_tokens_total{MODEL}[5m]))", "reported")],
             "short", "The policy's forecast against what the engines served from cache.")
    d.series("Prediction ratio and credit trust per worker",
             [(f"kvgate_worker_cached_tokens_prediction_ratio{MODEL}", "ratio {{worker}}"),
              (f"kvgate_worker_credit_trust{MODEL}", "trust {{worker}}")],
             "short", "Ratio 1: honest predictions. Trust: the share of prefill credit the engine confirmed.")
    d.newline()
    d.series("Routing decision latency p99",
             [(f"histogram_quantile(0.99, sum by (le, policy) "
               f"(rate(kvgate_routing_decision_seconds_bucket{MODEL}[5m])))", "{{policy}}")], "s")
    d.series("Tokenization latency p99",
             [(f"histogram_quantile(0.99, sum by (le) "
               f"(rate(kvgate_tokenization_seconds_bucket{MODEL}[5m])))", "p99")], "s")
    d.series("Cached-token prediction error p50 / p90",
             [(f"histogram_quantile({q}, sum by (le) "
               f"(rate(kvgate_cached_tokens_prediction_error_bucket{MODEL}[5m])))", f"p{int(q * 100)}")
              for q in (0.5, 0.9)],
             "short", "Engine-reported minus predicted cached tokens, per request.")
    d.row("Worker load (the ledger)")
    d.series("Requests in flight", [(f"kvgate_worker_in_flight{MODEL}", "{{worker}}")])
    d.series("Prompt tokens waiting for prefill", [(f"kvgate_worker_prefill_tokens{MODEL}", "{{worker}}")])
    d.series("Weighted decode blocks", [(f"kvgate_worker_decode_blocks{MODEL}", "{{worker}}")])
    d.newline()
    d.series("Bookings held", [(f"kvgate_ledger_active_bookings{MODEL}", "active")])
    d.series("Bookings swept by the TTL backstop",
             [(f"delta(kvgate_ledger_swept_total{MODEL}[15m])", "swept")],
             "short", "Should stay at 0: every booking ends with its request.")
    d.series("Prefix index",
             [(f"kvgate_index_entries{MODEL}", "entries"),
              (f"rate(kvgate_index_purged_entries_total{MODEL}[5m])", "purged per second")])
    d.newline()
    d.series("Requests engines hold that nobody booked",
             [(f"kvgate_worker_unseen_requests{MODEL}", "{{worker}}")],
             "short", "From the engines' own metrics: requests beyond the bookings of every "
             "kvgate replica (clients calling an engine directly, another router). Counted "
             "as the worker's load.")
    d.row("Health and failover")
    d.series("Worker healthy (breaker closed)", [(f"kvgate_worker_healthy{MODEL}", "{{worker}}")])
    d.series("Breaker transitions",
             [(f"sum by (worker, to) (increase(kvgate_worker_health_transitions_total{MODEL}[5m]))",
               "{{worker}} {{to}}")])
    d.series("Retries by reason",
             [(f"sum by (reason) (rate(kvgate_retries_total{MODEL}[5m]))", "{{reason}}")], "reqps")
    d.series("Disaggregated requests by route",
             [(f"sum by (route) (rate(kvgate_disaggregated_requests_total{MODEL}[5m]))", "{{route}}")],
             "reqps", "split: prefill and decode legs; whole: short enough to skip the split; "
             "handover_failed: a prefill answer without kv_transfer_params; "
             "prefill_retried: an SGLang pair tried again after its prefill leg failed.")
    d.row("KV events")
    d.series("Events applied per second",
             [("sum by (worker) (rate(kvgate_kv_events_events_applied_total[1m]))", "{{worker}}")])
    d.series("Event stream connected", [("kvgate_kv_events_connected", "{{worker}}")])
    d.series("Events dropped by reason",
             [("sum by (reason) (rate(kvgate_kv_events_dropped_total[5m]))", "{{reason}}")],
             "short", "Each is an event the index did not apply; the log says why.")
    d.newline()
    d.series("Gaps, replays, restarts, purges (5 min)",
             [(f"sum(increase(kvgate_kv_events_{name}_total[5m]))", legend) for name, legend in [
                 ("gaps", "gaps"), ("replays", "replays"), ("replay_failures", "replay failures"),
                 ("restarts", "engine restarts"), ("purges", "purges"), ("reconnects", "reconnects"),
                 ("incomplete_starts", "incomplete starts"), ("snapshot_loads", "snapshot loads")]],
             width=12)
    d.series("Blocks stored and removed per second",
             [(f"sum(rate(kvgate_kv_events_{name}_total[1m]))", name.replace("_", " "))
              for name in ("blocks_stored", "blocks_removed", "clears", "batches")], width=12)
    d.row("Replicas")
    d.series("Peers", [("kvgate_peers_connected", "followed"),
                       ("kvgate_peer_subscribers", "following this replica")],
             "short", "Each replica should follow every other one.")
    d.series("Load reports per second",
             [("sum by (direction) (rate(kvgate_peer_reports_total[1m]))", "{{direction}}")])
    d.series("Peers' requests in flight",
             [(f"kvgate_peer_in_flight{MODEL}", "in flight"),
              (f"kvgate_peer_replicas{MODEL}", "replicas reporting")])
    return {
        "title": "kvgate", "uid": "kvgate", "editable": True, "schemaVersion": 39, "version": 1,
        "description": "kvgate, the KV-cache-aware router: traffic, routing quality, worker load, "
        "health and KV events.",
        "refresh": "10s", "time": {"from": "now-1h", "to": "now"}, "tags": ["kvgate", "llm"],
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0},
            {"name": "model", "label": "Model", "type": "query", "datasource": DS,
             "query": {"query": "label_values(kvgate_requests_total, model)", "refId": "model"},
             "definition": "label_values(kvgate_requests_total, model)", "includeAll": True,
             "multi": True, "allValue": ".*", "refresh": 2, "current": {}, "hide": 0},
        ]},
        "panels": d.panels,
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("kvgate.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out}")
