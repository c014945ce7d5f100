"""A tiny vision-language model and an image-prompt dataset, built offline in the test session: the setup
`test_vlm*.py` share.

The model is an Idefics3 (the architecture of SmolVLM, HuggingFaceTB's vision-language SmolLM2): a one-layer SigLIP
vision tower, Idefics3's pixel-shuffle connector and a 2-layer Llama over SmolLM2's tokenizer with Idefics3's image
tokens added; its processor is Idefics3's, whole images resized to 56 px (4 image tokens each). Why Idefics3: vLLM's
CPU build runs with PyTorch's CPU wheel, beside which PyPI's torchvision cannot be installed (`scripts/setup.sh`), and
without torchvision vLLM 0.31 cannot import its Qwen2-VL, Qwen2.5-VL, Gemma 3, LLaVA or LLaVA-NeXT models, and
transformers 5.17 cannot build a Qwen2-VL or SmolVLM processor (their video processors need it); Idefics3 imports on
both sides. Like `conftest.build_tiny_model`, the output layer is scaled so that next-token distributions are peaked
and a misaligned mu shows.
"""

from __future__ import annotations

import copy

import torch
import transformers.models.idefics3
from datasets import Dataset
from PIL import Image
from transformers import AutoProcessor, Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
from transformers.models.idefics3 import Idefics3Processor
from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

from .conftest import forward_logprob_atol, make_trainer


# transformers 5.17 files Idefics3's PIL image processor under the torchvision backend in its lazy module, so without
# torchvision `AutoProcessor` (which vLLM uses too) gets a placeholder; the class itself needs no torchvision
transformers.models.idefics3.Idefics3ImageProcessorPil = Idefics3ImageProcessorPil

IMAGE_TOKEN = "<image>"
IMAGE_TOKENS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]
IMAGE_SIZE = 56  # px: (56 / 14)^2 patches, pixel-shuffled by 2, make 4 image tokens
IMAGE_SEQ_LEN = 4
HIDDEN_SIZE = 256  # vLLM's CPU attention needs a head dimension of 32 or more (4 heads of 64)
HEAD_SCALE = 10.0
# The model's layers whose dot products a forward pass sums: the vision tower's, the connector's, the Llama's
FORWARD_LAYERS = 1 + 1 + 2
# The largest logit at the completion positions of the test prompts (measured 16.0); 20 bounds it
VLM_LOGIT_SIZE = 20.0
# ChatML as SmolLM2's template writes it, with an image part rendered as Idefics3's image placeholder
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0)}
QUESTION = "What colour is this?"


def build_tiny_vlm(tokenizer, seed: int = 0) -> tuple[Idefics3ForConditionalGeneration, Idefics3Processor]:
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    special = dict(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **special,
    )
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=14,
    )
    config = Idefics3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=2,
        tie_word_embeddings=False,
        **special,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=False
    )
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE, image_seq_len=IMAGE_SEQ_LEN
    )
    return model, processor


def colour_prompts(copies: int = 4) -> Dataset:
    """Solid-colour images, each with the question and its colour's name (for the reward)."""
    rows = [
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
            "image": Image.new("RGB", (32, 32), rgb),
            "colour": name,
        }
        for _ in range(copies)
        for name, rgb in COLOURS.items()
    ]
    return Dataset.from_list(rows)


def colour_reward(completions, colour, **kwargs) -> list[float]:
    """1 for naming the image's colour, plus a little length-dependent spread so that advantages are non-zero."""
    return [
        float(name in completion[0]["content"].lower()) + len(completion[0]["content"]) % 3 / 3
        for completion, name in zip(completions, colour, strict=True)
    ]


TEMPERATURE = 0.7
TOPK = 5
# LoRA on the language model: the vision tower has q_proj / v_proj of its own, left alone
LANGUAGE_MODEL_LORA = dict(r=4, lora_alpha=8, target_modules=r".*text_model.*\.(q_proj|v_proj)")


def vlm_trainer(tmp_path, model_dir, **overrides):
    settings = dict(temperature=TEMPERATURE, max_completion_length=10, divergence_topk=TOPK, log_completions=True)
    settings.update(overrides)
    return make_trainer(
        tmp_path,
        model_dir,
        colour_prompts(),
        AutoProcessor.from_pretrained(model_dir),
        reward_funcs=colour_reward,
        lora=LANGUAGE_MODEL_LORA,
        **settings,
    )


def vlm_logprob_atol(vocab_size: int, logps: torch.Tensor) -> float:
    """`conftest.forward_logprob_atol` for the tiny VLM: its vision tower, connector and Llama each sum dot products
    of up to `HIDDEN_SIZE` terms in another order in the sampler's and the trainer's passes."""
    magnitude = logps[torch.isfinite(logps)].abs().max().item()
    return forward_logprob_atol(vocab_size, magnitude, HIDDEN_SIZE, FORWARD_LAYERS, VLM_LOGIT_SIZE)


def full_logps(trainer, inputs, with_images: bool = True) -> torch.Tensor:
    """log softmax(logits / T) over the vocabulary at every completion position, `(B, T, V)`: a forward pass of its
    own with the batch's image fields (or without them: the image tokens then embed as plain tokens)."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    images = {key: inputs[key] for key in ("pixel_values", "pixel_attention_mask")} if with_images else {}
    with torch.no_grad():
        logits = trainer.model(input_ids=input_ids, attention_mask=attention_mask, **images).logits
    completion_logits = logits[:, inputs["prompt_ids"].size(1) - 1 : -1].float()
    return torch.log_softmax(completion_logits / TEMPERATURE, dim=-1)
