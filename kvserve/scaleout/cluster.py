"""Bringing the endpoint up and down: start Ray on this machine (or join a cluster), deploy the Serve application,
and on the way out stop everything that was started here, Ray processes included."""
from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path

from kvserve.scaleout.config import ScaleOutConfig
from kvserve.server.launch import BACKSTOP_S

logger = logging.getLogger("kvserve")

# Only requests and response pieces travel through Ray's object store: a small one leaves memory to the engines.
LOCAL_OBJECT_STORE_BYTES = 256 << 20


class RayEndpoint:
    """`with RayEndpoint(config) as endpoint:` serves the OpenAI API on endpoint.url until the block ends."""

    def __init__(self, config: ScaleOutConfig, log_to_driver: bool = True):
        self.config = config
        self.log_to_driver = log_to_driver
        self._started_ray = False

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.config.port}"

    @property
    def owns_ray(self) -> bool:
        """Whether Ray was started here (and is stopped on exit) rather than joined."""
        return self.config.ray_address is None

    def __enter__(self) -> RayEndpoint:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        """Deploy and return once every replica has loaded its model (minutes for a large one)."""
        import ray
        from ray import serve

        from kvserve.model.loader import resolve_model
        from kvserve.scaleout.deployments import build_application

        resolve_model(self.config.engine.model)  # fetch/convert once here, not in every replica at the same time
        self._init_ray(ray)
        self._started_ray = True
        try:
            serve.start(http_options={"host": self.config.host, "port": self.config.port})
            try:
                serve.run(build_application(self.config), name=self.config.app_name, route_prefix="/")
            except RuntimeError as exc:  # Serve says only "failed to update the deployments": add the replicas' error
                raise ReplicaStartError(replica_error_summary(self._deployment_errors(serve))) from exc
        except BaseException:
            self.stop()
            raise

    def _deployment_errors(self, serve) -> str:
        """What Serve recorded about each unhealthy deployment (a replica's constructor error and its traceback)."""
        try:
            deployments = serve.status().applications[self.config.app_name].deployments
        except Exception as exc:  # noqa: BLE001 - a status we cannot read adds nothing, it must not hide the error
            return f"(Serve's status could not be read: {exc})"
        return "\n".join(f"{name}: {d.message}" for name, d in deployments.items() if d.message) or "(no message)"

    def stop(self) -> None:
        """Drain (as the single server does on Ctrl-C), remove the application; if Ray was started here, stop Serve
        and every Ray process too."""
        import ray
        from ray import serve

        if not self._started_ray:
            return
        self._started_ray = False
        try:
            self._drain(serve)
            if self.owns_ray:
                serve.shutdown()
            else:
                serve.delete(self.config.app_name)
        finally:
            ray.shutdown()

    def _drain(self, serve) -> None:
        # Serve's own shutdown stops its HTTP proxy first, cutting every open stream: let the ingress drain first.
        timeout_s = self.config.shutdown_timeout_s
        try:
            ingress = serve.get_app_handle(self.config.app_name)
            num_aborted = ingress.drain.remote(timeout_s).result(timeout_s=timeout_s + 2 * BACKSTOP_S + 10)
        except Exception as exc:  # an application that never came up has nothing to drain
            logger.warning("could not drain the endpoint before stopping it: %s", exc)
            return
        if num_aborted:
            logger.info("aborted %d requests still running after %.0f s", num_aborted, timeout_s)

    def _init_ray(self, ray) -> None:
        if not self.owns_ray:
            ray.init(address=self.config.ray_address, log_to_driver=self.log_to_driver)
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a local run reports nothing home
        # Replicas import the same kvserve as this process (a checkout too, not only an installed copy).
        package_root = str(Path(__file__).resolve().parents[2])
        ray.init(num_cpus=math.ceil(self.config.replicas * self.config.replica_cpus),
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, include_dashboard=False,
                 log_to_driver=self.log_to_driver,
                 runtime_env={"env_vars": {"PYTHONPATH": package_root}})


class ReplicaStartError(RuntimeError):
    """The engine replicas did not start (their own error, e.g. a KV cache too small for max_model_len)."""


def replica_error_summary(report: str) -> str:
    """One line from Serve's report on a failed deployment: the replica's own exception (the traceback's last
    `SomeError: ...` line), else the report's first line."""
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b[^:]*: ", line)]
    reason = raised[-1] if raised else (lines[0] if lines else "(Serve gave no reason)")
    return f"the engine replicas did not start: {reason}"
