"""`kvserve serve --replicas N` refuses bad scale-out options with a message naming the flag, before starting Ray."""
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
