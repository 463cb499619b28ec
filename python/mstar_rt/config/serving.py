"""The serving config (``mstar-rt serve CONFIG``): the model, where its nodes run, the KV cache,
the limits, the server, how speech and policy requests map onto the model, and Ray Serve
replicas."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, ClassVar, Mapping, Optional, Union

from pydantic import BeforeValidator, Field, PrivateAttr, field_validator, model_validator

from mstar_rt.config.base import (Count, JSONData, KeyValues, Name, Names, PositiveInt, Seconds,
                                  Section, read_mapping, validate)
from mstar_rt.config.errors import KeyProblem
from mstar_rt.config.placement import ModelAndGroups, PlacementOptions


class KVCacheSpec(Section):
    """Sizes for every KVCacheEngine of the model (unset ones keep the model's)."""

    noun: ClassVar[str] = "kv_cache"
    page_size: Optional[PositiveInt] = None
    num_pages: Optional[PositiveInt] = None
    max_batch: Optional[PositiveInt] = None
    max_tokens_per_step: Optional[PositiveInt] = None

    def sizes(self) -> dict[str, int]:
        """The sizes the config sets, as KVCacheEngine keyword arguments."""
        values = {k: getattr(self, k) for k in type(self).model_fields}
        return {k: v for k, v in values.items() if v is not None}


class ServerSpec(Section):
    """Where the server listens; ``api_key`` (or ``api_key_env``, the environment variable
    holding it, read when the config is loaded) is required of every client when set."""

    noun: ClassVar[str] = "server"
    extra_keys: ClassVar[tuple[str, ...]] = ("api_key_env",)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _key_from_env(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or "api_key_env" not in data:
            return data
        data = dict(data)
        env = data.pop("api_key_env")
        if data.get("api_key") is not None:
            raise ValueError("give api_key or api_key_env, not both")
        if not isinstance(env, str) or not os.environ.get(env):
            raise KeyProblem("api_key_env", f"environment variable {env!r} is not set (or "
                             "empty); export it or drop the key")
        return {**data, "api_key": os.environ[env]}

    @field_validator("host", mode="before")
    @classmethod
    def _host(cls, v: Any) -> Any:
        if not isinstance(v, str) or not v:
            raise ValueError(f"must be a host name or address, not {v!r}")
        return v

    @field_validator("port", mode="before")
    @classmethod
    def _port(cls, v: Any) -> Any:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 65535:
            raise ValueError(f"must be an integer in 0..65535 (0 = any free port), not {v!r}")
        return v

    @field_validator("api_key", mode="before")
    @classmethod
    def _key(cls, v: Any) -> Any:
        if v is not None and (not isinstance(v, str) or not v):
            raise ValueError("must be a non-empty string")
        return v

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class SpeechSpec(Section):
    """How ``/v1/audio/speech`` drives the model: the text and voice inputs, the EMIT carrying
    float32 audio at ``model_rate`` (default: the model's ``sample_rate``), the voices accepted
    (default: the model's ``voices``; empty = any), extra ``inputs`` every request gets, and
    the rate of the returned PCM (OpenAI's ``pcm`` is 24 kHz; audio is resampled to it)."""

    noun: ClassVar[str] = "speech"
    text_input: Name = "text"
    voice_input: Optional[Name] = "voice"
    audio_output: Name = "audio"
    voices: Optional[Names] = None
    model_rate: Optional[PositiveInt] = None
    output_rate: PositiveInt = 24000
    inputs: KeyValues = Field(default_factory=dict)


def _str_map(v: Any) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError(f"must be a mapping (key: value), not {type(v).__name__}")
    for k, x in v.items():
        if not isinstance(k, str) or not isinstance(x, str):
            raise ValueError(f"must map strings to strings ({k!r}: {x!r})")
    return dict(v)


class PolicySpec(Section):
    """How the openpi websocket drives the model: ``observation`` maps observation keys to model
    inputs (empty: keys named like the inputs), ``images`` are observation keys that may arrive
    as encoded bytes (JPEG/PNG), ``shapes`` / ``dtypes`` check and cast inputs by model input
    name (``null`` in a shape = any size; dtype ``str`` = text, e.g. an instruction),
    ``actions`` is the EMIT returned as ``actions``, ``outputs`` maps further EMITs to reply
    keys, ``metadata`` is sent on connect. A target ``input/key`` puts the value under ``key``
    of a dict input (a LeRobot policy's cameras).
    ``optional`` observation keys may be left out (the model's default applies), e.g. the
    previous chunk's left-over actions that ask for real-time chunking."""

    noun: ClassVar[str] = "policy"
    observation: dict[str, str] = Field(default_factory=dict)
    images: Names = ()
    optional: Names = ()
    shapes: dict[str, tuple[Optional[int], ...]] = Field(default_factory=dict)
    dtypes: dict[str, str] = Field(default_factory=dict)
    actions: str = "actions"
    outputs: dict[str, str] = Field(default_factory=dict)
    metadata: KeyValues = Field(default_factory=dict)

    @field_validator("observation", "outputs", "dtypes", mode="before")
    @classmethod
    def _str_maps(cls, v: Any) -> dict[str, str]:
        return _str_map(v)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:  # sent to every client on connect (msgpack): YAML's dates and the like cannot go
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"must be plain data (numbers, strings, lists, mappings); {e} "
                             "(quote a date: '2024-01-01')") from None
        return v

    @field_validator("shapes", mode="before")
    @classmethod
    def _shapes(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, Mapping):
            raise ValueError(f"must be a mapping of input name: [sizes], not {type(v).__name__}")
        out = {}
        for k, shape in (v or {}).items():
            if not isinstance(shape, (list, tuple)) or not all(
                    d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 0)
                    for d in shape):
                raise KeyProblem(str(k), f"must be a list of sizes (null = any), not {shape!r}")
            out[k] = tuple(shape)
        return out

    @field_validator("dtypes")
    @classmethod
    def _dtypes(cls, v: dict[str, str]) -> dict[str, str]:
        import numpy as np

        for k, dtype in v.items():
            try:
                np.dtype(dtype)
            except TypeError:
                raise KeyProblem(k, f"{dtype!r} is not a numpy dtype") from None
        return v

    @field_validator("actions", mode="before")
    @classmethod
    def _actions(cls, v: Any) -> Any:
        if not isinstance(v, str) or not v:
            raise ValueError("must be the name of the model's action EMIT")
        return v


