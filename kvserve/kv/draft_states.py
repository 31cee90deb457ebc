"""Speculative decoding on a hybrid model: the linear layers' state after each token a drafted sequence verifies,
kept for one step so that the state slot can be set back to the last accepted token.

A verification step runs a drafted sequence's last token and its k draft tokens through the linear layers one
token at a time (the recurrent form, as decode steps do), which makes the state after every token anyway; the
layers hand each one here instead of dropping it, with the conv's inputs (the tail before the step and the k + 1
new ones) from which the tail after each token is a slice. Once the draft is verified, `keep` writes the state
after the accepted tokens into the sequence's slot, and into a checkpoint slot when the accepted tokens passed a
block boundary: a slot or checkpoint never holds a state that saw a rejected token."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _Drafted:
    start: int  # the position of the sequence's last token, the first this step computed
    slot: int
    conv_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer: [C, K - 1 + T]
    states: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # per layer: T states [H, Dk, Dv]


class DraftStates:
    """One step's drafted sequences, by request id: where their rows are, and (filled by the linear layers) the
    state after each of their tokens."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        self.conv, self.recurrent = conv, recurrent  # the state cache's: [layer, slot, ...]
        self.rows: list[tuple[slice, int]] = []  # (rows of the flat batch, slot) of each drafted sequence
        self._drafted: dict[str, _Drafted] = {}
        self._by_slot: dict[int, _Drafted] = {}

    def __bool__(self) -> bool:
        return bool(self._drafted)

    def add(self, request_id: str, rows: slice, slot: int, start: int) -> None:
        self.rows.append((rows, slot))
        self._drafted[request_id] = self._by_slot[slot] = _Drafted(start, slot)

    def record(self, layer: int, slot: int, conv_input: torch.Tensor, states: list[torch.Tensor]) -> None:
        """A linear layer's conv inputs [C, K - 1 + T] (its tail before the step, then the new tokens') and the
        recurrent state after each of the T tokens, for the sequence in `slot`."""
        drafted = self._by_slot[slot]
        drafted.conv_inputs[layer], drafted.states[layer] = conv_input, states

    def start(self, request_id: str) -> int | None:
        """The first position `request_id` computed this step; None if it verified no draft."""
        drafted = self._drafted.get(request_id)
        return drafted.start if drafted is not None else None

    def keep(self, request_id: str, num_tokens: int, into: int | None = None) -> None:
        """Write every linear layer's state after the first `num_tokens` tokens of the step into the sequence's
        slot, or into slot `into` (a checkpoint)."""
        drafted = self._drafted[request_id]
        slot = drafted.slot if into is None else into
        tail = self.conv.shape[-1]
        for layer, states in drafted.states.items():
            if into is None and num_tokens == len(states):
                continue  # the layer left the slot at its last token
            self.conv[layer, slot] = drafted.conv_inputs[layer][:, num_tokens : num_tokens + tail]
            self.recurrent[layer, slot] = states[num_tokens - 1]
