"""The prompt forms the API accepts, normalised to one shape."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from kvserve.sampling_params import is_text

PromptType = Union[str, list[int], dict[str, Any]]


@dataclass(frozen=True)
class Prompt:
    text: str | None
    token_ids: list[int] | None
    cache_salt: str | None = None
    add_special_tokens: bool = True  # False for text a chat template rendered: it already holds its BOS


def parse_prompt(prompt: PromptType) -> Prompt:
    """A string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]} with optional "cache_salt"
    (and, for text, "add_special_tokens": false when the text already has them, as a rendered chat template has)."""
    if isinstance(prompt, str):
        return Prompt(prompt, None)
    if _is_token_ids(prompt):
        return Prompt(None, list(prompt))
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", "add_special_tokens"}
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError(
                f"a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids' (plus optional 'cache_salt'), "
                f"got keys {sorted(prompt)}"
            )
        salt = prompt.get("cache_salt")
        if salt is not None:
            _check_cache_salt(salt)
        text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if not (isinstance(text, str) or _is_token_ids(token_ids)):
            raise ValueError("'prompt' must be a string and 'prompt_token_ids' a list of token ids")
        add_special_tokens = prompt.get("add_special_tokens", True)
        if not isinstance(add_special_tokens, bool):
            raise ValueError(f"add_special_tokens must be true or false, got {add_special_tokens!r}")
        return Prompt(text, None if token_ids is None else list(token_ids), salt, add_special_tokens)
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _check_cache_salt(salt: Any) -> None:
    # "" is refused rather than read as "no salt": a request that sets a salt must never share unsalted blocks.
    if not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
    if not salt:
        raise ValueError("cache_salt must be a non-empty string (omit it for no salt)")
    if not is_text(salt):
        raise ValueError("cache_salt must be valid Unicode text (it has a lone surrogate)")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def is_single_prompt(prompts: Any) -> bool:
    return isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and bool(prompts) and all(isinstance(t, int) for t in prompts)
    )
