"""What the registries of `trust_regions.py` and `corrections.py` share: a registered function, with the settings
read from its keyword-only parameters and their defaults, and resolved from the user's kwargs over them."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch


__all__ = ["Registered"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Registered:
    """A registered function: its name, its equation and source (the docs' table), its settings with their defaults,
    and how they are checked. A subclass names its kind and what the function takes before its settings."""

    kind: ClassVar[str]  # "trust region", "correction": in the errors
    inputs: ClassVar[tuple[str, ...]] = ("the TrustRegionInput",)  # what it takes before its settings
    settings_need_defaults: ClassVar[bool] = False
    config_fields: ClassVar[tuple[str, ...]] = ()  # settings that come from the config's own fields, never the kwargs

    name: str
    function: Callable[..., Any]
    equation: str
    settings: dict[str, Any]  # keyword-only parameter -> default (inspect.Parameter.empty when it has none)
    check_settings: Callable[..., None] | None = None
    source: str = ""  # where it comes from (the docs' table)

    @torch.no_grad()
    def __call__(self, *inputs: Any, **settings: Any) -> Any:
        return self.function(*inputs, **settings)

    @classmethod
    def register(cls, registry: dict[str, Any], name: str, fn: F, **fields: Any) -> F:
        """Add `fn` to `registry` as `name`, with the settings its signature declares after `cls.inputs`."""
        if name in registry:
            raise ValueError(f"A {cls.kind} named {name!r} is already registered; choose another name.")
        params = list(inspect.signature(fn).parameters.values())[len(cls.inputs) :]
        defaults = " with defaults" if cls.settings_need_defaults else ""
        wrong = [p.name for p in params if p.kind is not p.KEYWORD_ONLY or (defaults and p.default is p.empty)]
        if wrong:
            raise TypeError(
                f"{fn.__qualname__} takes {' and '.join(cls.inputs)}, then its settings as keyword-only parameters"
                f"{defaults} (after `*`) so that DPPOConfig can fill them by name; {wrong} are not keyword-only"
                f"{defaults}."
            )
        registry[name] = cls(name=name, function=fn, settings={p.name: p.default for p in params}, **fields)
        return fn

    def _resolve(
        self, kwargs: Mapping[str, Any] | None, given_in: str, taker: str, shared: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The settings, checked: from `kwargs` (the user's, given in `given_in`), else `shared` (the values of
        `config_fields`, which `kwargs` may not set), else the function's defaults. `taker` names it in the errors."""
        kwargs, shared = dict(kwargs or {}), shared or {}
        unknown = sorted(set(kwargs) - set(self.settings))
        if unknown:
            takes = ", ".join(f"{n!r}" for n in self.settings if n not in self.config_fields) or "no settings"
            raise ValueError(f"{given_in} has {unknown}, which {taker} does not take; it takes {takes}.")
        shadowed = sorted(set(kwargs) & set(self.config_fields))
        if shadowed:
            raise ValueError(
                f"{shadowed} are DPPOConfig fields (shared by every method); set them there, not in {given_in}."
            )
        values = {name: kwargs.get(name, shared.get(name, default)) for name, default in self.settings.items()}
        for name, value in values.items():
            if value is inspect.Parameter.empty:
                raise ValueError(
                    f"{taker} needs the setting {name!r}: pass it in {given_in}, or give the parameter `{name}` of "
                    f"{self.function.__qualname__} a default."
                )
        if self.check_settings is not None:
            self.check_settings(**values)
        return values
