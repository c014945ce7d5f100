"""A run killed (SIGKILL) after a checkpoint and resumed from it logs what an uninterrupted run logs, step by step.

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
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .resume_worker import CHECKPOINT_SAVED, SAVE_STEPS


REPO = Path(__file__).resolve().parents[1]
WORKER = str(REPO / "tests" / "resume_worker.py")
TIMINGS = ("step_time",)


def start(model_dir: str, output_dir: Path, mode: str) -> subprocess.Popen:
    """The worker in MODE; its stderr goes to a file (a pipe nobody reads could fill up and stall it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / f"stderr-{mode}.log", "w") as stderr:
        command = [sys.executable, WORKER, model_dir, str(output_dir), mode]
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)


def stderr_tail(output_dir: Path, mode: str) -> str:
    return (output_dir / f"stderr-{mode}.log").read_text()[-4000:]


def finish(process: subprocess.Popen, output_dir: Path, mode: str) -> None:
    process.wait(timeout=600)
    assert process.returncode == 0, stderr_tail(output_dir, mode)


def logged_steps(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_killed_run_resumed_from_its_checkpoint_logs_what_an_uninterrupted_run_logs(tiny_model_dir, tmp_path):
    straight_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"
    straight = start(tiny_model_dir, straight_dir, "straight")
    killed = start(tiny_model_dir, killed_dir, "stop_after_checkpoint")
    deadline = time.monotonic() + 600
    while not (killed_dir / CHECKPOINT_SAVED).exists():
        assert killed.poll() is None, stderr_tail(killed_dir, "stop_after_checkpoint")
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.5)
    killed.kill()  # SIGKILL: no handler, no clean-up
    killed.wait()
    assert (killed_dir / f"checkpoint-{SAVE_STEPS}" / "dppo_masked_token_counts.json").exists()
    finish(straight, straight_dir, "straight")
    finish(start(tiny_model_dir, killed_dir, "resume"), killed_dir, "resume")

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
