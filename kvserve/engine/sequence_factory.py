"""A request's sequences, made in one place: the first one, an n>1 request's later samples, and beam search's
copies of a running sequence (fork_request), each with its own detokenizer, stop ids and sampling stream."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvserve.engine.detokenizer import Detokenizer
from kvserve.engine.request import Request
from kvserve.engine.sequence import Sequence


@dataclass(frozen=True)
class SequenceFactory:
    eos_token_ids: frozenset[int]
    tokenizer: Any | None

    def new(self, request: Request, index: int, token_ids: list[int], max_tokens: int,
            cache_salt: str | None) -> Sequence:
        """Sample `index` of `request` (index 0: the request's own id), starting from `token_ids`."""
        params = request.params
        return Sequence(
            request_id=request.request_id if index == 0 else f"{request.request_id}#{index}",
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=len(request.prompt_token_ids),
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            detokenizer=Detokenizer(self.tokenizer, list(params.stop), params.skip_special_tokens),
            cache_salt=cache_salt,
            seed=params.seed + index if params.seed is not None else None,
            grammar=request.grammar.new_matcher() if request.grammar is not None else None,
        )

    def fork(self, parent_request: Request, new_request_id: str, last_token_id: int | None) -> Request:
        """A new one-sequence request copying `parent_request`'s only sequence as of its last decode step, its
        newest token replaced by `last_token_id` (one of that step's reported logprobs alternatives) if given.
        The copy computed what its parent computed; sharing the parent's blocks is the caller's to do."""
        parent = parent_request.sequences[0]
        if parent.grammar is not None:
            raise ValueError(f"request {parent_request.request_id!r} has structured_outputs; forking a constrained "
                             f"sequence (beam search) is not supported")
        token_ids, cumulative_logprob = list(parent.token_ids), parent.cumulative_logprob
        if last_token_id is not None:
            alternatives = parent.logprobs[-1] if parent.logprobs and parent.num_output_tokens else {}
            if last_token_id not in alternatives:
                raise ValueError(f"token {last_token_id} is not among the last step's logprobs of "
                                 f"{parent_request.request_id!r}")
            cumulative_logprob += alternatives[last_token_id] - alternatives[token_ids[-1]]
            token_ids[-1] = last_token_id
        request = Request(new_request_id, parent_request.prompt, parent_request.prompt_token_ids, parent.params,
                          num_cached_tokens=parent_request.num_cached_tokens,
                          num_disk_cached_tokens=parent_request.num_disk_cached_tokens,
                          metrics=dataclasses.replace(parent_request.metrics))
        child = self.new(request, 0, token_ids, parent.max_tokens, parent.cache_salt)
        child.num_computed_tokens = parent.num_computed_tokens
        child.cumulative_logprob = cumulative_logprob
        child.logprobs = list(parent.logprobs) if parent.logprobs is not None else None
        request.sequences.append(child)
        return request
