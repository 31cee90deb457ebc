"""`kvserve serve --replicas N` refuses bad scale-out options with a message naming the flag, before starting Ray."""
import sys

import pytest

from kvserve.cli import main
from kvserve.scaleout.config import ScaleOutConfig


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "0"], "--replicas must be at least 1, got 0"),
    (["--replicas", "2", "--port", "0"], "--port must be in [1, 65535] with Ray"),
    (["--replicas", "2", "--replica-cpus", "0"], "--replica-cpus must be positive"),
    (["--replicas", "2", "--router-imbalance-threshold", "-1"], "--router-imbalance-threshold must be >= 0"),
])
def test_bad_scale_out_flags_are_refused_naming_the_flag(flags, message, capsys):
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


def test_an_unknown_router_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--replicas", "2", "--router", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err


def test_serve_lets_each_replica_queue_what_the_single_server_queues():
    config = ScaleOutConfig(max_waiting=10)
    assert config.max_ongoing_requests == 10 + config.engine.max_num_seqs


def test_each_replica_gets_the_single_servers_app_options(monkeypatch):
    """--allowed-hosts, --chat-content-special-tokens, --max-body-size and the tool-call flags reach every replica's
    build_app."""
    from kvserve.scaleout import cli as scaleout_cli

    seen = {}

    def run_on_ray(args):
        seen["config"] = scaleout_cli.config_from_args(args)
        return 0

    monkeypatch.setattr("kvserve.scaleout.cli.run_on_ray", run_on_ray)
    assert main(["serve", "--replicas", "2", "--allowed-hosts", "kv.example.com", "--chat-content-special-tokens",
                 "--max-body-size", "1MiB", "--tool-call-parser", "hermes", "--no-enable-auto-tool-choice"]) == 0
    config = seen["config"]
    assert config.tool_call_parser == "hermes" and not config.auto_tool_choice
    assert config.allowed_hosts == ("kv.example.com",) and config.chat_content_special_tokens
    assert config.max_body_bytes == 2**20


# What Serve reports when every EngineReplica constructor raised (shape of Ray 2.60's deployment status message)
SERVE_REPORT = """EngineReplica: The deployment failed to start 6 times in a row. This may be due to a problem with its \
constructor or initial health check failing. See controller logs for details. Error:
ray::ServeReplica:kvserve:EngineReplica.initialize_and_get_metadata() (pid=7195)
  File "/x/ray/serve/_private/replica.py", line 1928, in initialize
    raise RuntimeError(traceback.format_exc()) from None
RuntimeError: Traceback (most recent call last):
  File "/x/kvserve/engine/llm_engine.py", line 64, in __init__
    raise ValueError(self.cache_plan.error)
ValueError: smollm2-135m: max_model_len 8,192 needs 360.00 MiB of KV cache for one request, more than the 319.92 MiB
"""


def test_a_replica_that_cannot_start_is_reported_by_its_own_error():
    from kvserve.scaleout.cluster import replica_error_summary

    assert replica_error_summary(SERVE_REPORT) == ("the engine replicas did not start: ValueError: smollm2-135m: "
                                                   "max_model_len 8,192 needs 360.00 MiB of KV cache for one request, "
                                                   "more than the 319.92 MiB")
    assert replica_error_summary("EngineReplica: unhealthy\n") == "the engine replicas did not start: EngineReplica: unhealthy"


@pytest.mark.parametrize("argv", [["serve", "--replicas", "2"], ["bench", "serve", "--conversations", "2", "--routers", "prefix"]])
def test_scale_out_without_ray_names_the_install_command(argv, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    assert main(argv) == 1
    assert 'pip install -e ".[ray]"' in capsys.readouterr().err


def test_routers_without_conversations_are_refused(capsys):
    assert main(["bench", "serve", "--routers", "prefix"]) == 2
    assert "add --conversations N" in capsys.readouterr().err


def test_bench_serve_refuses_a_disk_tier_directory_it_cannot_write_before_starting_ray(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    argv = ["bench", "serve", "--conversations", "2", "--routers", "round-robin",
            "--kv-disk-cache", str(tmp_path / "file" / "kv")]
    assert main(argv) == 2
    assert f"--kv-disk-cache {tmp_path / 'file' / 'kv'}: cannot write there" in capsys.readouterr().err
