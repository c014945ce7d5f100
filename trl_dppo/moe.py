"""Mixture-of-Experts models: generation without router logits, and rollout routing replay (R3).

In an MoE model a router picks, per token and per MoE layer, the `top_k` experts the token goes through. A rounding
difference between sampler and trainer in a router's logits can flip that choice, and the trainer then scores the
token through other experts than the ones that generated it: a discrete source of |pi - mu|, not a rounding one.

Rollout routing replay (R3; Ma et al., 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers", section 3) records the sampler's expert choice for every token it forwarded and makes the
trainer's forward route each token to those experts. The variant here is the paper's: the experts are replayed, the
gate weights are recomputed from the trainer's own router logits over the replayed experts,
g_i = 1[i in E_sampler] softmax(s_train)_i (renormalised over E_sampler where the model renormalises its top-k), so
the router keeps its gradient through the weights of the experts that were used. It is the model's own gate function
with the selection replaced: replaying the experts the trainer would have chosen gives its forward bit for bit.

What the trainer does with the routes (`trainer.py`): transformers generation records them with `RoutingRecorder`
(a forward hook on each router), the generation batch's `SamplerRecords` checks them against the batch's tokens and
lays them out like the batch (`sampler_routes`), and the loss's forward replays them (`RouteReplay`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from .rollout import replaced_attribute


__all__ = [
    "ROUTERS",
    "ReplayedRoutes",
    "RouteReplay",
    "RoutingRecorder",
    "check_router_replay_support",
    "generating_without_router_logits",
    "is_moe",
    "moe_routers",
    "refuse_untrained_aux_loss",
    "replayed_gate_weights",
]

# transformers' top-k routers whose forward is `(router_logits, router_scores, router_indices) = router(hidden)` with
# scores = softmax(logits) at the top-k indices, and whether the scores are renormalised over the top k. Another
# router's gate function (sigmoid scores, grouped or biased top-k) would need its own replay, so it is refused.
ROUTERS: dict[str, Callable[[torch.nn.Module], bool]] = {
    "Qwen3MoeTopKRouter": lambda router: router.norm_topk_prob,
    "Qwen2MoeTopKRouter": lambda router: router.norm_topk_prob,
    "OlmoeTopKRouter": lambda router: router.norm_topk_prob,
    "MixtralTopKRouter": lambda router: True,
}


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers that replay supports, in layer order."""
    return [module for module in model.modules() if type(module).__name__ in ROUTERS]


