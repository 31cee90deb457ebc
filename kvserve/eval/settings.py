"""The KV cache settings an evaluation compares: the cross product of the values given for each swept option.

`--kv-cache-dtype auto,int8,int4` gives three settings; the first is the reference the others are compared with."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

# EngineConfig fields an evaluation may sweep, in the order a setting's label names them
SWEPT_FIELDS = ("kv_cache_dtype",)


@dataclass(frozen=True)
class Setting:
    """Engine options that differ between the evaluated settings (everything else is shared)."""

    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return " ".join(str(self.options[name]) for name in SWEPT_FIELDS if name in self.options) or "auto"

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
        if combo not in seen:
            seen.add(combo)
            settings.append(Setting(dict(zip(names, combo))))
    return settings
