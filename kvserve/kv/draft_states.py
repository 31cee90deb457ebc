"""Speculative decoding on a hybrid model: what a verification step keeps of a drafted sequence's linear-layer
state, so that its slot can be set back to the last accepted token once the draft is verified.

A verification step runs a drafted sequence's last token and its k draft tokens through the linear layers in the
chunked form, like a prompt chunk, which leaves the state after all 1 + k tokens in the slot. Each layer hands
here the state from before the step (a copy the layer reads anyway) with the step's inputs to the delta rule, and
the conv's inputs (its tail before the step, then the new ones), of which the tail after any token is a slice.
Once the draft is verified, `keep` sets the slot to the state after the accepted tokens (recomputed from the
state before the step over those tokens alone, only when some were rejected), and writes a checkpoint when the
accepted tokens passed a block boundary: a slot or checkpoint never holds a state that saw a rejected token.
Keeping every token's state instead would hold 1 + k states per layer, made by the token-by-token form
(`python -m kvserve.bench.delta_rule`; docs/architecture.md, "Hybrid models")."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# the state after the first n tokens of the step, recomputed from the state before it
Resume = Callable[[int], torch.Tensor]


@dataclass
class _Drafted:
    start: int  # the position of the sequence's last token, the first this step computed
    slot: int
    num_tokens: int  # 1 + k
    conv_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer: [C, K - 1 + 1 + k]
    resumes: dict[int, Resume] = field(default_factory=dict)  # per layer


class DraftStates:
    """One step's drafted sequences, by request id: where their rows are, and (filled by the linear layers) what
    sets their states back."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        self.conv, self.recurrent = conv, recurrent  # the state cache's: [layer, slot, ...]
        self.rows: list[tuple[slice, int]] = []  # (rows of the flat batch, slot) of each drafted sequence
        self._drafted: dict[str, _Drafted] = {}
        self._by_slot: dict[int, _Drafted] = {}

    def add(self, request_id: str, rows: slice, slot: int, start: int) -> None:
        self.rows.append((rows, slot))
        self._drafted[request_id] = self._by_slot[slot] = _Drafted(start, slot, rows.stop - rows.start)

    def record(self, layer: int, slot: int, conv_input: torch.Tensor, resume: Resume) -> None:
        """A linear layer's conv inputs [C, K - 1 + T] (its tail before the step, then the step's) and how to
        recompute its recurrent state after the first n of the T tokens, for the sequence in `slot`."""
        drafted = self._by_slot[slot]
        drafted.conv_inputs[layer], drafted.resumes[layer] = conv_input, resume

    def start(self, request_id: str) -> int | None:
        """The first position `request_id` computed this step; None if it verified no draft."""
        drafted = self._drafted.get(request_id)
        return drafted.start if drafted is not None else None

    def keep(self, request_id: str, num_tokens: int, into: int | None = None) -> None:
        """Write every linear layer's state after the first `num_tokens` tokens of the step into the sequence's
        slot, or into slot `into` (a checkpoint)."""
        drafted = self._drafted[request_id]
        whole = num_tokens == drafted.num_tokens  # the slot holds it already
        if whole and into is None:
            return
        slot = drafted.slot if into is None else into
        tail = self.conv.shape[-2]
        for layer, resume in drafted.resumes.items():
            self.conv[layer, slot] = drafted.conv_inputs[layer][:, num_tokens : num_tokens + tail].T
            self.recurrent[layer, slot] = self.recurrent[layer, drafted.slot] if whole else resume(num_tokens)

    def drop(self, request_id: str) -> None:
        """Let go of what was kept for `request_id` (its draft is verified)."""
        drafted = self._drafted.pop(request_id, None)
        if drafted is not None:
            del self._by_slot[drafted.slot]
