"""``mstar-rt serve CONFIG``: loads the model the config names, starts its runtime, and serves
HTTP + the openpi policy websocket until interrupted (Ctrl-C / SIGTERM close everything).

    mstar-rt serve examples/serve/robot_policy.yaml [--host 127.0.0.1] [--port 8000]
                   [--api-key KEY]

Prints a line per loading step, then one line ``mstar-rt: serving <model> on <url>``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time
from typing import Optional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mstar-rt", description="mstar_rt serving")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model from a YAML config (see docs/serving.md)")
    s.add_argument("config", help="the YAML serving config")
    s.add_argument("--host", help="bind address (default: server.host, else 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default: server.port; 0 = any free port)")
    s.add_argument("--api-key", help="require this API key (overrides server.api_key)")
    s.add_argument("--log-level", default="warning", help="uvicorn log level")
    return p


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives each thread that allocates under contention its own malloc arena, up to eight
    per core; a server with a thread per streaming request then grows for minutes as the arenas
    fill (the soak benchmark saw +4-6 MB over the first minutes). Two arenas, as gunicorn
    recommends for threaded Python servers, unless MALLOC_ARENA_MAX says otherwise."""
    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc (musl): nothing to tune
        pass


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    _limit_malloc_arenas()
    from mstar_rt.serve.config import ConfigError, build_model, build_runtime, load_config

    t0 = time.monotonic()
    done = [0]

    def step(what: str) -> None:  # one progress line per loading step
        done[0] += 1
        print(f"mstar-rt: [{done[0]}/4 {time.monotonic() - t0:5.1f} s] {what}", file=sys.stderr,
              flush=True)

    runtime = None
    try:
        step(f"reading {args.config}")
        config = load_config(args.config).with_server(host=args.host, port=args.port,
                                                      api_key=args.api_key)
        server_spec = config.server
        step(f"building model {config.model.factory or config.model.checkpoint}")
        model = build_model(config)
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
    except (ConfigError, ValueError, OSError) as e:
        print(f"mstar-rt: {e}", file=sys.stderr)
        if runtime is not None:
            runtime.close()
        return 2
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
        runtime.close()
        print("mstar-rt: stopped", flush=True)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
