"""`kvserve bench serve --conversations N [--routers prefix,pow2,round-robin]`: multi-turn sessions against one
endpoint; with --routers, against a local Ray endpoint per router plus one big replica (every replica's CPUs and KV
cache in one engine) as the reference, all in one run, so the cached-token shares compare. With --kv-disk-cache DIR
as well, each router runs once more with its replicas sharing one disk tier (a new directory under DIR, removed
after), so a conversation routed to another replica can read its blocks rather than recompute them; the other
setups run without a tier."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import sys
import tempfile
from dataclasses import dataclass

import httpx

from kvserve.bench.sessions import SessionsConfig, SessionsReport, run_sessions
from kvserve.config import parse_size

BIG_REPLICA = "one big replica"
SHARED_DISK = " + shared disk tier"  # the name of a router's setup whose replicas share a disk tier
WARM_UP_REQUESTS_PER_REPLICA = 2  # a replica's first forward passes are slow; they should not count as TTFT


@dataclass(frozen=True)
class RouterRun:
    name: str
    replicas: int
    report: SessionsReport
    kv_cache_tokens: int | None = None  # all replicas together, when the endpoint's /health says


def add_sessions_args(parser: argparse.ArgumentParser) -> None:
    from kvserve.engine.cli import add_engine_args
    from kvserve.scaleout.config import DEFAULT_IMBALANCE_THRESHOLD, ROUTER_NAMES

    g = parser.add_argument_group("multi-turn sessions (--conversations)")
    g.add_argument("--conversations", type=int, default=None,
                   help="hold this many chat conversations at once instead of sending single requests; the first "
                        "message has --random-input-len words, answers --random-output-len tokens")
    g.add_argument("--turns", type=int, default=6, help="turns per conversation (default %(default)s)")
    g.add_argument("--question-len", type=int, default=64, help="words of each later question (default %(default)s)")
    g.add_argument("--routers", default=None,
                   help=f"comma-separated, of {', '.join(ROUTER_NAMES)}: start a local Ray endpoint for each, and one "
                        "big replica as the reference, instead of using --base-url; --model then names the model to "
                        "serve and the engine flags below configure every replica")
    g.add_argument("--replicas", type=int, default=2, help="--routers: engine replicas (default %(default)s)")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="--routers: CPUs per replica (default %(default)s)")
    g.add_argument("--router-imbalance-threshold", type=int, default=DEFAULT_IMBALANCE_THRESHOLD,
                   dest="imbalance_threshold", help="--routers: the prefix router's (default %(default)s)")
    g.add_argument("--turns-jsonl", default=None, metavar="PATH",
                   help="also write every turn (setup, conversation, turn, replica, prompt and cached tokens, TTFT) "
                        "to PATH as JSON lines: which replica each turn of a conversation went to")
    add_engine_args(parser, exclude=("model", "seed"))


def run_from_args(args: argparse.Namespace) -> int:
    from kvserve.scaleout.config import ray_missing

    try:
        sessions = SessionsConfig(base_url=args.base_url.rstrip("/"), model=args.model, api_key=args.api_key,
                                  conversations=args.conversations, turns=args.turns, first_len=args.input_len,
                                  question_len=args.question_len, answer_len=args.output_len, seed=args.seed)
        if args.routers is not None:
            routers, scale = _scale_out_from_args(args)
    except ValueError as exc:
        print(f"kvserve bench serve: {exc}", file=sys.stderr)
        return 2
    if args.routers is not None and (missing := ray_missing()):
        print(f"kvserve bench serve: --routers: {missing}", file=sys.stderr)
        return 1
    print(f"{sessions.conversations} conversations x {sessions.turns} turns: first message ~{sessions.first_len} "
          f"words, then ~{sessions.question_len}-word questions, {sessions.answer_len}-token answers", file=sys.stderr)
    if args.routers is None:
        report = asyncio.run(run_sessions(sessions))
        runs = [RouterRun(sessions.base_url, 0, report, kv_cache_tokens(sessions.base_url))]
    else:
        from kvserve.scaleout.cluster import ReplicaStartError

        try:
            runs = compare_routers(sessions, scale, routers)
        except ReplicaStartError as exc:
            print(f"kvserve bench serve: {exc}", file=sys.stderr)
            return 1
    print_runs(runs)
    if args.turns_jsonl:
        write_turns(args.turns_jsonl, runs)
    return 0 if all(len(r.report.succeeded) == len(r.report.turns) for r in runs) else 1


def compare_routers(sessions: SessionsConfig, scale, routers: list[str]) -> list[RouterRun]:
    """The sessions through each of `router_setups`, one after another."""
    runs = []
    for name, setup, shares_disk in router_setups(scale, routers):
        print(f"{name}: starting {setup.replicas} replica(s) on a local Ray ...", file=sys.stderr, flush=True)
        setup = dataclasses.replace(setup, port=_free_port())
        if shares_disk:  # a tier of its own, empty: nothing from an earlier setup or run
            os.makedirs(setup.engine.kv_disk_cache, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=setup.engine.kv_disk_cache, prefix="bench-serve-") as directory:
                engine = dataclasses.replace(setup.engine, kv_disk_cache=directory)
                report, cache_tokens = _run_on_ray(sessions, dataclasses.replace(setup, engine=engine))
        else:
            report, cache_tokens = _run_on_ray(sessions, setup)
        runs.append(RouterRun(name, setup.replicas, report, cache_tokens))
        print(f"{name}: cached share {report.cached_share:.1%}, {len(report.succeeded)}/{len(report.turns)} turns "
              f"ok in {report.duration_s:.1f} s", file=sys.stderr, flush=True)
    return runs


def router_setups(scale, routers: list[str]) -> list[tuple[str, object, bool]]:
    """(name, setup, whether its replicas share a disk tier): one big replica, then `scale.replicas` replicas
    behind each router, all without a disk tier; if `scale` has one (--kv-disk-cache), each router once more with
    its replicas sharing it."""
    plain = dataclasses.replace(scale, engine=dataclasses.replace(scale.engine, kv_disk_cache=None))
    setups = [(BIG_REPLICA, big_replica(plain), False)] + [(r, dataclasses.replace(plain, router=r), False)
                                                          for r in routers]
    if scale.engine.kv_disk_cache is not None:
        setups += [(r + SHARED_DISK, dataclasses.replace(scale, router=r), True) for r in routers]
    return setups


def write_turns(path: str, runs: list[RouterRun]) -> None:
    """One JSON object per line for each turn of each run, in the order the conversations ran them."""
    with open(path, "w") as out:
        for run in runs:
            for turn in run.report.turns:
                out.write(json.dumps({"setup": run.name, **dataclasses.asdict(turn)}) + "\n")


def big_replica(scale):
    """One engine with the CPUs and KV cache of all of `scale`'s replicas together."""
    from kvserve.config import DEFAULT_KV_CACHE_MEMORY_BYTES

    per_replica = scale.engine.kv_cache_memory
    per_replica_bytes = DEFAULT_KV_CACHE_MEMORY_BYTES if per_replica is None else parse_size(per_replica)
    engine = dataclasses.replace(scale.engine, kv_cache_memory=per_replica_bytes * scale.replicas)
    return dataclasses.replace(scale, engine=engine, replicas=1, replica_cpus=scale.replica_cpus * scale.replicas,
                               router="round-robin")


