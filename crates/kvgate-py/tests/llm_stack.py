"""Ray Serve LLM with real vLLM on this CPU-only machine, for the tests and the benchmark.

A local Ray cluster on loopback with Ray's direct-streaming path on (the environment
kvgate.ray.llm documents), the tiny random Qwen3 made from the repo's tokenizer fixture,
and LLMConfigs that run vLLM's CPU build. ``Cluster`` starts and stops it from any
process (``ray stop --force`` leaves vLLM's engine processes and HAProxy running, so it
ends every process the raylet started). The deployments themselves happen in a
subprocess (``python llm_stack.py deploy ...``): Ray reads the direct-streaming switches
when it is imported, and the pytest process imported it before they were set.

    python llm_stack.py deploy --address A --http-port P --readme README.md   # README's snippet
    python llm_stack.py deploy --address A --http-port P --router pow2 --name row0
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Read when ray is imported: see RAY_ENV below (set here for the processes that import this
# module before ray).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from conftest import QWEN3 as TOKENIZER, REPO, free_port  # noqa: E402

MODEL_ID = "qwen3"

#: Ray's direct-streaming path (kvgate.ray.llm.DIRECT_STREAMING_ENV) and loopback.
RAY_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
    # Keeps 127.0.0.1: without it `ray start --node-ip-address 127.0.0.1` is rewritten
    # to the machine's interface address.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # A cluster on loopback for one test or benchmark run: no token to hand around.
    "RAY_AUTH_MODE": "disabled",
}
#: The engines: block size 32 (the CPU backend needs a multiple of 32), a small cache.
BLOCK_SIZE = 32
ENGINE_KWARGS = {
    "dtype": "bfloat16",
    "max_model_len": 2048,
    "block_size": BLOCK_SIZE,
    "enable_prefix_caching": True,
    "num_gpu_blocks_override": 256,
    "max_num_seqs": 16,
    "enable_prompt_tokens_details": True,
}
#: Both replicas share one environment, so no per-replica core list: one OpenMP thread
#: each, unpinned, lets the kernel spread them over the two cores.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
#: The routers the benchmark compares (request_router_config).
ROUTERS = {
    "pow2": {"request_router_class": "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter"},
    # What an LLMConfig that names no router gets in Ray 2.60 (Serve LLM's RoundRobinRouter).
    "ray_default": None,
    "prefix_tree": {"request_router_class": "ray.serve.llm.request_router:PrefixCacheAffinityRouter"},
    "dynamo": {"request_router_class": "ray.serve.llm.request_router:KVAwareRouter"},
    "kvgate": {"request_router_class": "kvgate.ray.llm:KVAwareRouter"},
}


def tiny_model(cache=REPO / "target" / "tiny-qwen3") -> Path:
    """A tiny randomly initialised Qwen3 (2 layers, hidden 128) with the real Qwen3
    tokenizer from the repo's fixture: its outputs are gibberish, its tokenizer, chat
    template, prefix cache and KV events are the real ones. Made once."""
    cache = Path(cache)
    if (cache / "model.safetensors").exists():
        return cache
    code = f"""
import shutil, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
cfg = Qwen3Config(vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                  tie_word_embeddings=True, torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)
torch.manual_seed(0)
Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained({str(cache)!r}, safe_serialization=True)
for f in ["tokenizer.json", "tokenizer_config.json"]:
    shutil.copy({str(TOKENIZER)!r} + "/" + f, {str(cache)!r} + "/" + f)
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    return cache


