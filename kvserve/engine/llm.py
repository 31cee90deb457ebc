"""The offline API: `LLM().generate(prompts, params)` and `LLM().chat(messages)`, run to completion."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
from collections.abc import Sequence as Seq
from typing import Any

from kvserve.config import EngineConfig
from kvserve.engine import tool_parsers
from kvserve.engine.beam_search import BeamSearchOutput, beam_search
from kvserve.engine.chat_prompt import needs_segments, render_chat, rendered_segments, segment_token_ids
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.prompts import PromptType, is_single_prompt
from kvserve.engine.tools import ToolRequest
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import BeamSearchParams, SamplingParams


def _ensure_log_handler() -> None:
    # Like vLLM: show the start-up capacity line on stderr unless the application set up logging itself.
    logger = logging.getLogger("kvserve")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


class LLM:
    """An engine plus a loop that runs submitted prompts to completion."""

    def __init__(self, model: str | None = None, **engine_options: Any):
        _ensure_log_handler()
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. Every prompt is validated before any runs: one bad prompt raises ValueError."""
        prompt_list = [prompts] if is_single_prompt(prompts) else list(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        request_ids = []
        try:
            for prompt, params in zip(prompt_list, params_list):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
        except Exception as exc:
            for request_id in request_ids:  # all or nothing: no half-submitted batch stays queued
                self.engine.abort_request(request_id)
            if isinstance(exc, ValueError):
                raise ValueError(f"prompt {len(request_ids)}: {exc}") from exc
            raise
        return self._run(request_ids)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        cache_salt: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        tool_call_parser: str = "auto",
    ) -> RequestOutput | list[RequestOutput]:
        """Apply the model's chat template and generate the assistant's reply (one conversation or a list). With
        `tools` (OpenAI's shapes, in the format `tool_call_parser` names, "auto": the chat template's own, else
        kvserve's default: kvserve/engine/tool_parsers/) each sample's parsed calls are in its `tool_calls`;
        "required" or a named `tool_choice` constrains the reply to valid calls."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        tool_request, template_tools = None, None
        if tools is not None or tool_choice is not None:
            tool_format = tool_parsers.for_tokenizer(tool_call_parser, self.engine.tokenizer, self.engine.eos_token_ids)
            tool_request = ToolRequest.from_openai(tools, tool_choice, parallel_tool_calls, tool_format)
            conversations = [tool_request.messages(c) for c in conversations]
            template_tools = tool_request.template_tools()
            sampling_params = self._with_tool_grammar(sampling_params, tool_request)
        salt = {"cache_salt": cache_salt} if cache_salt is not None else {}
        prompts = [{**self._chat_prompt(c, template_tools), **salt} for c in conversations]
        outputs = self.generate(prompts, sampling_params)
        if tool_request is not None:
            for completion in (c for output in outputs for c in output.outputs):
                completion.tool_calls = tool_request.calls(completion.text)
        return outputs[0] if single else outputs

    def _with_tool_grammar(self, params: SamplingParams | Seq[SamplingParams] | None,
                           tool_request: ToolRequest) -> SamplingParams | list[SamplingParams]:
        """`params` constrained to the tool calls a "required" or named tool_choice allows, the grammar compiled
        first so a parameters schema it cannot enforce is refused before anything runs; the text keeps special
        tokens where the format's markers are special tokens."""
        many = params is not None and not isinstance(params, SamplingParams)
        params_list = list(params) if many else [params or SamplingParams()]
        if tool_request.mode == "none":
            return params_list if many else params_list[0]
        if any(p.structured_outputs is not None for p in params_list):
            raise ValueError("structured_outputs with tools needs tool_choice 'none'")
        changes = {"skip_special_tokens": False} if tool_request.format.keeps_special_tokens else {}
        constraint = tool_request.constraint()
        if constraint is not None:
            try:
                self.engine.grammar(constraint)
            except ValueError as exc:
                raise ValueError(f"tools: {exc}") from exc
            changes["structured_outputs"] = constraint
        adjusted = [dataclasses.replace(p, **changes) for p in params_list]
        return adjusted if many else adjusted[0]

    def apply_chat_template(self, messages: list[dict[str, str]], tools: list[dict] | None = None) -> str:
        return render_chat(self.engine.tokenizer, messages, tools)

    def _chat_prompt(self, messages: list[dict[str, str]], tools: list[dict] | None = None) -> dict:
        """The rendered template holds its own special tokens (BOS): none are added; message content is text
        (special-token text in it stays plain characters: kvserve/engine/chat_prompt.py)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not needs_segments(tokenizer, messages):
            return {"prompt": self.apply_chat_template(messages, tools), "add_special_tokens": False}
        return {"prompt_token_ids": segment_token_ids(tokenizer, rendered_segments(tokenizer, messages, tools))}

    def stats(self) -> dict[str, float | int]:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def beam_search(self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search per prompt (see kvserve.engine.beam_search for what it matches); beams share KV blocks."""
        return beam_search(self.engine, prompts, params)

    def _params_for(self, prompts: list, params: SamplingParams | Seq[SamplingParams] | None) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        return list(params)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        """Step until every request is done. A request that fails inside a step comes back with finish_reason
        "error"; if a step itself raises (or Ctrl-C), this call's requests are aborted, so the next call starts
        clean."""
        final: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        final[output.request_id] = output
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return [final[request_id] for request_id in request_ids]
