"""Every process the suite starts ends with the test that started it, and a process that hangs says where.

A pytest plugin (loaded by tests/conftest.py; `-p tests.process_bounds` loads it into another pytest run). Each process
started from the test session carries, in its environment, the scopes it was started in: the run, the test, and for a
launch (`run_bounded`) the launch itself, in TRL_DPPO_TEST_SCOPES. The environment is what every kind of child
inherits, whatever session or process group it moves to: torch's elastic agent starts each worker in a session of its
own, vLLM's server and its engine live in another, `mp.spawn` and multiprocessing's spawn start fresh interpreters.
`/proc/PID/environ` tells a process's scopes even once its parent has died. After each test, whatever of its scope
is still alive has its Python stacks dumped (py-spy) and is killed; at the end of the run, any process of the run's
scope still alive is killed too, and the run fails naming every process it had to kill.

Time bounds are pytest-timeout's (`timeout` in pyproject.toml, `@pytest.mark.timeout(S)` per test): on expiry it dumps
the stacks of the pytest process's threads and fails the test, whose teardown then ends its processes. Its SIGALRM acts
only once the main thread runs Python again: a test blocked in a C call that never returns (torch's TCPStore waiting
for a key nobody sets, a collective without its peers) would hang past it. Behind it, the backstop: a test still
running `timeout_backstop_margin` seconds past its bound has every thread's stack dumped by faulthandler, whose
watchdog is a C thread, and its process exits. Under pytest-xdist the controller then reports the test failed with
those stacks, kills every process the dead worker had started, and has the test skipped where xdist hands it out
again; xdist starts a new worker and the run goes on. In one process (`-n 0`) the run ends there, the stacks on
stderr.
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import pytest_timeout


SCOPES_VARIABLE = "TRL_DPPO_TEST_SCOPES"
_NEEDLE = f"{SCOPES_VARIABLE}=".encode()
# A process still alive this long after its test ended is left over: time for a server's SIGTERM to reach its engine
# and for an elastic agent to reap its workers after the launcher's test returned
GRACE_S = 5.0
_serial = itertools.count()
# py-spy reads a process's Python stacks from outside it, wherever it waits (a C call, a collective, a lock)
PY_SPY = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"


def new_scope(kind: str) -> str:
    """A name no other scope of any run has."""
    return f"{kind}-{uuid.uuid4().hex[:12]}-{next(_serial)}"


def scopes_of(environment: dict[str, str] | None = None) -> list[str]:
    return [scope for scope in (environment or os.environ).get(SCOPES_VARIABLE, "").split(":") if scope]


def with_scope(environment: dict[str, str], scope: str) -> dict[str, str]:
    """`environment` with `scope` added to the scopes its processes will carry."""
    return {**environment, SCOPES_VARIABLE: ":".join([*scopes_of(environment), scope])}


@contextmanager
def scope_of_this_process(scope: str) -> Iterator[str]:
    """Processes started from here while inside carry `scope`."""
    before = os.environ.get(SCOPES_VARIABLE)
    os.environ[SCOPES_VARIABLE] = with_scope(dict(os.environ), scope)[SCOPES_VARIABLE]
    try:
        yield scope
    finally:
        if before is None:
            del os.environ[SCOPES_VARIABLE]
        else:
            os.environ[SCOPES_VARIABLE] = before


def processes_in(scope: str) -> dict[int, str]:
    """The live processes (not zombies, not this one) started in `scope`: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]  # after the name, which may hold spaces
            environment = (entry / "environ").read_bytes().split(b"\0")
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue  # ended meanwhile, or not ours to read
        if state == "Z":
            continue
        for variable in environment:
            if variable.startswith(_NEEDLE) and scope in variable[len(_NEEDLE) :].decode(errors="replace").split(":"):
                found[int(entry.name)] = command
                break
    return found


