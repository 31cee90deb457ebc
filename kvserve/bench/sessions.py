"""`kvserve bench serve --conversations N --turns T`: multi-turn chat sessions against one OpenAI endpoint.

Every conversation opens with its own random first message (--random-input-len words), then asks a new question
(--question-len words) each turn, always sending the whole history; answers are greedy, EOS ignored, exactly
--random-output-len tokens. Conversations run at the same time, each turn after the previous one's answer. What
counts is how much of each prompt the server found cached (usage.prompt_tokens_details.cached_tokens): behind a
router, only a turn that returns to the replica holding its conversation finds it."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from kvserve.bench.words import WORDS


@dataclass(frozen=True)
class SessionsConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    conversations: int = 16
    turns: int = 6
    first_len: int = 256  # words of the first message, about one token each
    question_len: int = 64
    answer_len: int = 64  # tokens
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "first_len", "question_len", "answer_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def messages(self, conversation: int) -> list[str]:
        """The user's messages of one conversation, the same for the same seed."""
        rng = random.Random(self.seed * 1_000_003 + conversation)
        lengths = [self.first_len] + [self.question_len] * (self.turns - 1)
        return [" ".join(rng.choices(WORDS, k=n)) for n in lengths]


@dataclass
class TurnResult:
    conversation: int
    turn: int
    success: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    replica: str = ""  # the x-kvserve-replica header, when a scaled-out endpoint sends it
    error: str = ""


@dataclass
class SessionsReport:
    config: SessionsConfig
    duration_s: float
    turns: list[TurnResult] = field(default_factory=list)

    @property
    def succeeded(self) -> list[TurnResult]:
        return [t for t in self.turns if t.success]

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.succeeded)

    @property
    def cached_tokens(self) -> int:
        return sum(t.cached_tokens for t in self.succeeded)

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens the servers computed (not found cached)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.succeeded)

    def ttft_ms(self, percentile: float) -> float:
        import numpy as np  # here, not at the top: `kvserve --help` builds this module's parser

        values = [t.ttft_s * 1000 for t in self.succeeded] or [0.0]
        return float(np.percentile(values, percentile))

    @property
    def ttft_mean_ms(self) -> float:
        ok = self.succeeded
        return sum(t.ttft_s for t in ok) * 1000 / len(ok) if ok else 0.0

    @property
    def final_tokens(self) -> int:
        """Tokens the conversations hold at their end (last prompt plus answer, all conversations): the cache
        that keeps every conversation's history needs this much room."""
        last: dict[int, TurnResult] = {}
        for t in self.succeeded:
            last[t.conversation] = t
        return sum(t.prompt_tokens + t.output_tokens for t in last.values())

    def replicas_per_conversation(self) -> float:
        """How many replicas a conversation's turns met, on average (1.0: every conversation stayed on one)."""
        seen: dict[int, set[str]] = {}
        for t in self.succeeded:
            seen.setdefault(t.conversation, set()).add(t.replica)
        return sum(len(s) for s in seen.values()) / len(seen) if seen else 0.0


async def run_sessions(config: SessionsConfig) -> SessionsReport:
    """Hold every conversation to its last turn; a failed turn ends its conversation (the history is gone)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    async with httpx.AsyncClient(base_url=config.base_url, headers=headers, timeout=httpx.Timeout(None, connect=10.0),
                                 limits=httpx.Limits(max_connections=config.conversations)) as client:
        model = config.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        start = time.perf_counter()
        results = await asyncio.gather(*(_conversation(client, model, config, c) for c in range(config.conversations)))
        return SessionsReport(config, time.perf_counter() - start, [t for turns in results for t in turns])


async def _conversation(client: httpx.AsyncClient, model: str, config: SessionsConfig,
                        conversation: int) -> list[TurnResult]:
    history: list[dict[str, str]] = []
    results = []
    for turn, message in enumerate(config.messages(conversation), start=1):
        history.append({"role": "user", "content": message})
        result, answer = await _turn(client, model, config, history, conversation, turn)
        results.append(result)
        if not result.success:
            break
        history.append({"role": "assistant", "content": answer})
    return results


async def _turn(client: httpx.AsyncClient, model: str, config: SessionsConfig, history: list[dict[str, str]],
                conversation: int, turn: int) -> tuple[TurnResult, str]:
    body = {"model": model, "messages": history, "max_tokens": config.answer_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result, pieces = TurnResult(conversation, turn, success=False), []
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            result.replica = response.headers.get("x-kvserve-replica", "")
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return result, ""
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    return result, ""
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.prompt_tokens, result.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for choice in chunk["choices"]:
                    text = choice["delta"].get("content")
                    if text and not pieces:
                        result.ttft_s = time.perf_counter() - start
                    if text:
                        pieces.append(text)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result, ""
    result.success = bool(pieces) and result.prompt_tokens > 0
    result.error = "" if result.success else "the stream carried no text or no usage"
    return result, "".join(pieces)
