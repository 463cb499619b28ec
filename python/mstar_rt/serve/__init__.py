"""Serving: ``mstar-rt serve CONFIG`` — HTTP (health, models, OpenAI-compatible speech, NDJSON
generate, Prometheus metrics) and an openpi-compatible policy websocket, over any runtime with
``submit / close / live``. Modules load on first use, so ``import mstar_rt`` never imports
FastAPI.

    from mstar_rt.serve import Deployment, Server, create_app
    with Runtime(model) as rt, Server(create_app(Deployment.for_model(model, rt))) as server:
        ...  # server.url, server.ws_url
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ConfigError": "config", "ServeConfig": "config", "load_config": "config",
    "build_model": "config", "build_runtime": "config", "PolicySpec": "config",
    "SpeechSpec": "config",
    "Deployment": "deployment",
    "create_app": "app",
    "Server": "server",
    "MstarClient": "client", "ServeError": "client",
    "SentenceTTS": "speech_models",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mstar_rt.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mstar_rt.serve.{module}"), name)
