"""Request validation at the edge: a prompt, its length and its sampling parameters checked against the model and
the engine's limits before anything is queued, each refusal a ValueError that names the problem and the bound."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.sampling_params import SamplingParams, is_text


def checked_params(params: SamplingParams | None) -> SamplingParams:
    """The request's sampling parameters (the defaults when none are given)."""
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    return params


def longest_token_chars(tokenizer: Any | None) -> int:
    """The characters of the vocabulary's longest token (0 without a tokenizer)."""
    return max(map(len, tokenizer.get_vocab())) if tokenizer is not None else 0


@dataclass(frozen=True)
class RequestValidator:
    """What a request is checked against. It reads only these fixed limits and the tokenizer, so the server may
    call it off the engine thread."""

    tokenizer: Any | None
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    unbounded_length: bool  # a streaming-evicting engine: only max_tokens bounds a sequence's length
    # No tokenization packs more characters into one token than the vocabulary's longest token has, so a text
    # longer than max_model_len of them cannot fit in max_model_len tokens: refused before the tokenizer runs.
    longest_token_chars: int

    @property
    def max_prompt_chars(self) -> float:
        # a streaming-evicting engine takes prompts of any length (the server's body cap still bounds them)
        return float("inf") if self.unbounded_length else self.max_model_len * self.longest_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids. A prompt a chat template rendered already holds its special tokens:
        add_special_tokens=False."""
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer; pass prompt_token_ids instead of text")
        self.check_prompt_chars(len(text))
        if not is_text(text):
            raise ValueError("the prompt is not valid Unicode text (it has a lone surrogate)")
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def check_prompt_chars(self, num_chars: int) -> None:
        """Refuse a text prompt too long for max_model_len tokens by its length alone, without tokenizing it."""
        if num_chars > self.max_prompt_chars:
            raise ValueError(
                f"the prompt has {num_chars:,} characters, more than max_model_len={self.max_model_len} tokens "
                f"can hold (at most {self.max_prompt_chars:,}: the longest token has {self.longest_token_chars})"
            )

    def check_prompt_length(self, num_tokens: int) -> None:
        """Refuse an empty prompt or one longer than max_model_len (reads only max_model_len). A prompt of exactly
        max_model_len tokens passes here: check_lengths takes it only from a request that scores it."""
        if num_tokens == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if num_tokens > self.max_model_len and not self.unbounded_length:
            raise self._no_room(num_tokens)

    def check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        """Check the prompt's tokens, its room to generate, n, stop strings and stop token ids; returns the
        request's max_tokens."""
        self.check_prompt_length(len(token_ids))  # before the per-token check: a huge prompt is refused at once
        self._check_token_ids("prompt token ids", token_ids)
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        if self.unbounded_length:  # positions stay within the cache: only max_tokens bounds the length
            max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
            return self._check_n_and_stop(params, max_tokens)
        return self._check_n_and_stop(params, self._bounded_max_tokens(len(token_ids), params))

    def _bounded_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """max_tokens, at most what max_model_len leaves after the prompt. As vLLM, a request that only scores its
        prompt (prompt logprobs and the one token the engine samples, which the server's echo with max_tokens 0
        drops) may fill the context: that token follows the last position and is never written to the cache."""
        limit = self.max_model_len
        if prompt_len == limit:
            if params.max_tokens == 1 and params.prompt_logprobs is not None:
                return 1
            raise self._no_room(prompt_len)
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise ValueError(
                f"max_tokens={max_tokens} exceeds max_model_len={limit} minus prompt length {prompt_len} "
                f"(at most {limit - prompt_len})"
            )
        return max_tokens

    def _no_room(self, num_tokens: int) -> ValueError:
        scoring = " (only a request scoring its prompt may fill it: prompt logprobs with max_tokens 1, the " \
                  "server's echo with logprobs and max_tokens 0)" if num_tokens == self.max_model_len else ""
        return ValueError(f"the prompt has {num_tokens} tokens, but max_model_len={self.max_model_len} leaves no "
                          f"room to generate{scoring}")

    def _check_token_ids(self, what: str, token_ids: list[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def _check_n_and_stop(self, params: SamplingParams, max_tokens: int) -> int:
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model directory has none (use stop_token_ids)")
        return max_tokens
