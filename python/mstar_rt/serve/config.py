"""The serving config (YAML): which model, where its nodes run, how much KV cache, how many
requests at once, and how the HTTP / websocket front-end maps requests onto the model.

    model:
      class: "policy:ChunkPolicyModel"      # "package.module:Factory" (a class, or Class.method)
      args: {}                              # keyword arguments of the factory
      path: [../robot]                      # sys.path entries, relative to this file (optional)
      name: robot-policy                    # the id clients use (default: the factory's name)
    node_groups:                            # optional; default: every node on rank 0, in-process
      - {nodes: [normalize, mlp, denormalize], rank: 0, device: cpu, process: false}
    kv_cache: {page_size: 16, num_pages: 1024}
    max_concurrent_requests: 16
    request_timeout_s: 60
    server: {host: 127.0.0.1, port: 8000, api_key_env: MSTAR_API_KEY}
    speech: {...}                           # see SpeechSpec
    policy: {...}                           # see PolicySpec

Every error is a :class:`ConfigError` naming the key (``node_groups[1].rank``) and what to write.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union


class ConfigError(ValueError):
    """The serving config is wrong; the message names the key and what to change."""


# ---- sections ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """``factory`` ("module:Name" or "module:Class.method") called with ``args``, or
    ``checkpoint``: a Llama checkpoint directory served as a CausalLM."""

    factory: Optional[str] = None
    args: Mapping[str, Any] = field(default_factory=dict)
    checkpoint: Optional[str] = None
    path: tuple[str, ...] = ()
    name: str = ""


@dataclass(frozen=True)
class NodeGroup:
    """Nodes (in the given walks, or all walks) served by one rank. A rank is a worker: an
    in-process thread today (``process: false``) or, with the placement runtime, a worker
    process on ``device``."""

    nodes: tuple[str, ...]
    rank: int = 0
    walks: Optional[tuple[str, ...]] = None
    device: str = "cpu"
    process: bool = False


@dataclass(frozen=True)
class ServerSpec:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None  # resolved: literal, or read from api_key_env

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class SpeechSpec:
    """How ``/v1/audio/speech`` drives the model: the text and voice inputs, the EMIT carrying
    float32 audio at ``model_rate`` (default: the model's ``sample_rate``), the voices accepted
    (default: the model's ``voices``; empty = any), extra ``inputs`` every request gets, and
    the rate of the returned PCM (OpenAI's ``pcm`` is 24 kHz; audio is resampled to it)."""

    text_input: str = "text"
    voice_input: Optional[str] = "voice"
    audio_output: str = "audio"
    voices: Optional[tuple[str, ...]] = None
    model_rate: Optional[int] = None
    output_rate: int = 24000
    inputs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicySpec:
    """How the openpi websocket drives the model: ``observation`` maps observation keys to model
    inputs (empty: keys named like the inputs), ``images`` are observation keys that may arrive
    as encoded bytes (JPEG/PNG), ``shapes`` / ``dtypes`` check and cast inputs by model input
    name (``null`` in a shape = any size), ``actions`` is the EMIT returned as ``actions``,
    ``outputs`` maps further EMITs to reply keys, ``metadata`` is sent on connect."""

    observation: Mapping[str, str] = field(default_factory=dict)
    images: tuple[str, ...] = ()
    shapes: Mapping[str, tuple] = field(default_factory=dict)
    dtypes: Mapping[str, str] = field(default_factory=dict)
    actions: str = "actions"
    outputs: Mapping[str, str] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ServeConfig:
    model: ModelSpec
    node_groups: tuple[NodeGroup, ...] = ()
    kv_cache: Mapping[str, int] = field(default_factory=dict)
    max_concurrent_requests: int = 64
    request_timeout_s: Optional[float] = None
    server: ServerSpec = ServerSpec()
    speech: Optional[SpeechSpec] = None
    policy: Optional[PolicySpec] = None
    base_dir: str = "."

    @property
    def ranks(self) -> dict[int, dict[str, Any]]:
        """rank -> {device, process}: the workers a placement runtime starts."""
        return {g.rank: dict(device=g.device, process=g.process) for g in self.node_groups}


# ---- parsing -----------------------------------------------------------------------------------

_KV_KEYS = ("page_size", "num_pages", "max_batch", "max_tokens_per_step")


def load_config(source: Union[str, os.PathLike, Mapping[str, Any]],
                base_dir: Optional[str] = None) -> ServeConfig:
    """Reads a YAML file (or takes a parsed mapping) and checks every key."""
    if isinstance(source, Mapping):
        raw, base = source, base_dir or os.getcwd()
    else:
        import yaml

        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        base = base_dir or str(path.resolve().parent)
    if not isinstance(raw, Mapping):
        raise ConfigError("the config must be a mapping with at least a 'model:' key")
    _no_unknown(raw, "", ("model", "node_groups", "kv_cache", "max_concurrent_requests",
                          "request_timeout_s", "server", "speech", "policy"))
    if "model" not in raw:
        raise ConfigError("model: missing; give model: {class: 'package.module:Class', args: "
                          "{...}} or model: {checkpoint: path/to/dir}")
    kv = _mapping(raw.get("kv_cache"), "kv_cache")
    _no_unknown(kv, "kv_cache", _KV_KEYS)
    for k, v in kv.items():
        _positive_int(v, f"kv_cache.{k}")
    timeout = raw.get("request_timeout_s")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                or timeout <= 0):
        raise ConfigError(f"request_timeout_s: must be a positive number of seconds, "
                          f"not {timeout!r}")
    return ServeConfig(
        model=_model(raw["model"]),
        node_groups=tuple(_group(g, f"node_groups[{i}]")
                          for i, g in enumerate(_list(raw.get("node_groups"), "node_groups"))),
        kv_cache=dict(kv),
        max_concurrent_requests=_positive_int(raw.get("max_concurrent_requests", 64),
                                              "max_concurrent_requests"),
        request_timeout_s=None if timeout is None else float(timeout),
        server=_server(_mapping(raw.get("server"), "server")),
        speech=None if raw.get("speech") is None else _speech(_mapping(raw["speech"], "speech")),
        policy=None if raw.get("policy") is None else _policy(_mapping(raw["policy"], "policy")),
        base_dir=base)


def _model(raw: Any) -> ModelSpec:
    if isinstance(raw, str):
        raw = {"class": raw}
    raw = _mapping(raw, "model")
    _no_unknown(raw, "model", ("class", "args", "checkpoint", "path", "name"))
    factory, checkpoint = raw.get("class"), raw.get("checkpoint")
    if (factory is None) == (checkpoint is None):
        raise ConfigError("model: give exactly one of 'class' ('package.module:Class', e.g. "
                          "'mstar_rt.models.orpheus:OrpheusTTS.tiny') or 'checkpoint' "
                          "(a directory)")
    if factory is not None and (not isinstance(factory, str) or factory.count(":") != 1):
        raise ConfigError(f"model.class: {factory!r} is not 'package.module:Name'")
    if checkpoint is not None and not isinstance(checkpoint, str):
        raise ConfigError(f"model.checkpoint: must be a directory path, not {checkpoint!r}")
    args = _mapping(raw.get("args"), "model.args")
    path = raw.get("path", [])
    path = [path] if isinstance(path, str) else _list(path, "model.path")
    name = raw.get("name") or (factory.split(":")[1] if factory else Path(checkpoint).name)
    if not isinstance(name, str):
        raise ConfigError(f"model.name: must be a string, not {name!r}")
    return ModelSpec(factory, dict(args), checkpoint, tuple(map(str, path)), name)


def _group(raw: Any, where: str) -> NodeGroup:
    raw = _mapping(raw, where)
    _no_unknown(raw, where, ("nodes", "rank", "walks", "device", "process"))
    nodes = _names(raw.get("nodes"), f"{where}.nodes")
    if not nodes:
        raise ConfigError(f"{where}.nodes: list at least one node")
    rank = raw.get("rank", 0)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ConfigError(f"{where}.rank: must be an integer >= 0, not {rank!r}")
    walks = raw.get("walks")
    device = raw.get("device", "cpu")
    if not isinstance(device, str) or not device:
        raise ConfigError(f"{where}.device: must be a device string such as 'cpu' or 'cuda:0'")
    process = raw.get("process", False)
    if not isinstance(process, bool):
        raise ConfigError(f"{where}.process: must be true or false, not {process!r}")
    return NodeGroup(tuple(nodes), rank, None if walks is None else
                     tuple(_names(walks, f"{where}.walks")), device, process)


def _server(raw: Mapping[str, Any]) -> ServerSpec:
    _no_unknown(raw, "server", ("host", "port", "api_key", "api_key_env"))
    host = raw.get("host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise ConfigError(f"server.host: must be a host name or address, not {host!r}")
    port = raw.get("port", 8000)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"server.port: must be an integer in 0..65535 (0 = any free port), "
                          f"not {port!r}")
    key = raw.get("api_key")
    env = raw.get("api_key_env")
    if key is not None and env is not None:
        raise ConfigError("server: give api_key or api_key_env, not both")
    if env is not None:
        if not isinstance(env, str) or not os.environ.get(env):
            raise ConfigError(f"server.api_key_env: environment variable {env!r} is not set "
                              "(or empty); export it or drop the key")
        key = os.environ[env]
    if key is not None and (not isinstance(key, str) or not key):
        raise ConfigError("server.api_key: must be a non-empty string")
    return ServerSpec(host, port, key)


def _speech(raw: Mapping[str, Any]) -> SpeechSpec:
    names = [f.name for f in dataclasses.fields(SpeechSpec)]
    _no_unknown(raw, "speech", names)
    kw = dict(raw)
    for key in ("text_input", "audio_output"):
        if key in kw and not isinstance(kw[key], str):
            raise ConfigError(f"speech.{key}: must be a string")
    if kw.get("voice_input") is not None and not isinstance(kw["voice_input"], str):
        raise ConfigError("speech.voice_input: must be a string or null")
    if kw.get("voices") is not None:
        kw["voices"] = tuple(_names(kw["voices"], "speech.voices"))
    for key in ("model_rate", "output_rate"):
        if kw.get(key) is not None:
            _positive_int(kw[key], f"speech.{key}")
    kw["inputs"] = dict(_mapping(kw.get("inputs"), "speech.inputs"))
    return SpeechSpec(**kw)


def _policy(raw: Mapping[str, Any]) -> PolicySpec:
    names = [f.name for f in dataclasses.fields(PolicySpec)]
    _no_unknown(raw, "policy", names)
    kw = dict(raw)
    for key in ("observation", "outputs"):
        m = _mapping(kw.get(key), f"policy.{key}")
        for k, v in m.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ConfigError(f"policy.{key}: must map strings to strings ({k!r}: {v!r})")
        kw[key] = dict(m)
    kw["images"] = tuple(_names(kw.get("images", []), "policy.images"))
    shapes = {}
    for k, v in _mapping(kw.get("shapes"), "policy.shapes").items():
        if not isinstance(v, (list, tuple)) or not all(
                d is None or (isinstance(d, int) and d >= 0) for d in v):
            raise ConfigError(f"policy.shapes.{k}: must be a list of sizes (null = any), not {v!r}")
        shapes[k] = tuple(v)
    kw["shapes"] = shapes
    dtypes = dict(_mapping(kw.get("dtypes"), "policy.dtypes"))
    for k, v in dtypes.items():
        try:
            import numpy as np

            np.dtype(v)
        except TypeError:
            raise ConfigError(f"policy.dtypes.{k}: {v!r} is not a numpy dtype") from None
    kw["dtypes"] = dtypes
    if "actions" in kw and not isinstance(kw["actions"], str):
        raise ConfigError("policy.actions: must be the name of the model's action EMIT")
    kw["metadata"] = dict(_mapping(kw.get("metadata"), "policy.metadata"))
    return PolicySpec(**kw)


# ---- small checks ------------------------------------------------------------------------------


def _mapping(raw: Any, where: str) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: must be a mapping (key: value), not {type(raw).__name__}")
    return raw


def _list(raw: Any, where: str) -> list:
    if raw is None:
        return []
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"{where}: must be a list, not {type(raw).__name__}")
    return list(raw)


def _names(raw: Any, where: str) -> list[str]:
    items = _list(raw, where)
    bad = [x for x in items if not isinstance(x, str) or not x]
    if bad:
        raise ConfigError(f"{where}: must be a list of names; {bad!r} are not")
    return items


def _positive_int(raw: Any, where: str) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or raw <= 0:
        raise ConfigError(f"{where}: must be a positive integer, not {raw!r}")
    return raw


def _no_unknown(raw: Mapping[str, Any], where: str, known: Any) -> None:
    unknown = [k for k in raw if k not in known]
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key; the keys here are {sorted(known)}")


# ---- building the model ------------------------------------------------------------------------


def resolve(factory: str, base_dir: str = ".", path: tuple[str, ...] = ()) -> Callable[..., Any]:
    """'package.module:Name' or 'module:Class.method' -> the callable (``path`` entries, relative
    to ``base_dir``, are put on sys.path first)."""
    for p in path:
        full = str((Path(base_dir) / p).resolve())
        if not Path(full).is_dir():
            raise ConfigError(f"model.path: {p!r} ({full}) is not a directory")
        if full not in sys.path:
            sys.path.insert(0, full)
    module_name, attr = factory.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"model.class: cannot import module {module_name!r} ({e}); check the "
                          "name, or add its folder to model.path") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"model.class: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"model.class: {factory!r} is not callable")
    return obj


