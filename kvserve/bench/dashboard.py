"""`kvserve bench dashboard`: what feeding the dashboard costs the server, per page refresh and as a share of one
core at the page's one refresh a second. Everything is CPU time, not wall time, so a busy machine does not
inflate it.

1. A live server on an idle engine answers --polls rounds of what the page fetches each second
   (GET /v1/kv/blocks and GET /v1/kv/history): the CPU time of the server's threads (event loop and engine
   thread, each read from its own clock; the client runs on another thread) divided by the rounds.
2. The engine's pool is then filled to --fill by --num-seqs running sequences (random prompts, prefilled), and
   the block view is taken and encoded as JSON --polls times, as the server does, on the empty and on the full
   pool: the difference is what a full pool adds to each refresh."""
from __future__ import annotations

import argparse
import threading
import time

from kvserve.sampling_params import SamplingParams

PAGE_ROUTES = ("/v1/kv/blocks", "/v1/kv/history")


def server_cpu_s_per_refresh(engine, polls: int) -> tuple[float, int]:
    """Server CPU seconds per page refresh on a live server, and the bytes of one /v1/kv/blocks answer."""
    import httpx

    from kvserve.server.app import build_app
    from kvserve.server.launch import ServerThread

    with ServerThread(build_app(engine)) as server, httpx.Client(base_url=server.url) as client:
        size = len(client.get(PAGE_ROUTES[0]).content)  # also warms both routes up
        client.get(PAGE_ROUTES[1])
        threads = [t for t in threading.enumerate() if t is not threading.current_thread()]
        before = _cpu_s(threads)
        for _ in range(polls):
            for route in PAGE_ROUTES:
                client.get(route).raise_for_status()
        return (_cpu_s(threads) - before) / polls, size


def _cpu_s(threads: list[threading.Thread]) -> float:
    return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threads if t.is_alive())


def view_cpu_s(engine, polls: int) -> float:
    """CPU seconds to take the block view and encode it as the server does, in this thread."""
    from fastapi.responses import JSONResponse

    from kvserve.server.dashboard import engine_view

    start = time.thread_time()
    for _ in range(polls):
        JSONResponse(engine_view(engine, engine.model_name))
    return (time.thread_time() - start) / polls


def fill_pool(engine, fraction: float, num_seqs: int) -> list[str]:
    """Add `num_seqs` requests whose prompts hold `fraction` of the pool and step until all are prefilled."""
    import torch

    pool, block_size = engine.kv.pool, engine.kv.block_size
    prompt_len = max(1, int(fraction * pool.num_blocks / num_seqs) * block_size - 1)  # +1 sampled token: whole blocks
    if prompt_len + 1 >= engine.max_model_len:
        raise ValueError(f"{num_seqs} sequences filling {fraction:.0%} of {pool.num_blocks:,} blocks need "
                         f"{prompt_len:,}-token prompts, beyond max_model_len={engine.max_model_len}; "
                         "use more --num-seqs")
    g = torch.Generator().manual_seed(0)
    vocab_size = engine.model_config.vocab_size
    request_ids = [f"fill-{i}" for i in range(num_seqs)]
    for request_id in request_ids:
        prompt = torch.randint(0, vocab_size, (prompt_len,), generator=g).tolist()
        params = SamplingParams(max_tokens=engine.max_model_len - prompt_len, ignore_eos=True)
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while engine.scheduler.waiting:
        engine.step()
    return request_ids


def run_dashboard_bench(args: argparse.Namespace) -> int:
    import torch

    from kvserve.engine.llm import LLM

    for name in ("polls", "num_seqs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"kvserve bench dashboard: --{name.replace('_', '-')} must be at least 1")
    if not 0 < args.fill <= 1:
        raise SystemExit(f"kvserve bench dashboard: --fill must be in (0, 1], got {args.fill}")
    engine = LLM(args.model, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
                 max_num_seqs=args.num_seqs).engine
    http_s, empty_bytes = server_cpu_s_per_refresh(engine, args.polls)
    empty_s = view_cpu_s(engine, args.polls)
    try:
        request_ids = fill_pool(engine, args.fill, args.num_seqs)
    except ValueError as exc:
        raise SystemExit(f"kvserve bench dashboard: {exc}") from exc
    stats = engine.stats()
    full_s = view_cpu_s(engine, args.polls)
    for request_id in request_ids:
        engine.abort_request(request_id)
    per_refresh_s = http_s + max(0.0, full_s - empty_s)
    print(f"pool: {stats['num_blocks']:,} blocks × {stats['block_size']} tokens; {stats['num_used_blocks']:,} held by "
          f"{stats['num_running']} running sequences ({stats['kv_cache_usage']:.0%}); {args.polls} refreshes; "
          f"torch threads: {torch.get_num_threads()}")
    print(f"server CPU per refresh (GET {' + '.join(PAGE_ROUTES)}), empty pool: {http_s * 1e3:.2f} ms "
          f"({empty_bytes / 1024:.1f} KiB of blocks JSON)")
    print(f"block view + JSON: empty pool {empty_s * 1e3:.2f} ms, this pool {full_s * 1e3:.2f} ms")
    print(f"at one refresh a second: {per_refresh_s * 1e3:.2f} ms of CPU per second = "
          f"{per_refresh_s * 100:.2f}% of one core")
    return 0


def add_dashboard_bench_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("dashboard", help="server CPU spent feeding the dashboard, per refresh")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--fill", type=float, default=0.5, help="share of the pool held by running sequences (0.5)")
    p.add_argument("--num-seqs", type=int, default=64, help="running sequences holding it (64)")
    p.add_argument("--polls", type=int, default=200, help="refreshes timed in each part (200)")
    p.set_defaults(func=run_dashboard_bench)
