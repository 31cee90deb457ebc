"""`kvserve bench dashboard`: what feeding the dashboard costs the server, per page refresh and as a share of one
core at the page's one refresh a second. Everything is CPU time, not wall time, so a busy machine does not
inflate it.

1. A live server on an idle engine answers --polls rounds of what the page fetches each second
   (GET /v1/kv/blocks and GET /v1/kv/history): the CPU time of the server's threads (event loop and engine
   thread, each read from its own clock; the client runs on another thread) divided by the rounds.
2. The engine's pool is then filled to --fill by --num-seqs running sequences (random prompts, prefilled), and
   the block view is taken and encoded as JSON --polls times, as the server does, on the empty and on the full
   pool: the difference is what a full pool adds to each refresh.
3. With --pollers N: one greedy stream of --stream-tokens tokens, timed alone and beside N pollers that fetch
   --poll-routes in turn (GET /v1/kv/blocks unless told) back to back from another process (its own interpreter,
   as real pages are), alternating --rounds times: the stream's time and its gaps between chunks over 10 ms, the server's CPU time meanwhile
   (wall time on a shared machine is noisy, CPU time is not), and the views the engine thread took."""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

from kvserve.sampling_params import SamplingParams

PAGE_ROUTES = ("/v1/kv/blocks", "/v1/kv/history")


def server_cpu_s_per_refresh(engine, polls: int) -> tuple[float, int]:
    """Server CPU seconds per page refresh on a live server, and the bytes of one /v1/kv/blocks answer."""
    import httpx

    from kvserve.server.app import build_app
    from kvserve.server.launch import ServerThread

    # every poll takes a view here (no sharing between polls): the cost of one page's refresh
    with ServerThread(build_app(engine, kv_blocks_max_age_s=0)) as server, httpx.Client(base_url=server.url) as client:
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


# Run in its own process: N threads GET the routes (in turn) back to back until stdin closes, then print the count.
# Their clients are made and connected first: making 16 httpx clients costs about half a second of CPU, which
# on a 2-core machine would be counted against the stream.
POLLERS = """
import sys, threading, httpx
num_pollers, routes = int(sys.argv[2]), sys.argv[3].split(",")
clients = [httpx.Client(base_url=sys.argv[1], timeout=60) for _ in range(num_pollers)]
warm, stop, counts = threading.Barrier(num_pollers + 1), threading.Event(), []
def poll(client):
    for route in routes:
        client.get(route).raise_for_status()  # connected and warm before the stream starts
    warm.wait()
    n = 0
    while not stop.is_set():
        client.get(routes[n % len(routes)]).raise_for_status()
        n += 1
    counts.append(n)
threads = [threading.Thread(target=poll, args=(client,)) for client in clients]
for thread in threads:
    thread.start()
warm.wait()
print("ready", flush=True)
sys.stdin.read()
stop.set()
for thread in threads:
    thread.join()
print(sum(counts), flush=True)
"""


