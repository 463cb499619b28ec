"""``mstar-rt serve CONFIG``: loads the model the config names, starts its runtime, and serves
HTTP + the openpi policy websocket until interrupted (Ctrl-C / SIGTERM close everything).

    mstar-rt serve examples/serve/robot_policy.yaml [--host 127.0.0.1] [--port 8000]
                   [--api-key KEY] [--no-warm-up] [--replicas N] [--ray-address ADDR]

Prints a line per loading step and one for the warm-up (the policy run once at every batch size,
mstar_rt.serve.warmup), then one line ``mstar-rt: serving <model> on <url>``. With
``--replicas N`` (or a ``ray:`` section in the config) the same app runs as a Ray Serve
deployment of N replicas instead (mstar_rt.serve.ray_serve).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Any, Optional

from mstar_rt.malloc_tuning import tune_malloc

CLOSE_WAIT_S = 30.0  # after a stop: how long nodes running then may take to return


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mstar-rt", description="mstar_rt serving")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model from a YAML config (see docs/serving.md)")
    s.add_argument("config", help="the YAML serving config")
    s.add_argument("--host", help="bind address (default: server.host, else 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default: server.port; 0 = any free port)")
    s.add_argument("--api-key", help="require this API key (overrides server.api_key)")
    s.add_argument("--log-level", default="warning", help="uvicorn log level",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    s.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="skip running the policy once at every batch size before serving")
    s.add_argument("--replicas", type=int, help="serve N replicas on Ray Serve (overrides "
                   "ray.replicas / min_replicas / max_replicas)")
    s.add_argument("--ray-address", help="the Ray cluster (auto, host:port; default: "
                   "ray.address, else RAY_ADDRESS, else a local cluster started here)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    tune_malloc()
    from mstar_rt.serve.config import ConfigError, build_model, build_runtime, load_config

    t0 = time.monotonic()
    done = [0]

    def step(what: str) -> None:  # one progress line per loading step
        done[0] += 1
        print(f"mstar-rt: [{done[0]}/4 {time.monotonic() - t0:5.1f} s] {what}", file=sys.stderr,
              flush=True)

    from mstar_rt.placement.process import WorkerStartError

    runtime = model = None
    try:
        step(f"reading {args.config}")
        config = load_config(args.config).with_server(host=args.host, port=args.port,
                                                      api_key=args.api_key)
        server_spec = config.server
        if args.replicas is not None or args.ray_address or config.ray is not None:
            return _serve_on_ray(args, config, t0)
        source = config.model.factory or config.model.checkpoint
        step(f"building model {source}")
        try:
            model = build_model(config)
        except ConfigError:
            raise
        except Exception as e:  # inside the factory or loader: one line whatever it raised
            key = "model.class" if config.model.factory else "model.checkpoint"
            raise ConfigError(f"{key}: building {source} failed: {type(e).__name__}: {e}") from e
        from mstar_rt.model import node_engines
        step("starting the runtime (engines: "
             f"{', '.join(sorted(set(node_engines(model).values()) or {'default'}))})")
        runtime = build_runtime(config, model)
        step(f"binding {server_spec.host}:{server_spec.port}")
        from mstar_rt.serve.app import create_app
        from mstar_rt.serve.deployment import Deployment
        from mstar_rt.serve.server import Server

        deployment = Deployment.from_config(config, model, runtime)
        server = Server(create_app(deployment), server_spec.host, server_spec.port,
                        log_level=args.log_level)
    except (ConfigError, ValueError, OSError, WorkerStartError) as e:
        print(f"mstar-rt: {e}", file=sys.stderr)
        if runtime is not None:
            runtime.close()
        elif callable(getattr(model, "close", None)):  # e.g. tensor-parallel followers
            model.close()
        return 2
    if args.warm_up:
        from mstar_rt.serve.warmup import warm_up

        print(f"mstar-rt: {warm_up(deployment).describe()}", file=sys.stderr, flush=True)
    key = " (API key required)" if server_spec.api_key else ""
    print(f"mstar-rt: serving {deployment.name} on {server.url} (policy websocket "
          f"{server.ws_url}/){key}; loaded in {time.monotonic() - t0:.1f} s", flush=True)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again: make
    # both a KeyboardInterrupt so the runtime (and any worker process) is closed below.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        # a node that never returns must not keep a service manager's stop waiting forever
        if not runtime.close(timeout=CLOSE_WAIT_S):
            print(f"mstar-rt: a node was still running {CLOSE_WAIT_S:g} s after the stop; "
                  "exiting without it", file=sys.stderr, flush=True)
        print("mstar-rt: stopped", flush=True)
    return 0


def _serve_on_ray(args: argparse.Namespace, config: Any, t0: float) -> int:
    """Runs the app as Ray Serve replicas until SIGINT / SIGTERM, then deletes it (and stops
    the cluster if it was started here)."""
    from mstar_rt.serve.config import ConfigError, RaySpec

    try:
        if args.replicas is not None and args.replicas < 1:
            raise ConfigError(f"--replicas: must be a positive integer, not {args.replicas}")
        spec = (config.ray or RaySpec()).with_replicas(args.replicas)
        from mstar_rt.serve import ray_serve  # imports Ray: only here
        ray_serve.check(config, spec)
    except ImportError as e:
        print(f"mstar-rt: replicas need Ray Serve ({e}); pip install 'mstar_rt[ray]'",
              file=sys.stderr)
        return 2
    except (ConfigError, ValueError) as e:
        print(f"mstar-rt: {e}", file=sys.stderr)
        return 2
    count = (f"{spec.replicas or 1} replicas" if spec.autoscaling is None else
             f"{spec.autoscaling['min_replicas']}..{spec.max_replicas} replicas (autoscaling)")
    where = (args.ray_address or spec.address or os.environ.get("RAY_ADDRESS")
             or "a local cluster")
    print(f"mstar-rt: starting {count} on Ray Serve ({where})", file=sys.stderr, flush=True)
    try:
        serving = ray_serve.start(config, spec, address=args.ray_address, warm_up=args.warm_up)
    except Exception as e:  # a replica that fails to build, a cluster not reachable
        print(f"mstar-rt: Ray Serve did not start the app: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # while connecting or starting: what was started is undone
        print("mstar-rt: interrupted while Ray Serve started the app", file=sys.stderr)
        return 130
    # After ray.init, whose own SIGTERM handler would end this process without deleting the app
    # (it would keep serving on a cluster this process did not start).
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    key = " (API key required)" if config.server.api_key else ""
    print(f"mstar-rt: serving {config.model.name or config.model.factory} on {serving.url} "
          f"(policy websocket {serving.ws_url}/), {count} on Ray cluster {serving.address}"
          f"{key}; loaded in {time.monotonic() - t0:.1f} s", flush=True)
    while not stop.wait(0.5):
        pass
    try:
        serving.stop()
    finally:
        print("mstar-rt: stopped", flush=True)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
