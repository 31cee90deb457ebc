"""`kvserve bench serve`: an online load generator against a running OpenAI-compatible server.

Requests arrive as a Poisson process at --request-rate (all at once when infinite), each a synthetic prompt of
about --random-input-len tokens asking for --random-output-len tokens (both spread by --random-range-ratio),
streamed from /v1/completions. It prints the figures `vllm bench serve` prints (throughput, TTFT, TPOT, ITL,
end-to-end latency) so runs against kvserve and vLLM can be compared; give vLLM `--ignore-eos` for the same
output lengths."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

from kvserve.bench.words import WORDS


@dataclass(frozen=True)
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    num_prompts: int = 100
    request_rate: float = math.inf  # requests per second
    max_concurrency: int | None = None
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    seed: int = 0
    ignore_eos: bool = True
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)

    def __post_init__(self) -> None:
        checks = [
            (self.num_prompts >= 1, f"num_prompts must be at least 1, got {self.num_prompts}"),
            (self.request_rate > 0, f"request_rate must be positive, got {self.request_rate}"),
            (self.max_concurrency is None or self.max_concurrency >= 1,
             f"max_concurrency must be at least 1, got {self.max_concurrency}"),
            (self.input_len >= 1 and self.output_len >= 1,
             f"input and output lengths must be at least 1, got {self.input_len} and {self.output_len}"),
            (0 <= self.range_ratio < 1, f"range_ratio must be in [0, 1), got {self.range_ratio}"),
            (all(0 < p <= 100 for p in self.percentiles), f"percentiles must be in (0, 100], got {self.percentiles}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True)
class SyntheticRequest:
    prompt: str
    max_tokens: int


@dataclass
class RequestResult:
    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between successive streamed chunks
    error: str = ""


@dataclass
class BenchReport:
    config: ServeBenchConfig
    model: str
    duration_s: float
    results: list[RequestResult]

    @property
    def succeeded(self) -> list[RequestResult]:
        return [r for r in self.results if r.success]

    @property
    def total_input_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.succeeded)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.succeeded)

    def distribution_ms(self, metric: str) -> dict[str, float]:
        """Mean and percentiles, in ms, of "ttft", "tpot", "itl" or "e2el" over successful requests."""
        import numpy as np  # here, not at the top: `kvserve --help` builds this module's parser

        ok = self.succeeded
        values = {
            "ttft": [r.ttft_s for r in ok],
            "tpot": [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
            "itl": [gap for r in ok for gap in r.itl_s],
            "e2el": [r.latency_s for r in ok],
        }[metric]
        ms = np.array(values or [0.0]) * 1000
        return {"Mean": float(ms.mean()), **{f"P{p:g}": float(np.percentile(ms, p)) for p in self.config.percentiles}}


def synthetic_requests(config: ServeBenchConfig) -> list[SyntheticRequest]:
    """The same prompts and lengths for the same seed, so runs compare."""
    rng = random.Random(config.seed)

    def length(mean: int) -> int:
        low, high = max(1, int(mean * (1 - config.range_ratio))), int(mean * (1 + config.range_ratio))
        return rng.randint(low, max(low, high))

    requests = []
    for _ in range(config.num_prompts):
        num_words, max_tokens = length(config.input_len), length(config.output_len)
        requests.append(SyntheticRequest(" ".join(rng.choices(WORDS, k=num_words)), max_tokens))
    return requests


async def run_serve_bench(config: ServeBenchConfig) -> BenchReport:
    """Send the synthetic load and time every streamed chunk."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.max_concurrency or config.num_prompts)
    async with httpx.AsyncClient(base_url=config.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(None, connect=10.0)) as client:
        model = config.model or await _first_model(client)
        requests = synthetic_requests(config)
        gaps = random.Random(config.seed + 1)
        slots = asyncio.Semaphore(config.max_concurrency or config.num_prompts)
        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(_limited(slots, _send(client, model, request, config.ignore_eos))))
            if math.isfinite(config.request_rate):
                await asyncio.sleep(gaps.expovariate(config.request_rate))
        results = await asyncio.gather(*tasks)
        return BenchReport(config, model, time.perf_counter() - start, list(results))