def stream_s(url: str, num_tokens: int) -> tuple[float, list[float]]:
    """Seconds from sending one greedy stream of `num_tokens` tokens to its end, and its gaps between chunks (a chunk holds the tokens made since the last)."""
    import httpx

    body = {"prompt": "The dashboard is watching", "max_tokens": num_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start, arrivals = time.perf_counter(), []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        arrivals = [time.perf_counter() for line in response.iter_lines() if line.startswith("data: {")]
    return arrivals[-1] - start, [b - a for a, b in zip(arrivals, arrivals[1:])]


def stream_with_pollers(engine, num_pollers: int, num_tokens: int, rounds: int,
                        routes: str = PAGE_ROUTES[0]) -> dict[str, list]:
    """The stream alone and beside `num_pollers` pollers, alternately, `rounds` times each."""
    from kvserve.server.app import build_app
    from kvserve.server.launch import ServerThread

    results = {"alone": [], "polled": [], "polls": [], "views": [], "alone_cpu": [], "polled_cpu": []}
    app = build_app(engine)
    with ServerThread(app) as server:
        stream_s(server.url, 8)  # warm up
        threads = [t for t in threading.enumerate() if t is not threading.current_thread()]  # the server's
        for _ in range(rounds):
            before = _cpu_s(threads)
            results["alone"].append(stream_s(server.url, num_tokens))
            results["alone_cpu"].append(_cpu_s(threads) - before)
            pollers = subprocess.Popen([sys.executable, "-c", POLLERS, server.url, str(num_pollers), routes],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                assert pollers.stdout.readline().strip() == "ready"
                views_before, before = app.state.kv_blocks.num_taken, _cpu_s(threads)
                results["polled"].append(stream_s(server.url, num_tokens))
                results["polled_cpu"].append(_cpu_s(threads) - before)
                results["views"].append(app.state.kv_blocks.num_taken - views_before)
            finally:
                out, _ = pollers.communicate("", timeout=60)
            results["polls"].append(int(out.split()[-1]))
    return results


def _stream_line(name: str, runs: list[tuple[float, list[float]]]) -> str:
    times = [t for t, _ in runs]
    slow = [sum(gap > 0.010 for gap in gaps) for _, gaps in runs]
    return (f"{name}: {statistics.median(times):.2f} s median of {', '.join(f'{t:.2f}' for t in times)}; gaps between "
            f"chunks over 10 ms: {', '.join(map(str, slow))} of {len(runs[0][1])}")


def run_dashboard_bench(args: argparse.Namespace) -> int:
    import torch

    from kvserve.engine.llm import LLM

    for name in ("polls", "num_seqs", "stream_tokens", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"kvserve bench dashboard: --{name.replace('_', '-')} must be at least 1")
    if not 0 < args.fill <= 1:
        raise SystemExit(f"kvserve bench dashboard: --fill must be in (0, 1], got {args.fill}")
    engine = LLM(args.model, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
                 max_num_seqs=args.num_seqs).engine
    if args.pollers:
        _print_stream_with_pollers(engine, args)
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


def _print_stream_with_pollers(engine, args: argparse.Namespace) -> None:
    results = stream_with_pollers(engine, args.pollers, args.stream_tokens, args.rounds, args.poll_routes)
    alone, polled = (statistics.median(t for t, _ in results[k]) for k in ("alone", "polled"))
    print(f"one {args.stream_tokens}-token stream, {engine.kv.pool.num_blocks:,}-block pool, {args.rounds} rounds:")
    print(_stream_line("  alone", results["alone"]))
    print(_stream_line(f"  beside {args.pollers} pollers", results["polled"]))
    print(f"  the pollers got {', '.join(map(str, results['polls']))} answers from "
          f"{', '.join(map(str, results['views']))} views of the pool; the stream took {polled / alone - 1:+.1%}")
    alone_cpu, polled_cpu = (statistics.median(results[k]) for k in ("alone_cpu", "polled_cpu"))
    print(f"  server CPU during the stream (its threads' clocks, which a busy machine does not inflate): alone "
          f"{alone_cpu:.2f} s, beside the pollers {polled_cpu:.2f} s ({polled_cpu / alone_cpu - 1:+.1%})")


def add_dashboard_bench_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("dashboard", help="server CPU spent feeding the dashboard, per refresh")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--fill", type=float, default=0.5, help="share of the pool held by running sequences (0.5)")
    p.add_argument("--num-seqs", type=int, default=64, help="running sequences holding it (64)")
    p.add_argument("--polls", type=int, default=200, help="refreshes timed in each part (200)")
    p.add_argument("--pollers", type=int, default=0,
                   help="also time one stream alone and beside this many back-to-back pollers of --poll-routes")
    p.add_argument("--poll-routes", default=PAGE_ROUTES[0],
                   help="comma-separated routes each poller GETs in turn (/v1/kv/blocks)")
    p.add_argument("--stream-tokens", type=int, default=400, help="tokens of that stream (400)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of it, alone and polled (3)")
    p.set_defaults(func=run_dashboard_bench)
