"""Ending a run whose vLLM server stopped answering, within a bounded time, instead of waiting for it forever.

TRL waits on a dead or hung server without bound in two places. Synchronous server mode: `VLLMClient` sends its
requests with no timeout (`trl/generation/vllm_client.py`), so a server that stops answering without closing the
connection (hung, or its machine gone) blocks the main process for ever, and the others in their next collective; a
server that is gone ends the run only after urllib3's retries, with a bare `ConnectionError`. Asynchronous trainer: while
the rollout queue is empty, `RolloutQueueDataset.__iter__` (`trl/experimental/async_grpo/async_grpo_trainer.py`)
polls the worker's `check_health`, which reads the worker's heartbeat; the worker's scoring loop keeps beating while
its generation loop retries or has died on the server, so the trainer waits for samples that never come.

`ServerWatch` asks the server's `/health` (answered by vLLM's API server even while it generates) and raises
`VLLMServerUnreachableError`, naming the server and how to resume, once no answer came for `timeout_s`.

The probe is the standard library's `urllib`, not `requests`: `requests` is installed only with TRL's `vllm` extra,
and `from trl_dppo import DPPOTrainer` must work without it. The errors of TRL's client (`requests.ConnectionError`
and its kin) derive from `OSError`, so they are told apart from others without importing `requests`.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any


__all__ = ["ServerWatch", "VLLMServerUnreachableError", "answers_health"]

# How long one `/health` request may take, and how often a waiting call asks
PROBE_TIMEOUT_S = 5.0
POLL_INTERVAL_S = 5.0


def answers_health(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the server at `url` answers `GET /health` with 200 within `timeout_s`."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as response:
            return response.status == 200
    except OSError:  # refused, reset, timed out, or an HTTP error status (urllib.error.HTTPError)
        return False


class VLLMServerUnreachableError(RuntimeError):
    """The vLLM server a run samples from has not answered for longer than the run's bound."""


class ServerWatch:
    """Whether the vLLM server at `url` answers `/health`, and an error once it has been silent for `timeout_s`.

    `setting` names the config field that sets `timeout_s`, for the error message.
    """

    def __init__(self, url: str, timeout_s: float, setting: str):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.setting = setting
        self._silent_since: float | None = None  # the first unanswered probe since the last answer

    def answers(self) -> bool:
        """Ask `/health` once; remember since when the server has been silent."""
        answered = answers_health(self.url)
        if answered:
            self._silent_since = None
        elif self._silent_since is None:
            self._silent_since = time.monotonic()
        return answered

    def check(self) -> None:
        """Raise `VLLMServerUnreachableError` if the server has not answered for `timeout_s`."""
        if not self.answers() and time.monotonic() - self._silent_since > self.timeout_s:
            raise self.error()

    def error(self) -> VLLMServerUnreachableError:
        silent = time.monotonic() - self._silent_since
        return VLLMServerUnreachableError(
            f"The vLLM server at {self.url} has not answered for {silent:.3g}s (`{self.setting}` is "
            f"{self.timeout_s:g}s): it died, hangs, or cannot be reached. The run stops here instead of waiting; "
            "checkpoints already saved are complete. Restart the server with the same command line, then resume "
            "from the last checkpoint: `trainer.train(resume_from_checkpoint=True)` (`--resume_from_checkpoint true` "
            "on the command line)."
        )

    def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """`fn(*args, **kwargs)`, ended by `VLLMServerUnreachableError` if the server stops answering meanwhile.

        `fn` runs in a daemon thread, so a request blocked on a silent server is left behind when the run ends. A
        connection error from `fn` (an `OSError`, as `requests.ConnectionError` is) while the server does not answer
        becomes the same error.
        """
        outcome: dict[str, Any] = {}

        def run():
            try:
                outcome["value"] = fn(*args, **kwargs)
            except BaseException as error:  # noqa: BLE001  (re-raised in the calling thread)
                outcome["error"] = error

        thread = threading.Thread(target=run, name="vllm-request", daemon=True)
        thread.start()
        while True:
            thread.join(POLL_INTERVAL_S)
            if not thread.is_alive():
                break
            self.check()
        if "error" in outcome:
            error = outcome["error"]
            if isinstance(error, OSError) and not self.answers():
                raise self.error() from error
            raise error
        return outcome["value"]
