"""The routing keys of an HTTP request: its prompt tokenized the way the replica's handlers and engine tokenize it
(chat template, special tokens, cache_salt, KV storage format), then hashed block by block as the prefix cache does."""
from __future__ import annotations

from typing import Any

from kvserve.config import EngineConfig
from kvserve.kv.block_hash import hash_full_blocks
from kvserve.scaleout.prefix_index import routing_key
from kvserve.server.api_models import ChatCompletionRequest, CompletionRequest, parse_request
from kvserve.server.chat import render_chat
from kvserve.server.errors import APIError
from kvserve.server.generation import ServingContext

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"


class RequestKeys:
    """Keys for the replicas built from `config`, whose tokenizer (None: token-id prompts only) is `tokenizer`."""

    def __init__(self, tokenizer: Any, config: EngineConfig):
        self.block_size = config.block_size
        self.namespace = config.kv_cache_format  # the engine's hash namespace: blocks of another format never match
        # render_chat reads only the tokenizer from its context
        self._chat_ctx = ServingContext(engine=None, model_name="", tokenizer=tokenizer)
        self._tokenizer = tokenizer

    def keys(self, path: str, body: bytes) -> tuple[bytes, ...]:
        """The request's routing keys, first block first; none for requests without a prompt or that the replica
        will reject (it answers those with the proper error wherever they land)."""
        try:
            prompt = self._prompt(path, body)
        except (APIError, ValueError):
            return ()
        if prompt is None:
            return ()
        token_ids, cache_salt = prompt
        hashes = hash_full_blocks(token_ids, self.block_size, cache_salt, namespace=self.namespace)
        return tuple(routing_key(h) for h in hashes)

    def _prompt(self, path: str, body: bytes) -> tuple[list[int], str | None] | None:
        if path == COMPLETIONS_PATH:
            req = parse_request(CompletionRequest, body)
            first = req.prompts()[0]  # one HTTP request goes to one replica: its first prompt decides
            return (first if isinstance(first, list) else self._encode(first)), req.cache_salt
        if path == CHAT_PATH:
            req = parse_request(ChatCompletionRequest, body)
            return self._encode(render_chat(self._chat_ctx, req)), req.cache_salt
        return None

    def _encode(self, text: str) -> list[int]:
        if self._tokenizer is None:
            raise ValueError("no tokenizer")
        return self._tokenizer(text, add_special_tokens=True).input_ids
