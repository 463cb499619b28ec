"""Replicas of the server on Ray Serve: the same ASGI app as ``mstar-rt serve`` (HTTP and the
openpi websocket), one copy per replica, behind Ray Serve's proxy.

    mstar-rt serve CONFIG --replicas 2 [--ray-address auto]      # or a ``ray:`` config section

Each replica builds the model and its runtime from the config in its own process (the config is
data; a model is never pickled), then serves ``create_app(...)`` of it. Ray places the replicas
(``num_cpus`` / ``num_gpus`` / custom ``resources`` each), routes requests and websocket
connections among them, replaces a replica that dies and, with ``min_replicas`` /
``max_replicas``, scales on load. Importing this module imports Ray; nothing else in mstar_rt
does, so Ray is needed only when replicas are asked for.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

import ray
from ray import serve

from mstar_rt.serve.config import ConfigError, RaySpec, ServeConfig

REPLICA_HEADER = "x-mstar-replica"  # on every HTTP response and websocket handshake
DEPLOYMENT = "MstarServer"


class _ReplicaHeader:
    """ASGI middleware naming the replica that answered: a client (or a test) can tell which
    replica holds its websocket, which matters when one replica is lost."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return

        async def tagged(message: dict) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)


class MstarReplica:
    """One replica: the model, its runtime and the app, built in the replica's process."""

    def __init__(self, config: ServeConfig, warm_up: bool = True) -> None:
        from mstar_rt.serve.config import build_model, build_runtime
        from mstar_rt.serve.deployment import Deployment

        # Names apart from Ray's ASGI wrapper's (it owns `app`).
        model = build_model(config)
        self.mstar_runtime: Any = build_runtime(config, model)
        self.mstar_deployment = Deployment.from_config(config, model, self.mstar_runtime)
        self.mstar_app: Any = None
        if warm_up:
            from mstar_rt.serve.warmup import warm_up as run_warm_up

            run_warm_up(self.mstar_deployment)

    def __serve_build_asgi_app__(self) -> Any:
        from mstar_rt.serve.app import create_app

        self.mstar_app = create_app(self.mstar_deployment)
        return _ReplicaHeader(self.mstar_app, self.where()["replica"])

    def check_health(self) -> None:
        """Ray Serve's probe: a replica whose model cannot serve (``Runtime.health``: a
        tensor-parallel rank or a placed worker lost for good) raises, and Ray replaces it."""
        reason = self.mstar_runtime.health()
        if reason is not None:
            raise RuntimeError(reason)

    def where(self) -> dict[str, Any]:
        """Which replica this is, and where it runs (its Ray node, process and actor)."""
        ctx = ray.get_runtime_context()
        return {"replica": serve.get_replica_context().replica_id.unique_id,
                "node_id": ctx.get_node_id(), "pid": os.getpid(),
                "actor": ctx.get_actor_name(), "live": dict(self.mstar_runtime.live)}

    def __del__(self) -> None:
        # Ray Serve calls this when it stops a replica gracefully (scale down, app deleted).
        if getattr(self, "mstar_app", None) is not None:
            self.mstar_app.state.serve.close()
        if getattr(self, "mstar_runtime", None) is not None:
            self.mstar_runtime.close()
            self.mstar_runtime = None


def deployment_options(config: ServeConfig, spec: RaySpec) -> dict[str, Any]:
    """``serve.deployment(...)`` options from the config's ``ray`` section."""
    actor: dict[str, Any] = {"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus}
    if spec.resources:
        actor["resources"] = dict(spec.resources)
    if spec.runtime_env:
        actor["runtime_env"] = dict(spec.runtime_env)
    opts: dict[str, Any] = {
        "name": DEPLOYMENT, "ray_actor_options": actor,
        # Ray's default (5) would also cap the open policy websockets per replica at 5.
        "max_ongoing_requests": spec.max_ongoing_requests or config.max_concurrent_requests,
        "graceful_shutdown_timeout_s": 5}
    if spec.autoscaling is not None:
        opts["autoscaling_config"] = spec.autoscaling
    else:
        opts["num_replicas"] = spec.replicas or 1
    if spec.health_check_period_s is not None:
        opts["health_check_period_s"] = spec.health_check_period_s
    return opts


def application(config: ServeConfig, spec: RaySpec, warm_up: bool = True) -> Any:
    """The bound Ray Serve application (pass to ``serve.run``)."""
    replica = serve.deployment(serve.ingress()(MstarReplica))
    return replica.options(**deployment_options(config, spec)).bind(config, warm_up)


@dataclass
class RayServing:
    """An app running on a Ray cluster; ``stop()`` deletes it, stops Ray Serve unless other
    apps use it, and disconnects (a local cluster started by :func:`start` stops with it)."""

    url: str
    app_name: str
    address: str
    owns_cluster: bool

    @property
    def ws_url(self) -> str:
        return "ws" + self.url[4:]

    def stop(self) -> None:
        try:
            serve.delete(self.app_name)
            # Serve's proxy still holds the port: stop it too unless other apps use it.
            if self.owns_cluster or not serve.status().applications:
                serve.shutdown()
        finally:
            ray.shutdown()


def check(config: ServeConfig, spec: RaySpec) -> None:
    """What the proxy cannot do as written, refused before any cluster is touched."""
    if config.server.port == 0:
        raise ConfigError("server.port: Ray Serve's proxy listens on a fixed port; give one "
                          "(0 = any free port works only without replicas)")
    if any(g.process for g in config.node_groups):
        # Worker processes per replica would work, but a replica reserves only num_cpus /
        # num_gpus from Ray for all of them: refuse rather than oversubscribe silently.
        raise ConfigError("node_groups: worker processes (process: true) are not run inside "
                          "Ray replicas; serve the model in-process per replica (process: false) "
                          "and scale with ray.replicas")


def reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ValueError naming ``address`` when nothing answers there: ray.init retried an
    unreachable GCS for minutes. ``auto`` and ``ray://`` addresses are left to Ray."""
    host, sep, port = address.rpartition(":")
    if address == "auto" or "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"ray address {address}: nothing answers there ({e}); start the cluster "
                         "(ray start --head) or check --ray-address / ray.address") from None


def start(config: ServeConfig, spec: RaySpec, address: Optional[str] = None,
          warm_up: bool = True) -> RayServing:
    """Connects to the cluster at ``address`` (else ``spec.address``, else ``RAY_ADDRESS``; with
    none, starts a local one), starts Ray Serve's proxy on ``server.host:port`` and runs the app;
    returns once every replica serves."""
    check(config, spec)
    address = address or spec.address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        ray.init(address="local", include_dashboard=False, logging_level="warning")
    else:
        reachable(address)
        ray.init(address=address, logging_level="warning")
    info = ray.get_runtime_context().gcs_address
    try:
        serve.start(proxy_location=spec.proxy_location,
                    http_options={"host": config.server.host, "port": config.server.port})
        serve.run(application(config, spec, warm_up), name=spec.app_name, route_prefix="/")
    except BaseException:
        with contextlib.suppress(Exception):  # a failed app stays listed, answering 503
            serve.delete(spec.app_name)
            if address is None:
                serve.shutdown()
        ray.shutdown()
        raise
    return RayServing(url=config.server.url, app_name=spec.app_name, address=info,
                      owns_cluster=address is None)


def replica_actors(app_name: str) -> list[str]:
    """The Ray actor names of the app's replicas now alive (``ray.get_actor(name, "serve")``)."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and f"{app_name}#{DEPLOYMENT}#" in a["name"])