class Cluster:
    """A local Ray head on loopback with the direct-streaming environment. Ray's CPU
    count is logical: each LLMServer replica asks for one CPU bundle, and the tests run
    three replicas on this machine's two cores."""

    def __init__(self, num_cpus: int = 4):
        self.gcs_port = free_port()
        self.http_port = free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.env = {
            **os.environ, **RAY_ENV,
            # HAProxy's metrics and stats ports default to fixed numbers: free ones here.
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        }
        ray_bin = str(Path(sys.executable).parent / "ray")
        subprocess.run(
            [ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1",
             "--port", str(self.gcs_port), "--num-cpus", str(num_cpus),
             "--include-dashboard", "false", "--disable-usage-stats"],
            env=self.env, check=True, stdout=subprocess.DEVNULL,
        )
        self.ray_bin = ray_bin
        self._haproxy_before = _haproxies()

    def deploy(self, *args: str, timeout: float = 900) -> None:
        """Runs ``llm_stack.py deploy`` in a subprocess with Ray's direct-streaming env."""
        subprocess.run(
            [sys.executable, __file__, "deploy", "--address", self.address,
             "--http-port", str(self.http_port), *args],
            env=self.env, check=True, timeout=timeout,
        )

    def url(self, route_prefix: str = "") -> str:
        return f"http://127.0.0.1:{self.http_port}{route_prefix}"

    def stop(self) -> None:
        """Stops Ray and every process it started (vLLM engines and HAProxy outlive
        `ray stop --force`, re-parented to init)."""
        import psutil

        started = set()
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if "raylet" in cmd and str(self.gcs_port) in cmd:
                started |= {c.pid for c in p.children(recursive=True)}
        subprocess.run([self.ray_bin, "stop", "--force"], env=self.env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # An HAProxy still starting when the raylet's children were listed.
        started |= _haproxies() - self._haproxy_before
        for pid in started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _haproxies() -> set:
    """The HAProxy processes Ray Serve started from this environment's Ray."""
    import psutil

    ours = str(Path(sys.prefix))
    return {
        p.pid for p in psutil.process_iter(["cmdline"])
        if (p.info["cmdline"] or [""])[0].startswith(ours) and "haproxy" in p.info["cmdline"][0]
    }


def llm_config_kwargs(model: Path, router, *, kv_events_port_base=None, extra_env=None, replicas=2):
    """The keyword arguments of an LLMConfig for the tiny model on CPU."""
    deployment_config = {"num_replicas": replicas, "ray_actor_options": {"num_cpus": 0}}
    if router is not None:
        deployment_config["request_router_config"] = router
    kwargs = {
        "model_loading_config": {"model_id": MODEL_ID, "model_source": str(model)},
        "deployment_config": deployment_config,
        "engine_kwargs": dict(ENGINE_KWARGS),
        # One CPU bundle makes LLMConfig pick its CPU accelerator (vLLM's mp executor).
        "placement_group_config": {"bundles": [{"CPU": 1}]},
        "runtime_env": {"env_vars": {**ENGINE_ENV, **(extra_env or {})}},
    }
    if kv_events_port_base is not None:
        # Another app's engines on this node: its own KV-event and token ports.
        kwargs["experimental_configs"] = {
            "KV_EVENTS_PORT_BASE": kv_events_port_base,
            "KV_TOKEN_PORT_BASE": kv_events_port_base + 2000,
        }
    return kwargs


def readme_snippet(readme: Path) -> str:
    """The README's Ray Serve LLM snippet: the python block after its marker."""
    text = readme.read_text()
    marker = "<!-- ray-serve-llm-snippet -->"
    start = text.index("```python", text.index(marker)) + len("```python")
    return text[start:text.index("```", start)]


def _deploy(args) -> None:
    import ray
    from ray import serve
    import ray.serve.llm

    model = tiny_model()
    ray.init(address=args.address, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.http_port})
    except ray.exceptions.ActorAlreadyExistsError:
        pass  # another process deploying to this cluster started Serve a moment earlier
    if args.readme:
        # The README's snippet as pasted, with this machine's CPU settings merged into
        # its LLMConfig (model folder, engine sizes, CPU placement).
        real = ray.serve.llm.LLMConfig

        def on_this_machine(**kw):
            cpu = llm_config_kwargs(model, None)
            merged = {**cpu, **kw}
            merged["model_loading_config"] = {**kw["model_loading_config"], "model_source": str(model)}
            merged["deployment_config"] = {**cpu["deployment_config"], **kw.get("deployment_config", {})}
            return real(**merged)

        ray.serve.llm.LLMConfig = on_this_machine
        exec(compile(readme_snippet(Path(args.readme)), "README.md", "exec"), {"__name__": "__main__"})
        return
    from ray.serve.llm import LLMConfig, build_openai_app

    config = LLMConfig(**llm_config_kwargs(
        model, ROUTERS[args.router], replicas=args.replicas,
        kv_events_port_base=args.kv_events_port_base,
        extra_env=json.loads(args.env) if args.env else None,
    ))
    serve.run(build_openai_app({"llm_configs": [config]}), name=args.name,
              route_prefix=args.route_prefix or f"/{args.name}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("deploy")
    d.add_argument("--address", required=True)
    d.add_argument("--http-port", type=int, required=True)
    d.add_argument("--readme", help="deploy the README's Ray Serve LLM snippet")
    d.add_argument("--router", choices=sorted(ROUTERS), default="kvgate")
    d.add_argument("--name", default="app")
    d.add_argument("--route-prefix")
    d.add_argument("--replicas", type=int, default=2)
    d.add_argument("--kv-events-port-base", type=int)
    d.add_argument("--env", help="JSON of extra env vars for the replicas and the ingress")
    args = ap.parse_args()
    start = time.time()
    _deploy(args)
    print(f"deployed in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