def build_model(config: ServeConfig) -> Any:
    """Calls the model factory (or loads the checkpoint) and checks the config against the
    model's nodes, walks and engines."""
    from mstar_rt.model import Model

    spec = config.model
    if spec.checkpoint is not None:
        ckpt = Path(config.base_dir) / spec.checkpoint
        if not ckpt.is_dir():
            raise ConfigError(f"model.checkpoint: {str(ckpt)!r} is not a directory")
        from mstar_rt.models.causal_lm import CausalLM

        model = CausalLM.from_pretrained(str(ckpt), **spec.args)
    else:
        fn = resolve(spec.factory or "", config.base_dir, spec.path)
        try:
            model = fn(**spec.args)
        except TypeError as e:
            raise ConfigError(f"model.args: {spec.factory} rejected them: {e}") from None
    if not isinstance(model, Model):
        raise ConfigError(f"model.class: {spec.factory} returned {type(model).__name__}, "
                          "not an mstar_rt.Model")
    check_placement(config, model)
    return model


def check_placement(config: ServeConfig, model: Any) -> None:
    """Every node of a group exists, every walk too, a (node, walk) pair sits on one rank, and a
    rank has one device and one kind (thread or process)."""
    nodes = {n.name for n in model.nodes}
    walks = set(model.walks)
    placed: list[tuple[str, Optional[frozenset], int, str]] = []
    kinds: dict[int, tuple[str, bool]] = {}
    for i, g in enumerate(config.node_groups):
        where = f"node_groups[{i}]"
        unknown = [n for n in g.nodes if n not in nodes]
        if unknown:
            raise ConfigError(f"{where}.nodes: {unknown} are not nodes of the model; its nodes "
                              f"are {sorted(nodes)}")
        bad_walks = [w for w in g.walks or () if w not in walks]
        if bad_walks:
            raise ConfigError(f"{where}.walks: {bad_walks} are not walks of the model; its walks "
                              f"are {sorted(walks)}")
        kind = (g.device, g.process)
        if kinds.setdefault(g.rank, kind) != kind:
            raise ConfigError(f"{where}: rank {g.rank} is already {kinds[g.rank]} (device, "
                              f"process) in an earlier group; one rank has one device and kind")
        mine = None if g.walks is None else frozenset(g.walks)
        for n in g.nodes:
            for other, walks_, rank, at in placed:
                if other == n and rank != g.rank and (mine is None or walks_ is None
                                                      or mine & walks_):
                    raise ConfigError(f"{where}: node {n!r} is already on rank {rank} "
                                      f"({at}); a node runs on one rank per walk")
            placed.append((n, mine, g.rank, where))
    if config.kv_cache:
        kv = [name for name, e in model.engine_specs.items()
              if type(e).__name__ == "KVCacheEngine"]
        if not kv:
            raise ConfigError(f"kv_cache: the model {type(model).__name__} has no KVCacheEngine "
                              "to size; drop the kv_cache section")


