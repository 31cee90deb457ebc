"""Multi-turn cost on a stateless chat API: each turn re-sends the whole conversation as one request.

Without prefix caching every turn prefills its whole prompt again. With it, the previous turn's full
blocks are still cached (assuming they were not evicted and the history is re-sent token for token), so a
turn prefills only its new question plus the tail of the previous turn that did not fill a block.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner.kv_size import KVDtype, request_kv_bytes
from kvserve.planner.model_spec import ModelSpec


@dataclass(frozen=True)
class Turn:
    """One request of the conversation and what it costs."""

    turn: int
    new_input_tokens: int
    prompt_tokens: int
    final_tokens: int  # prompt + answer: what the request holds when it finishes
    kv_bytes: int  # KV held at the end of the turn (whole blocks)
    prefill_tokens_without_prefix_cache: int
    prefill_tokens_with_prefix_cache: int


@dataclass(frozen=True)
class ConversationPlan:
    """All turns of a conversation and their totals."""

    turns: tuple[Turn, ...]

    @property
    def new_input_tokens(self) -> int:
        return sum(t.new_input_tokens for t in self.turns)

    @property
    def prefill_tokens_without_prefix_cache(self) -> int:
        return sum(t.prefill_tokens_without_prefix_cache for t in self.turns)

    @property
    def prefill_tokens_with_prefix_cache(self) -> int:
        return sum(t.prefill_tokens_with_prefix_cache for t in self.turns)

    @property
    def final_tokens(self) -> int:
        return self.turns[-1].final_tokens

    @property
    def final_kv_bytes(self) -> int:
        return self.turns[-1].kv_bytes

    @property
    def recompute_factor(self) -> float:
        """Tokens prefilled without prefix caching per token the user actually sent."""
        return self.prefill_tokens_without_prefix_cache / self.new_input_tokens


def plan_conversation(
    spec: ModelSpec, kv_dtype: KVDtype, first: int, question: int, answer: int, turns: int, block_size: int
) -> ConversationPlan:
    """Turns of `first` tokens (system prompt + first question), then `question`-token questions,
    each answered with `answer` tokens."""
    for label, value in (("first", first), ("question", question), ("answer", answer), ("turns", turns)):
        if value < 1:
            raise ValueError(f"--{label} must be at least 1, got {value}")
    plan, history = [], 0
    for index in range(1, turns + 1):
        new_tokens = first if index == 1 else question
        prompt = history + new_tokens
        cached = history // block_size * block_size  # only full blocks are hashed and reused
        final = prompt + answer
        plan.append(Turn(
            turn=index,
            new_input_tokens=new_tokens,
            prompt_tokens=prompt,
            final_tokens=final,
            kv_bytes=request_kv_bytes(spec, kv_dtype, final, block_size),
            prefill_tokens_without_prefix_cache=prompt,
            prefill_tokens_with_prefix_cache=prompt - cached,
        ))
        history = final
    return ConversationPlan(tuple(plan))
