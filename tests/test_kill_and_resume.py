"""A run killed (SIGKILL) after a checkpoint and resumed from it (`resume_from_checkpoint=True`) logs what an
uninterrupted run logs, step by step, on every launch: one process; two under DeepSpeed ZeRO-3
(examples/accelerate_configs/cpu_zero3.yaml), whose checkpoint is DeepSpeed's own layout (each process's partition of
the parameters and optimizer state); and two "machines" of one process each on loopback (`--num_machines 2
--machine_rank R`), DDP and ZeRO-3 each with its own output folder (no shared filesystem: `save_on_each_node=True`, as
transformers asks, so each machine writes and resumes its own checkpoint), and ZeRO-3 sharing one (where DeepSpeed's
`latest` file may be written by each machine's main process: trl_dppo/checkpoints.py). DDP with one shared folder
would differ from its own-folders cell only in transformers writing from the global rank 0 alone, which the ZeRO-3
shared-folder cells run too. The reference
is the uninterrupted run of the same launch: ZeRO-3 on two machines logs what ZeRO-3 on one machine of two processes
logs only to within float rounding (measured once: the loss 1.1e-6 apart, relative; the cause not traced), where a
resume must match exactly. The own-folders and shared-folder cells share it.

Same seed, transformers generation, a tiny peaked model with LoRA, 2 optimizer steps per generation batch, a
checkpoint after step 2 (between generation batches). transformers restores the optimizer, scheduler, data position
and RNG states from the checkpoint, so the resumed run samples the same completions; DPPOTrainer restores its
masked-token counts (`masked_tokens.json`, written by the main process into its machine's folder). Everything logged
except wall-clock times is equal. A checkpoint inside a generation batch (`save_steps` not a multiple of
`steps_per_generation`) would resume by generating a new batch, so the steps up to the next generation would differ;
the example keeps them aligned.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import free_port, kill_launch, launch_command, require_deepspeed
from .resume_worker import CHECKPOINT_SAVED, SAVE_STEPS


REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "resume_worker.py"
TIMINGS = ("step_time",)


@dataclass(frozen=True)
class Launch:
    processes: int = 1  # in all, over all machines
    accelerate_config: str = "cpu_2proc.yaml"
    machines: int = 1
    shared_folder: bool = True

    def folders(self, run_dir: Path) -> list[Path]:
        """Each machine's output folder: one shared, or one each (machine 0's holds the main process's files)."""
        return [run_dir if self.shared_folder else run_dir / f"machine{rank}" for rank in range(self.machines)]

    def with_shared_folder(self) -> Launch:
        return Launch(self.processes, self.accelerate_config, self.machines)


LAUNCHES = {
    "one_process": Launch(),
    "zero3": Launch(2, "cpu_zero3.yaml"),
    "ddp-two_machines-own_folders": Launch(2, machines=2, shared_folder=False),
    "zero3-two_machines-own_folders": Launch(2, "cpu_zero3.yaml", machines=2, shared_folder=False),
    "zero3-two_machines-shared_folder": Launch(2, "cpu_zero3.yaml", machines=2),
}


class Run:
    """One launch of the worker in MODE: a launcher per machine; stderr goes to files (a pipe nobody reads could fill
    up and stall it)."""

    def __init__(self, model_dir: str, run_dir: Path, mode: str, launch: Launch):
        self.mode, self.folders = mode, launch.folders(run_dir)
        port = free_port()  # the main process's, which every machine's launcher is told
        self.processes = []
        for rank, folder in enumerate(self.folders):
            command, env = launch_command(
                WORKER,
                launch.processes,
                launch.accelerate_config,
                port=port,
                machines=launch.machines,
                machine_rank=rank,
                vllm=False,
            )
            arguments = [model_dir, str(folder), mode] + ([] if launch.shared_folder else ["save_on_each_node"])
            folder.mkdir(parents=True, exist_ok=True)
            with open(self.stderr_path(rank), "w") as stderr:
                process = subprocess.Popen(command + arguments, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            self.processes.append(process)

    def stderr_path(self, rank: int) -> Path:
        return self.folders[rank] / f"stderr-{self.mode}-machine{rank}.log"

    def stderr_tail(self) -> str:
        return "\n".join(self.stderr_path(rank).read_text()[-3000:] for rank in range(len(self.folders)))

    def alive(self) -> bool:
        return all(process.poll() is None for process in self.processes)

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                kill_launch(process)

    def finish(self) -> None:
        for process in self.processes:
            process.wait(timeout=600)
        assert all(process.returncode == 0 for process in self.processes), self.stderr_tail()


@pytest.fixture(scope="module")
def uninterrupted_run(tiny_model_dir, tmp_path_factory):
    """The uninterrupted run of a launch (in one shared folder: where the folders are is no part of what is logged),
    started at its first cell (it runs beside that cell's killed run) and shared by the later ones."""
    runs: dict[Launch, Run] = {}

    def run_for(launch: Launch) -> Run:
        reference = launch.with_shared_folder()
        if reference not in runs:
            runs[reference] = Run(tiny_model_dir, tmp_path_factory.mktemp("uninterrupted"), "straight", reference)
        return runs[reference]

    yield run_for
    for run in runs.values():
        run.kill()


def logged_steps(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in path.read_text().splitlines()]


@pytest.mark.launch
@pytest.mark.timeout(
    600
)  # three launches per cell: 20-62 s measured alone, up to 82 s beside the suite's other stream
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAUNCHES))
def test_killed_run_resumed_from_its_checkpoint_logs_what_an_uninterrupted_run_logs(
    tiny_model_dir, tmp_path, uninterrupted_run, name
):
    launch = LAUNCHES[name]
    if launch.accelerate_config == "cpu_zero3.yaml":
        require_deepspeed()
    straight = uninterrupted_run(launch)
    killed = Run(tiny_model_dir, tmp_path / "killed", "stop_after_checkpoint", launch)
    main_folder = killed.folders[0]  # the main process's: its marker, its logged steps, its masked_tokens.json
    deadline = time.monotonic() + 600
    while not (main_folder / CHECKPOINT_SAVED).exists():
        assert killed.alive(), killed.stderr_tail()
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.5)
    killed.kill()
    for folder in killed.folders:  # each machine without a shared folder holds its own copy
        assert (folder / f"checkpoint-{SAVE_STEPS}" / "dppo_masked_token_counts.json").exists()
    if launch.accelerate_config == "cpu_zero3.yaml":  # DeepSpeed's layout: each process's partition, where it ran
        partitions = [folder / f"checkpoint-{SAVE_STEPS}" / f"global_step{SAVE_STEPS}" for folder in killed.folders]
        assert len({path.name for partition in partitions for path in partition.glob("*optim_states.pt")}) == 2
    straight.finish()
    Run(tiny_model_dir, tmp_path / "killed", "resume", launch).finish()

    straight_dir, killed_dir = straight.folders[0], main_folder
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