def check_router_replay_support(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers, or an error saying why its routing cannot be replayed."""
    routers = moe_routers(model)
    others = sorted({type(m).__name__ for m in model.modules() if "router" in type(m).__name__.lower()} - set(ROUTERS))
    name = type(model).__name__
    if others:
        raise ValueError(
            f"use_rollout_routing_replay=True: {name} routes with {', '.join(others)}, whose gate function trl-dppo "
            f"does not replay (supported: {', '.join(ROUTERS)}). Set use_rollout_routing_replay=False."
        )
    if not routers:
        raise ValueError(
            f"use_rollout_routing_replay=True needs a Mixture-of-Experts model, and {name} has no router: a dense "
            "model has no routing to replay. Set use_rollout_routing_replay=False."
        )
    return routers


def replayed_gate_weights(router_logits: torch.Tensor, experts: torch.Tensor, renormalise: bool) -> torch.Tensor:
    """Gate weights `(N, k)` float32 of the experts `(N, k)` under the router logits `(N, E)`: softmax over all experts
    at the chosen ones, renormalised over them when the model renormalises its top-k (R3's g_i)."""
    weights = torch.softmax(router_logits.float(), dim=-1).gather(-1, experts.long())
    return weights / weights.sum(dim=-1, keepdim=True) if renormalise else weights


class RoutingRecorder:
    """Records the experts each router chose for every token a `generate()` call forwarded.

    Within `recording()`, a forward hook on each router keeps its indices `(N, k)` per forward: the prefill over the
    left-padded prompts `(B * P, k)`, then one token per sequence per decoding step. `sequence_routes` cuts them per
    completion.
    """

    def __init__(self, routers: list[torch.nn.Module]):
        self.routers = routers
        self._indices: list[list[torch.Tensor]] = [[] for _ in routers]

    @contextmanager
    def recording(self) -> Iterator[None]:
        handles = [
            router.register_forward_hook(functools.partial(self._read, layer))
            for layer, router in enumerate(self.routers)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _read(self, layer: int, module, args, output) -> None:
        self._indices[layer].append(output[2].detach().to(device="cpu", dtype=torch.int16))

    def sequence_routes(
        self, prompt_ids: list[list[int]], completion_ids: list[list[int]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per completion, the tokens `generate()` forwarded for it `(n,)` (its prompt, then its completion but the last
        token, which no forward took as input) and their routes `(n, layers, k)` int16; clears the recorder.

        The routes are laid out once, `(B, forwarded positions, layers, k)`, a layer at a time (each layer's records are
        freed as it is laid out), and each completion's are a view of them; the tokens are read in one pass over the
        lists, and each completion's are a view of them: no Python object is made per token."""
        batch = len(prompt_ids)
        if not self._indices[0]:
            raise RuntimeError("No router ran during generate(): there is no routing to replay.")
        first = self._indices[0][0]
        prompt_width = first.size(0) // batch  # the prefill's left-padded prompts
        positions = sum(call.size(0) for call in self._indices[0]) // batch
        routes = torch.empty(batch, positions, len(self.routers), first.size(-1), dtype=torch.int16)
        for layer in range(len(self.routers)):
            calls, self._indices[layer] = self._indices[layer], []
            routes[:, :, layer] = torch.cat([call.view(batch, -1, call.size(-1)) for call in calls], dim=1)
            del calls
        counts = [
            max(len(prompt) + len(completion) - 1, 0)
            for prompt, completion in zip(prompt_ids, completion_ids, strict=True)
        ]
        per_sequence = []
        for prompt, completion, count, row in zip(prompt_ids, completion_ids, counts, routes, strict=True):
            start = prompt_width - len(prompt)
            if start < 0 or start + count > row.size(0):
                raise RuntimeError(
                    f"generate() forwarded {row.size(0)} positions, fewer than a prompt of {len(prompt)} and a "
                    f"completion of {len(completion)} tokens need: its routes cannot be laid out per completion."
                )
            per_sequence.append(row[start : start + count])
        # Every token of every sequence in one pass, then each sequence's last one dropped
        lengths = np.array(
            [len(prompt) + len(completion) for prompt, completion in zip(prompt_ids, completion_ids, strict=True)]
        )
        sequences = itertools.chain.from_iterable(zip(prompt_ids, completion_ids, strict=True))
        flat = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=int(lengths.sum()))
        flat = np.delete(flat, (np.cumsum(lengths) - 1)[lengths > 0])
        return list(torch.from_numpy(flat).split(counts)), per_sequence


@dataclass
class ReplayedRoutes:
    """What one replayed forward did: the experts each layer used `(B * T, k)`, and over all layers the routing
    decisions replayed (a token with a recorded route, in one layer) and those among them where the trainer's router
    would have chosen another expert set than the sampler's."""

    experts: list[torch.Tensor] = field(default_factory=list)
    replayed: int = 0
    differing: int = 0


class RouteReplay:
    """Forward hooks on a model's routers that, while routes are armed, route each token to its recorded experts.

    `arm(routes)` with `routes` `(B, T, layers, k)` aligned with the next forward's batch `(B, T)` (`NO_ROUTE` where
    none was recorded: such a token keeps the router's own choice), `disarm()` after it. The hooks stay registered, and
    the routes armed, until `disarm`: gradient checkpointing runs each layer's forward again during the backward pass,
    and that recomputation must route as the forward did. Gate weights come from the forward's own router logits over
    the replayed experts (`replayed_gate_weights`).
    """

    def __init__(self, routers: list[torch.nn.Module]):
        self.routers = routers
        self._routes: torch.Tensor | None = None
        self._replayed = ReplayedRoutes()
        for layer, router in enumerate(routers):
            router.register_forward_hook(functools.partial(self._replay, layer))

    def arm(self, routes: torch.Tensor) -> None:
        self._routes, self._replayed = routes, ReplayedRoutes()

    def disarm(self) -> ReplayedRoutes | None:
        """Stop replaying; what the armed forward did, or None when nothing was armed."""
        replayed = self._replayed if self._routes is not None else None
        self._routes = None
        return replayed

    def _replay(self, layer: int, module, args, output):
        if self._routes is None:
            return None  # the router's own output
        router_logits, scores, own = output
        recorded = self._routes[:, :, layer].reshape(-1, self._routes.size(-1)).to(own.device)
        if recorded.size(0) != own.size(0):
            raise RuntimeError(
                f"Router replay: the forward routes {own.size(0)} tokens, but the routes armed for it cover "
                f"{recorded.size(0)}."
            )
        has_route = (recorded >= 0).all(-1, keepdim=True)
        experts = torch.where(has_route, recorded.to(own.dtype), own)
        weights = replayed_gate_weights(router_logits, experts, ROUTERS[type(module).__name__](module))
        scores = torch.where(has_route, weights.to(scores.dtype), scores)
        if len(self._replayed.experts) == layer:  # the forward, not its recomputation in the backward pass
            with torch.no_grad():
                other_set = (own.sort(-1).values != experts.sort(-1).values).any(-1, keepdim=True)
                self._replayed.replayed += int(has_route.sum())
                self._replayed.differing += int((other_set & has_route).sum())
                self._replayed.experts.append(experts.detach())
        return router_logits, scores, experts


@contextmanager
def generating_without_router_logits(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, `model.generate(...)` runs without router logits when the model's config asks for them.

    With `output_router_logits=True` in its config, an MoE model computes its load-balancing loss in every forward,
    generation's included, where transformers' `load_balancing_loss_func` compares a step's router logits (one token)
    with the whole attention mask and fails ("The size of tensor a (4) must match the size of tensor b (24)"; the
    same under GRPOTrainer). Generation needs no auxiliary loss; training still gets it (GRPOTrainer asks for router
    logits in its loss forward).
    """
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        yield
        return
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        kwargs.setdefault("output_router_logits", False)
        return original(*args, **kwargs)

    with replaced_attribute(model, "generate", generate):
        yield


def is_moe(config) -> bool:
    """Whether a model config describes a Mixture-of-Experts model: TRL's own test (it has `output_router_logits`)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return hasattr(text_config, "output_router_logits")


def refuse_untrained_aux_loss(aux_loss_enabled: bool, args) -> None:
    """Refuse an MoE's load-balancing loss that would train nothing: reentrant gradient checkpointing.

    TRL adds the router's auxiliary loss computed from the router logits of the loss's forward. Reentrant checkpointing
    runs each layer's first forward without a graph and keeps the gradient of the layer's output alone, so the router
    logits recorded inside the layer carry none, and the auxiliary loss adds nothing to the update (measured under
    ZeRO-3: the update equals the one with `router_aux_loss_coef=0.0` bit for bit). GRPOTrainer forces
    `use_reentrant=True` for a PEFT model under DeepSpeed ZeRO-3 (its workaround of deepspeedai/DeepSpeed#8130), so
    there the run would train without load balancing while logging `aux_loss`. Read after the trainer's
    `super().__init__`, which sets both.
    """
    kwargs = args.gradient_checkpointing_kwargs or {}
    if aux_loss_enabled and args.gradient_checkpointing and kwargs.get("use_reentrant"):
        raise ValueError(
            "The MoE's load-balancing loss would train nothing: gradient checkpointing runs with use_reentrant=True "
            "(TRL sets it for a PEFT model under DeepSpeed ZeRO-3), which gives the router logits recorded inside "
            "each layer no gradient, so `aux_loss` is logged but never trained. Set gradient_checkpointing=False to "
            "train it, or router_aux_loss_coef=0.0 to train without it."
        )
