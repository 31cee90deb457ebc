"""`kvserve bench ...`: benchmarks that print ratios against a baseline measured in the same run."""
from __future__ import annotations

from kvserve.bench.agent_loop import add_agent_loop_parser
from kvserve.bench.dashboard import add_dashboard_bench_parser
from kvserve.bench.mla import add_mla_parser
from kvserve.bench.multiturn import add_multiturn_parser
from kvserve.bench.serve import add_serve_bench_parser
from kvserve.bench.startup import add_startup_parser
from kvserve.bench.step import add_step_parser
from kvserve.bench.throughput.cli import add_throughput_parser
from kvserve.bench.window import add_window_parser


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench",
                                  help="benchmarks: throughput, multiturn, agent-loop, serve, dashboard, window, mla, step, "
                                       "startup")
    kinds = bench.add_subparsers(dest="bench", required=True)
    add_throughput_parser(kinds)
    add_multiturn_parser(kinds)
    add_agent_loop_parser(kinds)
    add_serve_bench_parser(kinds)
    add_dashboard_bench_parser(kinds)
    add_window_parser(kinds)
    add_mla_parser(kinds)
    add_step_parser(kinds)
    add_startup_parser(kinds)
