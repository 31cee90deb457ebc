"""The conversation `kvserve bench multiturn` holds (one) and `--tiers` holds (many): a first prompt, then a
question a turn, as random token ids from a fixed seed, each turn answered with a fixed number of tokens."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Conversation:
    first_tokens: int = 1200
    question_tokens: int = 200
    answer_tokens: int = 500
    turns: int = 10
    seed: int = 0

    @property
    def max_len_tokens(self) -> int:
        """The last turn's prompt plus its answer."""
        return self.first_tokens + (self.turns - 1) * (self.question_tokens + self.answer_tokens) + self.answer_tokens

    def questions(self, vocab_size: int) -> list[list[int]]:
        """Turn 1's prompt, then each later turn's new question, as random ids clear of the special tokens."""
        import torch

        g = torch.Generator().manual_seed(self.seed)
        lengths = [self.first_tokens] + [self.question_tokens] * (self.turns - 1)
        return [torch.randint(100, vocab_size - 100, (n,), generator=g).tolist() for n in lengths]