def kv_engines(config: ServeConfig, model: Any) -> dict[str, Any]:
    """Fresh KVCacheEngines sized by ``kv_cache`` for every KV engine of the model (keeping its
    other settings), to pass as ``Runtime(model, engines=...)``."""
    if not config.kv_cache:
        return {}
    from mstar_rt.engines.kv_engine import KVCacheEngine

    out = {}
    for name, e in model.engine_specs.items():
        if isinstance(e, KVCacheEngine):
            kw = dict(page_size=e.page_size, num_pages=e.num_pages, max_batch=e.max_batch,
                      max_tokens_per_step=e.max_tokens_per_step,
                      attention_backend=e.attention_backend,
                      num_threads="auto" if e._auto_threads else e.num_threads)
            kw.update(config.kv_cache)
            out[name] = KVCacheEngine(**kw)
    return out


def build_runtime(config: ServeConfig, model: Any) -> Any:
    """The runtime serving ``model`` as the config places it: the in-process
    :class:`~mstar_rt.Runtime` when every rank is a thread, else the multi-process
    :class:`~mstar_rt.placement.PlacedRuntime` (which builds the model in every process from
    ``model.class`` and ``model.args``)."""
    if not any(g.process for g in config.node_groups):
        from mstar_rt.runtime import Runtime

        return Runtime(model, engines=kv_engines(config, model))
    try:
        from mstar_rt.placement import ModelSpec as PlacedSpec
        from mstar_rt.placement import NodeGroup as PlacedGroup
        from mstar_rt.placement import PlacedRuntime
    except ImportError as e:
        raise ConfigError(f"node_groups: 'process: true' needs the placement runtime "
                          f"(mstar_rt.placement: {e}); set process: false to serve every rank "
                          "in this process") from None
    if config.model.factory is None:
        raise ConfigError("node_groups: process ranks build the model in every process from "
                          "model.class; a model.checkpoint is not supported there")
    walky = [i for i, g in enumerate(config.node_groups) if g.walks is not None]
    if walky:
        raise ConfigError(f"node_groups[{walky[0]}].walks: worker processes serve a node in "
                          "every walk; drop 'walks' or keep the group in-process")
    # Workers import the model's module too: hand them model.path through PYTHONPATH.
    extra = [str((Path(config.base_dir) / p).resolve()) for p in config.model.path]
    if extra:
        os.environ["PYTHONPATH"] = os.pathsep.join(
            extra + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    try:
        groups = [PlacedGroup(g.nodes, g.rank, process=g.process, device=g.device)
                  for g in config.node_groups]
        return PlacedRuntime(PlacedSpec(config.model.factory, dict(config.model.args)), groups,
                             engines=kv_engines(config, model))
    except ValueError as e:
        raise ConfigError(f"node_groups: {e}") from None
