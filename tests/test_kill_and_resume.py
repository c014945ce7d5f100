"""A run killed (SIGKILL) after a checkpoint and resumed from it logs what an uninterrupted run logs, step by step:
one process, and two processes under DeepSpeed ZeRO-3 (examples/accelerate_configs/cpu_zero3.yaml), whose checkpoint
is DeepSpeed's own layout (each process's partition of the parameters and optimizer state).

Same seed, transformers generation, a tiny peaked model with LoRA, 2 optimizer steps per generation batch, a
checkpoint after step 2 (between generation batches). transformers restores the optimizer, scheduler, data position
and RNG states from the checkpoint, so the resumed run samples the same completions; DPPOTrainer restores its
masked-token counts (`masked_tokens.json`). Everything logged except wall-clock times is equal.
A checkpoint inside a generation batch (`save_steps` not a multiple of `steps_per_generation`) would resume by
generating a new batch, so the steps up to the next generation would differ; the example keeps them aligned.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import launch_command, require_deepspeed
from .resume_worker import CHECKPOINT_SAVED, SAVE_STEPS


REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "resume_worker.py"
TIMINGS = ("step_time",)
LAUNCHES = {"one_process": {"processes": 1}, "zero3": {"processes": 2, "accelerate_config": "cpu_zero3.yaml"}}


def start(model_dir: str, output_dir: Path, mode: str, launch: dict) -> subprocess.Popen:
    """The worker in MODE, in a session of its own (a kill reaches every process of a launch); its stderr goes to a
    file (a pipe nobody reads could fill up and stall it)."""
    command, env = launch_command(WORKER, **launch)
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / f"stderr-{mode}.log", "w") as stderr:
        return subprocess.Popen(
            [*command, model_dir, str(output_dir), mode],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )


def stderr_tail(output_dir: Path, mode: str) -> str:
    return (output_dir / f"stderr-{mode}.log").read_text()[-4000:]


def finish(process: subprocess.Popen, output_dir: Path, mode: str) -> None:
    process.wait(timeout=600)
    assert process.returncode == 0, stderr_tail(output_dir, mode)


def logged_steps(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_killed_run_resumed_from_its_checkpoint_logs_what_an_uninterrupted_run_logs(tiny_model_dir, tmp_path, launch):
    if launch == "zero3":
        require_deepspeed()
    launch = LAUNCHES[launch]
    straight_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"
    straight = start(tiny_model_dir, straight_dir, "straight", launch)
    killed = start(tiny_model_dir, killed_dir, "stop_after_checkpoint", launch)
    deadline = time.monotonic() + 600
    while not (killed_dir / CHECKPOINT_SAVED).exists():
        assert killed.poll() is None, stderr_tail(killed_dir, "stop_after_checkpoint")
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.5)
    os.killpg(killed.pid, signal.SIGKILL)  # no handler, no clean-up, the launcher and its processes alike
    killed.wait()
    checkpoint = killed_dir / f"checkpoint-{SAVE_STEPS}"
    assert (checkpoint / "dppo_masked_token_counts.json").exists()
    if launch["processes"] > 1:  # DeepSpeed's layout: each process's partition of the parameters and optimizer
        assert len(list((checkpoint / f"global_step{SAVE_STEPS}").glob("*optim_states.pt"))) == 2
    finish(straight, straight_dir, "straight")
    finish(start(tiny_model_dir, killed_dir, "resume", launch), killed_dir, "resume")

    uninterrupted = logged_steps(straight_dir / "steps-straight.jsonl")
    interrupted = logged_steps(killed_dir / "steps-stop_after_checkpoint.jsonl")
    interrupted += logged_steps(killed_dir / "steps-resume.jsonl")
    assert [entry["step"] for entry in interrupted] == [entry["step"] for entry in uninterrupted] == [1, 2, 3, 4]
    for got, want in zip(interrupted, uninterrupted, strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            # None: a rate over no token in its window (docs/metrics.md), such as the blocked share of no bad update
            expected = None if value is None else pytest.approx(value, rel=1e-6, abs=1e-9)
            assert got[key] == expected, (got["step"], key)

    # Tokens were masked before the kill: the final report holds them only if the checkpoint carried the counts
    assert any(entry["trust_region/masked_fraction"] > 0 for entry in uninterrupted[:SAVE_STEPS])
    report = json.loads((killed_dir / "masked_tokens.json").read_text())
    assert report == json.loads((straight_dir / "masked_tokens.json").read_text())