def print_runs(runs: list[RouterRun]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Multi-turn sessions: prompt tokens found cached, per setup")
    for column in ["setup", "replicas", "KV cache\ntokens", "turns ok", "prompt\ntokens", "prefilled\ntokens",
                   "cached\nshare", "replicas per\nconversation", "TTFT mean\nms", "TTFT p90\nms", "duration\ns",
                   "output\ntok/s"]:
        table.add_column(column, justify="right")
    for run in runs:
        r = run.report
        cache = f"{run.kv_cache_tokens:,}" if run.kv_cache_tokens else "-"
        table.add_row(run.name, str(run.replicas or "-"), cache, f"{len(r.succeeded)}/{len(r.turns)}",
                      f"{r.prompt_tokens:,}", f"{r.prefilled_tokens:,}", f"{r.cached_share:.1%}",
                      f"{r.replicas_per_conversation():.2f}", f"{r.ttft_mean_ms:,.0f}", f"{r.ttft_ms(90):,.0f}",
                      f"{r.duration_s:.1f}", f"{r.output_tokens / r.duration_s:.1f}")
    console = Console(width=160)  # the table is wide; a pipe would otherwise squeeze it into 80 columns
    console.print(table)
    console.print(f"the conversations end holding {runs[0].report.final_tokens:,} tokens in all "
                  "(each one's last prompt and answer)")
    for line in cached_share_ratios(runs):
        console.print(line)
    failures = sorted({t.error for run in runs for t in run.report.turns if not t.success})
    for error in failures[:5]:
        console.print(f"error: {error}")


def cached_share_ratios(runs: list[RouterRun]) -> list[str]:
    shares = {run.name: run.report.cached_share for run in runs}
    lines = []
    if "prefix" in shares:
        for other in (BIG_REPLICA, "round-robin", "pow2"):
            if other in shares and shares[other] > 0:
                lines.append(f"prefix routing's cached share is {shares['prefix'] / shares[other]:.2f}x {other}'s")
    for run in runs:  # what sharing a disk tier adds to each router
        router = run.name.removesuffix(SHARED_DISK)
        if router != run.name and shares.get(router):
            lines.append(f"{run.name}: cached share {shares[run.name] / shares[router]:.2f}x {router}'s alone")
    return lines


def _scale_out_from_args(args: argparse.Namespace):
    from kvserve.engine.cli import engine_config_from_args
    from kvserve.scaleout.config import ROUTER_NAMES, ScaleOutConfig

    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = [r for r in routers if r not in ROUTER_NAMES]
    if unknown or not routers:
        raise ValueError(f"--routers takes a comma-separated list of {', '.join(ROUTER_NAMES)}, got {args.routers!r}")
    engine = dataclasses.replace(engine_config_from_args(args), model=args.model)
    if engine.kv_disk_cache is not None:  # the shared tiers' directories go under it: fail now, not after a setup
        try:
            os.makedirs(engine.kv_disk_cache, exist_ok=True)
            tempfile.TemporaryDirectory(dir=engine.kv_disk_cache).cleanup()
        except OSError as exc:
            raise ValueError(f"--kv-disk-cache {engine.kv_disk_cache}: cannot write there ({type(exc).__name__}: "
                             f"{exc.strerror or exc})") from exc
    scale = ScaleOutConfig(engine=engine, replicas=args.replicas, replica_cpus=args.replica_cpus,
                           imbalance_threshold=args.imbalance_threshold, api_key=args.api_key, access_log=False)
    return routers, scale


def kv_cache_tokens(base_url: str) -> int | None:
    """The KV cache size of every replica together, from a scaled-out endpoint's /health (None elsewhere)."""
    try:
        replicas = httpx.get(base_url + "/health", timeout=30).json().get("replicas")
    except (httpx.HTTPError, ValueError):
        return None
    return sum(r["kv_cache_tokens"] for r in replicas) if replicas else None


def _run_on_ray(sessions: SessionsConfig, setup) -> tuple[SessionsReport, int | None]:
    from kvserve.scaleout.cluster import RayEndpoint

    with RayEndpoint(setup, log_to_driver=False) as endpoint:
        warm_up = dataclasses.replace(sessions, base_url=endpoint.url, model=None, turns=1, first_len=16,
                                      answer_len=2, conversations=WARM_UP_REQUESTS_PER_REPLICA * setup.replicas,
                                      seed=sessions.seed + 1)
        asyncio.run(run_sessions(warm_up))
        report = asyncio.run(run_sessions(dataclasses.replace(sessions, base_url=endpoint.url, model=None)))
        return report, kv_cache_tokens(endpoint.url)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