def python_stacks(pids) -> str:
    """py-spy's dump of each process's Python threads, where they wait (a process that is not Python says so)."""
    dumps = []
    for pid in pids:
        try:
            done = subprocess.run([PY_SPY, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
            dumps.append(done.stdout.strip() or f"process {pid}: {done.stderr.strip()}")
        except (OSError, subprocess.TimeoutExpired) as error:
            dumps.append(f"process {pid}: no stacks ({error})")
    return "\n\n".join(dumps)


def end_scope(scope: str, grace_s: float = 0.0, spare: set[int | None] = frozenset()) -> dict[int, str]:
    """Kill every process of `scope` but `spare` still alive after `grace_s`: the processes killed, pid -> command
    line."""

    def alive() -> dict[int, str]:
        return {pid: command for pid, command in processes_in(scope).items() if pid not in spare}

    deadline = time.monotonic() + grace_s
    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for _ in range(3):  # a process forked meanwhile by one of them is in the scope too
        for pid in alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
    return left


def describe(processes: dict[int, str]) -> str:
    return "\n".join(f"process {pid}: {command[:300]}" for pid, command in processes.items())


def run_bounded(
    command: list[str], env: dict[str, str], timeout_s: float, cwd: str | Path | None = None
) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True)`, bounded with everything it starts: past `timeout_s`
    (or when the test is interrupted, by its own time bound or Ctrl-C) every process of the run has its stacks dumped
    and is killed, and `subprocess.TimeoutExpired` carries the stacks and the output's tail; however it ends, no
    process it started is left."""
    scope = new_scope("launch")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:  # files: a pipe can fill and stall
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=with_scope(env, scope), cwd=cwd)
        try:
            process.wait(timeout=timeout_s)
        except BaseException as interruption:
            stacks = python_stacks(processes_in(scope))
            end_scope(scope)
            process.wait()
            err.seek(0)
            report = (
                f"{' '.join(map(str, command))[-300:]} ran past its bound; the stacks of its processes:\n{stacks}\n"
            )
            report += f"its stderr ends with:\n{err.read()[-4000:]}"
            sys.stderr.write(report + "\n")  # pytest shows it with the failure, whatever ended the test
            if isinstance(interruption, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(command, timeout_s, stderr=report) from None
            raise
        finally:
            end_scope(scope, grace_s=GRACE_S)
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, out.read(), err.read())


def kill_tree_of(launcher: subprocess.Popen) -> None:
    """SIGKILL a process started by `Popen` with `with_scope(env, scope)` and every process of that scope, without a
    handler or clean-up (the kill-and-resume tests' kill)."""
    environment = dict(
        variable.split("=", 1)
        for variable in Path(f"/proc/{launcher.pid}/environ").read_text(errors="replace").split("\0")
        if "=" in variable
    ) if launcher.poll() is None else {}  # fmt: skip
    try:
        launcher.kill()
    except ProcessLookupError:
        pass
    if environment:
        end_scope(scopes_of(environment)[-1])
    launcher.wait()


# The plugin: a scope for the run and one for each test


class _Leftovers:
    """What the run had to kill: (where, pid, command line)."""

    def __init__(self):
        self.killed: list[tuple[str, int, str]] = []

    def record(self, where: str, processes: dict[int, str]) -> None:
        self.killed += [(where, pid, command) for pid, command in processes.items()]


_leftovers = _Leftovers()
_run_scope: list[str] = []


def pytest_configure(config):
    if not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") != "no":
        # pytest-xdist's controller runs no test; each worker it starts has a run scope of its own (`workerinput`)
        _controller["folder"] = tempfile.mkdtemp(prefix="trl-dppo-backstop-")
        _controller["margin"] = config.getini(BACKSTOP_MARGIN)
        return
    shared = getattr(config, "workerinput", {}).get(_WORKER_INPUT)
    if shared:  # a pytest-xdist worker: the backstop writes where the controller reads
        _backstop["folder"] = Path(shared["folder"])
        stacks = _backstop["folder"] / f"{config.workerinput['workerid']}.stacks"
        _backstop["file"] = os.open(stacks, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    else:  # stderr as it is before any test's output is captured (into a file nobody reads once the process exited)
        _backstop["file"] = os.dup(2)
    scope = shared["run_scope"] if shared else new_scope("run")
    os.environ[SCOPES_VARIABLE] = with_scope(dict(os.environ), scope)[SCOPES_VARIABLE]
    _run_scope.append(scope)
    # multiprocessing's resource tracker serves this interpreter until it exits, whichever test first needed it (mp.spawn,
    # a DataLoader's or vLLM's queues): started here, it is the run's, and the end-of-run check leaves it alone
    resource_tracker.ensure_running()


@pytest.fixture(autouse=True)
def _processes_end_with_their_test(request):
    """Processes started by the test (fixtures of a wider scope started before it are the run's) end with it; one
    left alive fails the test at teardown with its stacks, and the run at its end."""
    with scope_of_this_process(new_scope("test")) as scope:
        yield
    deadline = time.monotonic() + GRACE_S
    while (left := processes_in(scope)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        stacks = python_stacks(left)
        _leftovers.record(request.node.nodeid, end_scope(scope))
        pytest.fail(f"the test left processes alive, now killed:\n{describe(left)}\nTheir stacks:\n{stacks}")


def pytest_sessionfinish(session, exitstatus):
    if _run_scope:
        tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
        _leftovers.record("the run's fixtures", end_scope(_run_scope[0], grace_s=GRACE_S, spare={tracker}))
    if _leftovers.killed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _leftovers.killed:
        terminalreporter.section("processes left alive, killed")
        for where, pid, command in _leftovers.killed:
            terminalreporter.line(f"{where}: process {pid} ({command[:300]})")
        terminalreporter.line("The run fails: every process a test starts must end with it.")


# The backstop behind pytest-timeout's bound


BACKSTOP_MARGIN = "timeout_backstop_margin"
# What pytest-xdist's controller gives each worker it starts, in `workerinput`: the worker's run scope, and the folder
# the controller shares with its workers (each worker's stacks, the tests not to run again)
_WORKER_INPUT = "trl_dppo_process_bounds"
_backstop: dict = {}  # "file": where the backstop writes the stacks; "folder": in a worker, the controller's
_controller: dict = {}  # in pytest-xdist's controller: "folder", "margin", and what each dead worker left, by its id


def pytest_addoption(parser):
    parser.addini(
        BACKSTOP_MARGIN,
        "seconds past a test's pytest-timeout bound after which its process dumps every thread's stack and exits, for "
        "a test blocked where the bound's signal never acts (tests/process_bounds.py); 0: no backstop",
        default="120",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Past the test's bound and the margin, from its start (set-up, call and teardown, as pytest-timeout counts),
    every thread's stack and the process's exit: faulthandler's watchdog is a C thread, which runs wherever the main
    thread waits. A test whose worker died while it ran is skipped if xdist hands it out again."""
    if "folder" in _backstop and item.nodeid in _lines_of(_backstop["folder"] / "crashed"):
        item.add_marker(pytest.mark.skip(reason="its worker died while it ran (its failure says where it waited)"))
        return (yield)
    if "file" not in _backstop or not item.config.pluginmanager.hasplugin("timeout"):
        return (yield)
    bound = pytest_timeout._get_item_settings(item).timeout  # the test's own mark, else the configured bound
    margin = float(item.config.getini(BACKSTOP_MARGIN))
    if not bound or not margin:
        return (yield)
    faulthandler.dump_traceback_later(bound + margin, exit=True, file=_backstop["file"])
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _lines_of(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines() if path.is_file() else []


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's controller, for each worker it starts (a replacement too): the worker's run scope, so that the
    controller can end its processes if it dies, and the shared folder."""
    node.workerinput[_WORKER_INPUT] = {"run_scope": new_scope("run"), "folder": _controller["folder"]}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """A worker died (the backstop, or a crash): every process it had started is killed after its stacks are read,
    since no teardown of the worker's will run."""
    shared = getattr(node, "workerinput", {}).get(_WORKER_INPUT)
    if error is None or not shared:
        return
    deadline = time.monotonic() + 2  # what ends by itself once its worker is gone (multiprocessing's resource tracker)
    while (left := processes_in(shared["run_scope"])) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not left:
        return
    stacks = python_stacks(left)
    killed = end_scope(shared["run_scope"])
    _leftovers.record(f"worker {node.gateway.id}, which died", killed)
    _controller[node.gateway.id] = f"The processes its worker had started, now killed:\n{describe(killed)}\n{stacks}"


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """The test a worker died in fails with the stacks the backstop wrote, and is not run again: xdist hands what its
    worker had left to run to another (with `--dist loadscope`, the rest of its module, the test included)."""
    folder, worker = Path(_controller["folder"]), report.node.gateway.id
    stacks = "\n".join(_lines_of(folder / f"{worker}.stacks"))
    if stacks:
        report.longrepr = (
            f"{report.longrepr}: still running {_controller['margin']} s past its time bound, where the bound's signal "
            f"did not act (a C call that never returns); every thread's stack, written by the backstop as it ended the "
            f"worker:\n{stacks}"
        )
    if worker in _controller:
        report.longrepr = f"{report.longrepr}\n{_controller.pop(worker)}"
    with open(folder / "crashed", "a") as crashed:
        crashed.write(crashitem + "\n")


def pytest_unconfigure(config):
    if "folder" in _controller:
        shutil.rmtree(_controller["folder"], ignore_errors=True)
    if "file" in _backstop:
        os.close(_backstop.pop("file"))
