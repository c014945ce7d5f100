"""Every test ends within a time bound and takes every process it started with it (tests/process_bounds.py): a hang
fails the test with the stacks of where each process waited, and a run that leaves a process alive fails, naming it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .conftest import REPO, launch
from .process_bounds import GRACE_S, processes_in, scopes_of


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.launch
def test_a_launch_blocked_in_a_collective_fails_within_its_bound_with_each_workers_stack_and_leaves_no_process(
    tmp_path,
):
    """Two launched processes, the main one in gloo's barrier, the other asleep: past the launch's bound both stacks
    are in the error, and no process of the launch (launcher, elastic agent, workers in their own sessions) is left."""
    bound_s = 30  # the launch's start (torch imported by the agent and by each worker): about 10 s on 2 cores
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as timeout:
        launch(REPO / "tests" / "hang_worker.py", [str(tmp_path)], processes=2, timeout_s=bound_s)
    assert time.monotonic() - started < bound_s + 60  # the stacks dumped (py-spy, seconds) and the kill
    report = timeout.value.stderr
    assert "barrier" in report and "sleep_instead_of_the_barrier" in report, report
    pids = [int((tmp_path / f"rank{rank}").read_text()) for rank in (0, 1)]
    assert not any(alive(pid) for pid in pids)


def run_pytest(tmp_path: Path, test_file: str, *options: str) -> subprocess.CompletedProcess:
    """Another pytest run with this suite's plugin and `options`, on `test_file`'s source."""
    (tmp_path / "test_subject.py").write_text(textwrap.dedent(test_file))
    command = [sys.executable, "-m", "pytest", "-p", "tests.process_bounds", "-p", "no:cacheprovider", "-q"]
    command += [*options, "--rootdir", str(tmp_path), str(tmp_path / "test_subject.py")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


def test_a_test_that_hangs_in_the_pytest_process_fails_at_its_bound_with_its_stack_and_its_detached_child_ends(
    tmp_path,
):
    """A test that started a child in a session of its own and then hangs: at its bound (pytest-timeout) it fails
    with the stack of where it waited, and its child is killed with it; the run fails naming the child."""
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    done = run_pytest(
        tmp_path,
        f"""
        import subprocess, time
        import pytest

        @pytest.mark.timeout(3)
        def test_hangs():
            child = subprocess.Popen(["sleep", "600"], start_new_session=True)
            open({str(pid_file)!r}, "w").write(str(child.pid))
            time.sleep(600)  # waits here
        """,
    )
    assert time.monotonic() - started < 60
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout
    assert "Timeout" in done.stdout and "time.sleep(600)  # waits here" in done.stdout, done.stdout
    assert "the test left processes alive, now killed" in done.stdout and "sleep 600" in done.stdout, done.stdout
    assert not alive(int(pid_file.read_text()))


def test_a_run_whose_fixture_leaves_a_process_alive_fails_naming_it(tmp_path):
    """A session fixture's process outlives every test (its fixture never stops it): the run kills it and fails,
    though every test passed."""
    pid_file = tmp_path / "server.pid"
    done = run_pytest(
        tmp_path,
        f"""
        import subprocess
        import pytest

        @pytest.fixture(scope="session")
        def server():
            process = subprocess.Popen(["sleep", "601"], start_new_session=True)
            open({str(pid_file)!r}, "w").write(str(process.pid))
            return process

        def test_uses_the_server(server):
            assert server.poll() is None
        """,
    )
    assert "1 passed" in done.stdout, done.stdout
    assert done.returncode == pytest.ExitCode.TESTS_FAILED
    assert "processes left alive, killed" in done.stdout and "sleep 601" in done.stdout, done.stdout
    assert not alive(int(pid_file.read_text()))


def test_every_process_a_test_starts_carries_the_tests_scope(tmp_path):
    """What the clean-up finds processes by: the scopes in their environment, whatever session they moved to."""
    (test_scope,) = [scope for scope in scopes_of() if scope.startswith("test-")]
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        # Asked again until the clean-up's own grace ends, as the clean-up asks: once, with the suite on two workers,
        # the first scan right after the start did not find it
        deadline = time.monotonic() + GRACE_S
        while child.pid not in processes_in(test_scope) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert child.pid in processes_in(test_scope)
    finally:
        child.kill()
        child.wait()
    assert child.pid not in processes_in(test_scope)


def test_a_test_blocked_in_a_c_call_past_its_bound_fails_with_every_threads_stack_and_the_run_goes_on(tmp_path):
    """A test waiting in torch's TCPStore for a key nobody sets never returns to the interpreter, so its bound's signal
    never acts: at its own bound (its mark, 2 s, not the run's 60) plus the margin the backstop ends its pytest-xdist
    worker with every thread's stack; the controller reports the test failed with them and kills the process it had
    started, and on a new worker the module's next test runs while the blocked one is not run again (xdist's
    `--dist loadscope` hands it out with the rest of its module: it would end every new worker in turn)."""
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    done = run_pytest(
        tmp_path,
        f"""
        import datetime, subprocess, threading, time
        import pytest
        from torch.distributed import TCPStore  # imported at collection, before the bound starts

        def a_thread_beside_it():
            time.sleep(600)

        @pytest.mark.timeout(2)
        def test_blocked_in_c():
            threading.Thread(target=a_thread_beside_it, daemon=True).start()
            child = subprocess.Popen(["sleep", "603"], start_new_session=True)
            open({str(pid_file)!r}, "w").write(str(child.pid))
            store = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=600))
            store.wait(["a key nobody sets"])

        def test_after_it():
            pass
        """,
        *("-n", "2", "--dist", "loadscope", "-rA", "-o", "timeout=60", "-o", "timeout_backstop_margin=2"),
    )
    elapsed = time.monotonic() - started
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout
    assert "1 failed, 1 passed, 1 skipped" in done.stdout, done.stdout
    assert "crashed while running 'test_subject.py::test_blocked_in_c': still running 2 s past" in done.stdout
    assert "Timeout (0:00:04)!" in done.stdout, done.stdout  # the mark's 2 s and the margin's 2
    assert "in test_blocked_in_c" in done.stdout and "in a_thread_beside_it" in done.stdout, done.stdout
    assert "PASSED test_subject.py::test_after_it" in done.stdout, done.stdout
    assert "SKIPPED" in done.stdout and "its worker died while it ran" in done.stdout, done.stdout
    assert "processes left alive, killed" in done.stdout and "sleep 603" in done.stdout, done.stdout
    assert not alive(int(pid_file.read_text()))
    assert 4 < elapsed < 60, elapsed  # and torch's import and three workers' starts, a few seconds each on 2 cores


def test_in_one_process_the_backstop_ends_the_run_with_every_threads_stack_on_stderr(tmp_path):
    """Without pytest-xdist the backstop's exit ends the run: every thread's stack is on the terminal's stderr, not in
    the test's captured output, which nobody reads once the process is gone."""
    done = run_pytest(
        tmp_path,
        """
        import ctypes, signal

        def test_blocked_in_c():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # the bound's signal never reaches it
            ctypes.CDLL(None).pause()
        """,
        *("-n", "0", "-o", "timeout=1", "-o", "timeout_backstop_margin=1"),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Timeout (0:00:02)!" in done.stderr and "in test_blocked_in_c" in done.stderr, done.stderr
