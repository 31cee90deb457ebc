"""ScaleOutConfig: how many engine replicas, how requests are routed to them, where Ray runs (validated here)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import EngineConfig
from kvserve.server.async_engine import DEFAULT_MAX_WAITING
from kvserve.server.body import DEFAULT_MAX_BODY_BYTES

ROUTER_NAMES = ("prefix", "pow2", "round-robin")
DEFAULT_IMBALANCE_THRESHOLD = 8  # ongoing requests between the busiest and the idlest replica


@dataclass(frozen=True)
class ScaleOutConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)  # every replica's engine
    replicas: int = 2
    router: str = "prefix"
    imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD
    replica_cpus: float = 1.0  # Ray CPUs per replica, also its torch threads (at least one)
    replica_gpus: float = 0.0
    ray_address: str | None = None  # None: start Ray on this machine; "auto" or host:port: join that cluster
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_waiting: int = DEFAULT_MAX_WAITING  # per replica, as in the single server
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # each replica's app, as the single server's options
    allowed_hosts: tuple[str, ...] = ()
    chat_content_special_tokens: bool = False
    tool_call_parser: str = "auto"  # each replica's tool-call format, as the single server's --tool-call-parser
    auto_tool_choice: bool = True  # tool_choice "auto" served (--enable-auto-tool-choice)
    shutdown_timeout_s: float = 30.0
    access_log: bool = True
    app_name: str = "kvserve"

    def __post_init__(self) -> None:
        checks = [
            (self.replicas >= 1, f"--replicas must be at least 1, got {self.replicas}"),
            (self.router in ROUTER_NAMES, f"--router must be one of {', '.join(ROUTER_NAMES)}, got {self.router!r}"),
            (self.imbalance_threshold >= 0,
             f"--router-imbalance-threshold must be >= 0, got {self.imbalance_threshold}"),
            (self.replica_cpus > 0, f"--replica-cpus must be positive, got {self.replica_cpus}"),
            (self.replica_gpus >= 0, f"--replica-gpus must be >= 0, got {self.replica_gpus}"),
            (1 <= self.port <= 65535,
             f"--port must be in [1, 65535] with Ray (its proxy binds a fixed port), got {self.port}"),
            (self.max_waiting >= 1, f"--max-waiting must be at least 1, got {self.max_waiting}"),
            (self.shutdown_timeout_s >= 0, f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout_s}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def max_ongoing_requests(self) -> int:
        """Requests Serve lets one replica hold: its engine's own queue limit decides beyond its running batch."""
        return self.max_waiting + self.engine.max_num_seqs


def ray_missing() -> str | None:
    """None when Ray Serve can be imported, else what to run to get it."""
    try:
        import ray.serve  # noqa: F401
    except ModuleNotFoundError as exc:
        return f"this needs Ray Serve ({exc}); install it with: pip install -e \".[ray]\""
    return None
