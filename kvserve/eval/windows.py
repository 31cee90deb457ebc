"""Which tokens each evaluation window holds and scores (transformers' sliding-window perplexity).

Windows of `context` tokens start every `stride` tokens; each scores only the tokens no earlier window
scored, so every token after the first is scored exactly once and, after the first window, with at least
`context - stride` tokens before it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    start: int  # first token of the window in the text
    end: int  # one past its last token
    num_scored: int  # its last `num_scored` tokens are scored (predicted from the tokens before them)


def sliding_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    if not 0 < stride < context:
        raise ValueError(f"stride ({stride}) must be positive and smaller than context ({context})")
    if num_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, got {num_tokens}")
    windows, scored_until = [], 1  # the text's first token has nothing to be predicted from
    for start in range(0, num_tokens, stride):
        end = min(start + context, num_tokens)
        windows.append(Window(start, end, end - scored_until))
        scored_until = end
        if end == num_tokens:
            break
    return windows
