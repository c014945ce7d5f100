"""What every process needs to resume from a checkpoint: a run of several CPU processes loads its optimizer state
(transformers loads it with `map_location=args.device`, which accelerate makes `cpu:0` on every process of a
multi-process CPU launch, and torch restores "cpu" only); a machine that saved its own DeepSpeed checkpoint finds it
named in `latest` (DeepSpeed writes that file on the global rank 0 only). The resume itself, two processes and two
machines: tests/test_kill_and_resume.py."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

from trl_dppo.checkpoints import complete_deepspeed_checkpoint_on_this_machine

from .conftest import require_deepspeed


def test_optimizer_state_loads_onto_an_indexed_cpu_device_once_accepted(tmp_path):
    # In a fresh interpreter: the deserializer is registered once per process, for good
    script = textwrap.dedent(f"""
        import torch
        from trl_dppo.checkpoints import accept_indexed_cpu_device
        path = {str(tmp_path / "optimizer.pt")!r}
        torch.save({{"exp_avg": torch.arange(4.0)}}, path)
        try:
            torch.load(path, map_location=torch.device("cpu", 0))
        except RuntimeError as error:
            assert "tagged with cpu:0" in str(error), error
        else:
            raise AssertionError("torch restored cpu:0 by itself: the workaround is no longer needed")
        accept_indexed_cpu_device(torch.device("cuda", 0))  # another device: nothing registered
        accept_indexed_cpu_device(torch.device("cpu"))  # no index: torch restores it itself
        accept_indexed_cpu_device(torch.device("cpu", 0))
        accept_indexed_cpu_device(torch.device("cpu", 0))  # twice: once registered
        loaded = torch.load(path, map_location=torch.device("cpu", 0))
        assert torch.equal(loaded["exp_avg"], torch.arange(4.0)) and loaded["exp_avg"].device.type == "cpu"
        assert torch.load(path, map_location="cpu")["exp_avg"].device.type == "cpu"
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_machine_saving_its_own_deepspeed_checkpoint_names_it_in_latest_as_deepspeed_does_on_the_main_machine(
    tmp_path,
):
    (tmp_path / "global_step2").mkdir()
    complete_deepspeed_checkpoint_on_this_machine(str(tmp_path))
    assert (tmp_path / "latest").read_text() == "global_step2"  # what DeepSpeed's load_checkpoint(tag=None) reads

    (tmp_path / "latest").write_text("global_step2")  # the main machine's, by DeepSpeed: left as it is
    complete_deepspeed_checkpoint_on_this_machine(str(tmp_path))
    assert (tmp_path / "latest").read_text() == "global_step2"


def test_a_deepspeed_checkpoint_with_several_steps_and_no_latest_is_refused_by_name(tmp_path):
    (tmp_path / "global_step2").mkdir()
    (tmp_path / "global_step4").mkdir()
    with pytest.raises(RuntimeError, match=r"2 global_step folders \(\['global_step2', 'global_step4'\]\)"):
        complete_deepspeed_checkpoint_on_this_machine(str(tmp_path))


def test_deepspeed_writes_latest_on_the_global_rank_0_only():
    """Why the trainers write `latest` on the other machines (tests/test_kill_and_resume.py resumes them). If this
    fails, DeepSpeed writes it on every machine now, and `complete_deepspeed_checkpoint_on_this_machine` can go."""
    require_deepspeed()
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert "if save_latest and self.global_rank == 0:" in inspect.getsource(DeepSpeedEngine.save_checkpoint)
