"""Shared helpers: the kvgate binary (for `kvgate mock-engine`), free loopback ports,
mock engines with real ZeroMQ KV events, and the repo's fixtures."""

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

# Ray on loopback: without this (read when ray is imported) Ray rewrites 127.0.0.1 to the
# machine's interface address, and a driver cannot join a cluster started on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# The Ray clusters the tests start live on loopback for one run: no token auth.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Serve's controller gives a starting proxy 5 s to become ready and 10 s to answer a health
# check, then kills it: on a busy 2-core machine (CI's) that can kill the proxy before it
# ever runs. A minute is still a bounded wait.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")

REPO = Path(__file__).resolve().parents[3]
QWEN3 = REPO / "fixtures" / "qwen3-tokenizer"
PARITY = REPO / "fixtures" / "tokenize-parity-qwen3.json"


def kvgate_bin() -> str:
    path = os.environ.get("KVGATE_BIN") or str(REPO / "target" / "debug" / "kvgate")
    if not os.path.exists(path):
        raise RuntimeError(
            f"kvgate binary not found at {path}: run `cargo build` or set KVGATE_BIN"
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MockEngine:
    """A `kvgate mock-engine` on loopback ports with KV events and replay."""

    def __init__(self, block_size: int = 16, extra=()):
        self.port, self.kv_port, self.replay_port = free_port(), free_port(), free_port()
        self.block_size = block_size
        self.proc = subprocess.Popen(
            [
                kvgate_bin(), "mock-engine", "--port", str(self.port),
                "--kv-events-port", str(self.kv_port), "--replay-port", str(self.replay_port),
                "--tokenizer", str(QWEN3), "--model", "m", "--block-size", str(block_size),
                "--log", "warn", *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.kv_endpoint = f"tcp://127.0.0.1:{self.kv_port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}"
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("mock engine exited at start")
                time.sleep(0.1)
        raise RuntimeError("mock engine did not become healthy")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def engines():
    started = []

    def start(n=2, **kw):
        for _ in range(n):
            started.append(MockEngine(**kw))
        return started[-n:]

    yield start
    for e in started:
        e.stop()
