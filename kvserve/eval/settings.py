"""The KV cache settings an evaluation compares: the cross product of the values given for each swept option.

`--kv-cache-dtype auto,int8,int4` gives three settings; the first is the reference the others are compared with.
`--quantization none,int8` compares weight formats the same way."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from kvserve.planner.kv_size import HEAD_STREAM_POLICIES as _PER_HEAD

# EngineConfig fields an evaluation may sweep, in the order a setting's label names them
SWEPT_FIELDS = ("quantization", "kv_cache_dtype", "kv_eviction", "kv_sink_tokens", "kv_recent_tokens", "kv_budget_tokens")
# the fields that matter only with some eviction policies
_USED_BY = {"kv_sink_tokens": ("streaming", "h2o", *_PER_HEAD), "kv_recent_tokens": ("streaming", "h2o", *_PER_HEAD),
            "kv_budget_tokens": ("h2o", *_PER_HEAD)}
_SHORT = {"kv_sink_tokens": "sinks", "kv_recent_tokens": "recent", "kv_budget_tokens": "budget"}


@dataclass(frozen=True)
class Setting:
    """Engine options that differ between the evaluated settings (everything else is shared)."""

    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        parts = [self.options.get("kv_cache_dtype", "auto")]
        if self.options.get("quantization", "none") != "none":
            parts.insert(0, f"{self.options['quantization']} weights")
        eviction = self.options.get("kv_eviction", "none")
        if eviction != "none":
            details = [f"{_SHORT[name]} {self.options[name]}" for name in _USED_BY if name in self.options]
            parts.append(f"{eviction} ({', '.join(details)})" if details else eviction)
        return " + ".join(parts)

    def value(self, name: str, default: Any = None) -> Any:
        return self.options.get(name, default)


def parse_list(text: str, kind: type = str) -> list[Any]:
    """Values of a comma-separated option ("auto,int8"); raises ValueError naming a bad item."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ValueError(f"empty item in {text!r}")
    try:
        return [kind(item) for item in items]
    except ValueError as exc:
        raise ValueError(f"cannot read {text!r} as a list of {kind.__name__}: {exc}") from exc


def cross_product(values: dict[str, list[Any]]) -> list[Setting]:
    """One Setting per combination, in the order given; duplicates dropped."""
    names = [name for name in SWEPT_FIELDS if name in values]
    settings, seen = [], set()
    for combo in itertools.product(*(values[name] for name in names)):
        options = dict(zip(names, combo))
        eviction = options.get("kv_eviction", "none")
        options = {k: v for k, v in options.items() if eviction in _USED_BY.get(k, (eviction,))}
        key = tuple(sorted(options.items()))
        if key not in seen:
            seen.add(key)
            settings.append(Setting(options))
    return settings


def parse_setting(spec: str) -> Setting:
    """One explicit setting, "kv_eviction=h2o,kv_budget_tokens=1024" (the swept fields; ints where they are)."""
    options: dict[str, Any] = {}
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in SWEPT_FIELDS:
            raise ValueError(f"--setting {spec!r}: expected name=value pairs with names from {', '.join(SWEPT_FIELDS)}")
        options[name] = value.strip() if name in ("quantization", "kv_cache_dtype", "kv_eviction") else int(value)
    return cross_product({name: [value] for name, value in options.items()})[0]