def _cpus(v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
        raise ValueError(f"must be a number >= 0 (a fraction shares a CPU or GPU), not {v!r}")
    return float(v)


class RaySpec(Section):
    """Replicas of the server as a Ray Serve deployment (``mstar-rt serve CONFIG --replicas N``,
    or this section): ``replicas`` fixed, or ``min_replicas``..``max_replicas`` scaled on
    ``target_ongoing_requests`` per replica; each replica reserves ``num_cpus`` / ``num_gpus``
    and the custom ``resources``. ``address``: the cluster (``auto``, ``host:port``; default
    ``RAY_ADDRESS``, else a local cluster started for this server). ``proxy_location``: where
    Ray Serve's HTTP proxy listens on ``server.host:port``. ``max_ongoing_requests``
    (default ``max_concurrent_requests``) bounds what Ray routes to one replica; an open policy
    websocket counts as one for as long as it is open."""

    noun: ClassVar[str] = "ray"
    replicas: Optional[PositiveInt] = None
    min_replicas: Optional[Count] = None
    max_replicas: Optional[PositiveInt] = None
    target_ongoing_requests: Optional[Seconds] = None
    num_cpus: Annotated[float, BeforeValidator(_cpus)] = 1.0
    num_gpus: Annotated[float, BeforeValidator(_cpus)] = 0.0
    resources: dict[str, Annotated[float, BeforeValidator(_cpus)]] = Field(default_factory=dict)
    address: Optional[Name] = None
    proxy_location: str = "HeadOnly"
    app_name: Name = "mstar"
    max_ongoing_requests: Optional[PositiveInt] = None
    health_check_period_s: Optional[Seconds] = None
    runtime_env: JSONData = Field(default_factory=dict)

    @field_validator("proxy_location")
    @classmethod
    def _proxy(cls, v: str) -> str:
        if v not in ("HeadOnly", "EveryNode"):
            raise ValueError(f"must be HeadOnly (one proxy, on the head node) or EveryNode (one "
                             f"per node, each on server.port, behind your load balancer), not "
                             f"{v!r}")
        return v

    @model_validator(mode="after")
    def _replicas_or_bounds(self) -> "RaySpec":
        bounds = self.min_replicas is not None or self.max_replicas is not None
        if self.replicas is not None and bounds:
            raise ValueError("give replicas (a fixed count) or min_replicas/max_replicas "
                             "(autoscaling), not both")
        if bounds and self.max_replicas is None:
            raise KeyProblem("max_replicas", "missing; autoscaling needs an upper bound")
        if bounds and (self.min_replicas or 0) > (self.max_replicas or 0):
            raise KeyProblem("min_replicas", f"{self.min_replicas} is above max_replicas "
                             f"{self.max_replicas}")
        if self.target_ongoing_requests is not None and not bounds:
            raise KeyProblem("target_ongoing_requests", "only autoscaling uses it; give "
                             "min_replicas and max_replicas, or drop it")
        return self

    def with_replicas(self, replicas: Optional[int]) -> "RaySpec":
        """A copy with a fixed ``replicas`` count (``--replicas N``), dropping any bounds."""
        if replicas is None:
            return self
        return validate(RaySpec, {**self.model_dump(exclude_defaults=True),
                                  "min_replicas": None, "max_replicas": None,
                                  "target_ongoing_requests": None, "replicas": replicas},
                        "--replicas")

    @property
    def autoscaling(self) -> Optional[dict[str, Any]]:
        """Ray Serve's ``autoscaling_config``, or None for a fixed count."""
        if self.max_replicas is None:
            return None
        out: dict[str, Any] = {"min_replicas": self.min_replicas or 0,
                               "max_replicas": self.max_replicas}
        if self.target_ongoing_requests is not None:
            out["target_ongoing_requests"] = self.target_ongoing_requests
        return out


class ServeConfig(ModelAndGroups):
    """The whole serving config. ``base_dir`` is where its relative paths start: the config
    file's folder (or the directory given to :func:`load_config`)."""

    kv_cache: KVCacheSpec = Field(default_factory=KVCacheSpec)
    max_concurrent_requests: PositiveInt = 64
    request_timeout_s: Optional[Seconds] = None
    server: ServerSpec = Field(default_factory=ServerSpec)
    speech: Optional[SpeechSpec] = None
    policy: Optional[PolicySpec] = None
    placement: PlacementOptions = Field(default_factory=PlacementOptions)
    ray: Optional[RaySpec] = None
    _base_dir: str = PrivateAttr(".")

    @model_validator(mode="before")
    @classmethod
    def _groups_in_process(cls, data: Any) -> Any:
        for key in ("speech", "policy", "ray"):  # YAML reads a bare "ray:" as null
            if isinstance(data, Mapping) and key in data and data[key] is None:
                raise KeyProblem(key, "is empty, which would leave the section out; write "
                                      f"'{key}: {{}}' for its defaults, or remove the line")
        groups = data.get("node_groups") if isinstance(data, Mapping) else None
        if isinstance(groups, (list, tuple)):
            data = {**data, "node_groups": [{"process": False, **g} if isinstance(g, Mapping)
                                            else g for g in groups]}
        return data

    @model_validator(mode="after")
    def _checkpoint_not_in_workers(self) -> "ServeConfig":
        # for_workers refuses it too, but only once the checkpoint has loaded (minutes)
        if self.model.checkpoint is not None and any(g.process for g in self.node_groups):
            raise ValueError("model.checkpoint: worker processes (process: true) build the "
                             "model from model.class; a checkpoint is not supported there")
        return self

    @property
    def base_dir(self) -> str:
        return self._base_dir

    @property
    def ranks(self) -> dict[int, dict[str, Any]]:
        """rank -> {device, process}: the workers a placement runtime starts."""
        return {g.rank: dict(device=g.device, process=g.process) for g in self.node_groups}

    def with_server(self, **changes: Any) -> "ServeConfig":
        """A copy whose server section has ``changes`` (None values are left out), checked."""
        server = {**self.server.model_dump(), **{k: v for k, v in changes.items()
                                                 if v is not None}}
        out = self.model_copy(update={"server": validate(ServerSpec, server, "server")})
        out._base_dir = self._base_dir
        return out


def load_config(source: Union[str, os.PathLike, Mapping[str, Any]],
                base_dir: Optional[str] = None) -> ServeConfig:
    """Reads a YAML file (or takes a parsed mapping) and checks every key."""
    raw, base = read_mapping(source, base_dir)
    config: ServeConfig = validate(ServeConfig, raw)
    config._base_dir = base
    return config