async def _first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _limited(slots: asyncio.Semaphore, request) -> RequestResult:
    async with slots:
        return await request


async def _send(client: httpx.AsyncClient, model: str, request: SyntheticRequest, ignore_eos: bool) -> RequestResult:
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
            "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    result = RequestResult(success=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if result.ttft_s == 0.0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency_s = time.perf_counter() - start
    result.success = result.ttft_s > 0
    result.error = "" if result.success else "the stream carried no text"
    return result


def format_report(report: BenchReport) -> str:
    """The result block, laid out like `vllm bench serve`'s."""
    c, n_ok = report.config, len(report.succeeded)
    duration = report.duration_s
    lines = [
        "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
        _row("Successful requests:", n_ok),
        _row("Failed requests:", len(report.results) - n_ok),
        _row("Request rate configured (RPS):", f"{c.request_rate:.2f}"),
        _row("Maximum request concurrency:", c.max_concurrency or "unlimited"),
        _row("Benchmark duration (s):", f"{duration:.2f}"),
        _row("Total input tokens:", report.total_input_tokens),
        _row("Total generated tokens:", report.total_output_tokens),
        _row("Request throughput (req/s):", f"{n_ok / duration:.2f}"),
        _row("Output token throughput (tok/s):", f"{report.total_output_tokens / duration:.2f}"),
        _row("Total Token throughput (tok/s):",
             f"{(report.total_input_tokens + report.total_output_tokens) / duration:.2f}"),
    ]
    sections = [("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency")]
    for metric, short, title in sections:
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for stat, value in report.distribution_ms(metric).items():
            lines.append(_row(f"{stat} {short} (ms):", f"{value:.2f}"))
    lines.append("=" * 50)
    errors = sorted({r.error for r in report.results if not r.success})
    lines += [f"error: {e}" for e in errors[:5]]
    return "\n".join(lines)


def _row(label: str, value) -> str:
    return f"{label:<40}{value!s:<10}"


def add_serve_bench_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("serve", help="online load against a running server: throughput, TTFT, ITL")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="model name to request (default: the first the server lists)")
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"), help="bearer key (default $KVSERVE_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--random-input-len", type=int, default=256, dest="input_len", help="prompt tokens (about)")
    p.add_argument("--random-output-len", type=int, default=64, dest="output_len", help="tokens to generate")
    p.add_argument("--random-range-ratio", type=float, default=0.0, dest="range_ratio",
                   help="lengths are drawn uniformly from len*(1-r) .. len*(1+r)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (then output lengths vary)")
    p.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated percentiles (default 50,90,99)")
    from kvserve.bench.routing import add_sessions_args

    add_sessions_args(p)
    p.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    if args.conversations is not None:
        from kvserve.bench.routing import run_from_args as run_sessions_from_args

        return run_sessions_from_args(args)
    if args.routers is not None:
        print("kvserve bench serve: --routers compares routers on multi-turn sessions; add --conversations N",
              file=sys.stderr)
        return 2
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
        config = ServeBenchConfig(
            base_url=args.base_url.rstrip("/"), model=args.model, api_key=args.api_key, num_prompts=args.num_prompts,
            request_rate=args.request_rate, max_concurrency=args.max_concurrency, input_len=args.input_len,
            output_len=args.output_len, range_ratio=args.range_ratio, seed=args.seed, ignore_eos=args.ignore_eos,
            percentiles=percentiles,
        )
    except ValueError as exc:
        print(f"kvserve bench serve: {exc}", file=sys.stderr)
        return 2
    print(f"Benchmarking {config.base_url}: {config.num_prompts} requests at {config.request_rate} req/s, "
          f"~{config.input_len} prompt / {config.output_len} output tokens", file=sys.stderr)
    try:
        report = asyncio.run(run_serve_bench(config))
    except httpx.HTTPError as exc:
        print(f"kvserve bench serve: cannot reach {config.base_url}: {exc}", file=sys.stderr)
        return 1
    print(format_report(report))
    return 0 if len(report.succeeded) == len(report.results) else 1
