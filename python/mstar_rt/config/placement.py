"""Where nodes run: NodeGroup, the placement runtime's options, and the placement config file.

A group is either a worker process (``process: true``, rank >= 1, on ``device``) or a set of
nodes kept in the serving process. Every key a group accepts either takes effect or is refused
with the fix: an in-process group cannot move nodes to a device, build its own model or place a
node per walk, so it refuses ``device`` (other than cpu), ``model_kwargs``, ``walks`` and
``request_inputs: false`` rather than ignore them.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Mapping, Optional, Sequence, Union

from pydantic import Field, field_validator, model_validator

from mstar_rt.config.base import (Count, Device, Flag, JSONData, Names, PositiveInt, Seconds,
                                  Section, read_mapping, validate)
from mstar_rt.config.errors import ConfigError, KeyProblem
from mstar_rt.config.model_spec import ModelSpec


class NodeGroup(Section):
    """``nodes`` run on ``rank``. ``process``: in a worker process of their own (rank 1 and up),
    else in the serving process. ``device``: ``cpu``, ``cuda`` or ``cuda:N`` for a worker (a
    worker on ``cuda:N`` sees only that GPU, as ``cuda:0``). ``model_kwargs`` override the
    ModelSpec's args in that worker. ``request_inputs``: send each request's inputs to the
    worker so ``prepare_inputs`` can read them (turn off to spare a copy of large inputs).
    ``walks``: the walks this placement holds for (a node may sit on other ranks in others).
    ``tp_size``: run the model's LM tensor-parallel over that many processes (gloo on CPU,
    NCCL on CUDA; docs/tensor_parallel.md): the model factory gets ``tp_size`` -- through this
    group's ``model_kwargs`` in a worker process, through ``model.args`` in the serving process
    (see :class:`ModelAndGroups`).
    ``num_cpus``, ``num_gpus``, ``resources``: what the group's Ray actor asks the cluster
    for, with ``launcher: ray`` (docs/placement.md, "Ranks on Ray"); a group on ``cuda`` asks
    for one GPU unless ``num_gpus`` says otherwise. ``tp_resources`` (``launcher: ray``, one
    map per follower rank, ``tp_size - 1`` of them): each tensor-parallel follower runs as a Ray
    actor of its own on the node these custom resources name (with the group's CPUs and GPUs),
    so one model's ranks may sit on several hosts; without it they start beside the driver.

    ``process`` defaults to true here and in the placement config file; the serving config
    defaults it to false (``mstar-rt serve`` runs in one process unless told)."""

    noun: ClassVar[str] = "node group"
    positional_fields: ClassVar[tuple[str, ...]] = ("nodes", "rank")
    nodes: Names
    rank: Count = 0
    walks: Optional[Names] = None
    device: Device = "cpu"
    process: Flag = True
    model_kwargs: JSONData = Field(default_factory=dict)
    request_inputs: Flag = True
    tp_size: PositiveInt = 1
    num_cpus: Optional[float] = None
    num_gpus: Optional[float] = None
    resources: dict[str, float] = Field(default_factory=dict)
    tp_resources: Optional[list[dict[str, float]]] = None

    @field_validator("num_cpus", "num_gpus", mode="before")
    @classmethod
    def _amount(cls, v: Any) -> Any:
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0):
            raise ValueError(f"must be a number >= 0, not {v!r}")
        return v

    @field_validator("resources", mode="before")
    @classmethod
    def _resources(cls, v: Any) -> Any:
        return {} if v is None else _resource_map(v)

    @field_validator("tp_resources", mode="before")
    @classmethod
    def _tp_resources(cls, v: Any) -> Any:
        if v is None:
            return None
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"must list one resource map per follower rank, not {v!r}")
        return [_resource_map(m) for m in v]

    @model_validator(mode="before")
    @classmethod
    def _tp_to_worker(cls, data: Any) -> Any:
        """A worker builds its model with model_kwargs: hand it tp_size there."""
        if not isinstance(data, Mapping) or not data.get("process", True):
            return data
        tp = data.get("tp_size", 1)
        if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 1:
            return data  # 1 (or a bad value, which the field reports)
        kwargs = data.get("model_kwargs") or {}
        if not isinstance(kwargs, Mapping):
            return data
        if kwargs.get("tp_size", tp) != tp:
            raise KeyProblem("tp_size", f"{tp} but model_kwargs.tp_size is "
                             f"{kwargs['tp_size']!r}; give it once")
        return {**data, "model_kwargs": {**kwargs, "tp_size": tp}}

    @field_validator("nodes")
    @classmethod
    def _some_nodes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("list at least one node")
        return v

    def check(self, where: str) -> None:
        """Refuses what this group cannot do, naming ``where`` (e.g. ``node_groups[2]``)."""
        if self.tp_resources is not None and len(self.tp_resources) != self.tp_size - 1:
            raise ConfigError(f"{where}.tp_resources: {len(self.tp_resources)} resource maps "
                              f"for tp_size {self.tp_size}; give one per follower rank "
                              f"({self.tp_size - 1})")
        if self.process:
            if self.rank == 0:
                raise ConfigError(f"{where}.rank: rank 0 is the parent process; give a worker "
                                  "process rank 1 or higher, or set process: false")
            if self.walks is not None:
                raise ConfigError(f"{where}.walks: worker processes serve a node in every walk "
                                  "(a node per walk would move KV pages between processes); "
                                  "drop 'walks'")
            return
        for key in ("num_cpus", "num_gpus", "resources", "tp_resources"):
            if getattr(self, key):
                raise ConfigError(f"{where}.{key}: an in-process group runs in the serving "
                                  "process and asks no cluster for resources; drop it or set "
                                  "process: true")
        if self.walks is not None:
            raise ConfigError(f"{where}.walks: an in-process node runs on its one engine in "
                              "every walk; per-walk placement is not built yet, so 'walks' is "
                              "refused rather than ignored; drop it")
        if self.device != "cpu":
            raise ConfigError(f"{where}.device: an in-process group cannot move its nodes to "
                              f"{self.device!r} (they run where the model put their weights); "
                              "set the device in model.args if the factory takes one, or run "
                              "the group in a worker process (process: true, rank >= 1)")
        if self.model_kwargs:
            raise ConfigError(f"{where}.model_kwargs: only a worker process builds a model of "
                              "its own; drop model_kwargs or set process: true")
        if not self.request_inputs:
            raise ConfigError(f"{where}.request_inputs: an in-process group reads the request's "
                              "inputs without a copy; drop request_inputs or set process: true")


def _resource_map(v: Any) -> dict[str, float]:
    if not isinstance(v, Mapping) or not all(
            isinstance(k, str) and isinstance(n, (int, float)) and not isinstance(n, bool)
            and n >= 0 for k, n in v.items()):
        raise ValueError(f"must map resource names to amounts >= 0, not {v!r}")
    return dict(v)


def check_groups(groups: Any) -> None:
    """NodeGroup.check for each group, named by its index as in the config."""
    for i, g in enumerate(groups):
        g.check(f"node_groups[{i}]")


class PlacementOptions(Section):
    """Settings of the placement runtime (:class:`~mstar_rt.placement.PlacedRuntime`); unset
    ones keep its defaults."""

    shm_bytes: Optional[PositiveInt] = None
    ready_timeout_s: Optional[Seconds] = None
    restart: Optional[str] = None
    max_restarts: Optional[Count] = None
    progress: Optional[Flag] = None
    poll_s: Optional[Seconds] = None
    heartbeat_timeout_s: Optional[Seconds] = None
    node_timeout_s: Optional[Seconds] = None
    launcher: Optional[str] = None
    ray_address: Optional[str] = None
    segments: Optional[Flag] = None
    kv_timeout_s: Optional[Seconds] = None
    # tensors worker to worker (docs/placement.md): ``direct: false`` routes every tensor
    # through the parent; ``direct_bytes`` is the least size that goes directly
    direct: Optional[Flag] = None
    direct_bytes: Optional[PositiveInt] = None
    # how long a receiver watches its mailbox before it sleeps (placement/mailbox.py)
    spin_us: Optional[float] = None

    @field_validator("spin_us", mode="before")
    @classmethod
    def _spin_us(cls, v: Any) -> Optional[float]:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not 0 <= v <= 10_000):
            raise ValueError(f"must be microseconds from 0 (always sleep) to 10000, not {v!r}")
        return v

    @field_validator("launcher")
    @classmethod
    def _launcher(cls, v: Optional[str]) -> Optional[str]:
        if v not in (None, "process", "ray"):
            raise ValueError(f"must be 'process' (local worker processes) or 'ray' (Ray "
                             f"actors), not {v!r}")
        return v

    @field_validator("restart")
    @classmethod
    def _restart(cls, v: Optional[str]) -> Optional[str]:
        if v not in (None, "manual", "auto"):
            raise ValueError(f"must be 'manual' or 'auto', not {v!r}")
        return v

    def given(self) -> dict[str, Any]:
        """The options the config sets, as PlacedRuntime keyword arguments."""
        values = {k: getattr(self, k) for k in PlacementOptions.model_fields}
        given = {k: v for k, v in values.items() if v is not None}
        if given.pop("direct", True) is False:
            given["direct_bytes"] = None  # PlacedRuntime's "off"
        return given

    @model_validator(mode="after")
    def _direct_once(self) -> "PlacementOptions":
        if self.direct is False and self.direct_bytes is not None:
            raise KeyProblem("direct_bytes", "is set with direct: false; give one of them")
        return self


def refuse_tp_args_beside_workers(model: Any, groups: Sequence[Any]) -> None:
    """``model.args.tp_size`` with worker processes (groups as mappings or NodeGroups): the
    parent and every worker built a tensor-parallel group of their own, and a split KV engine
    then failed every request."""
    if isinstance(model, ModelSpec):
        model = model.model_dump(exclude_defaults=True)
    if not isinstance(model, Mapping):
        return
    args = model.get("kwargs" if "kwargs" in model else "args")
    tp = args.get("tp_size") if isinstance(args, Mapping) else None
    workers = any((g.get("process", True) if isinstance(g, Mapping)
                   else getattr(g, "process", True)) is not False for g in groups)
    if type(tp) is int and tp > 1 and workers:
        raise KeyProblem("model", f"args.tp_size {tp} beside worker processes (process: true) "
                         "would make every process build a tensor-parallel group of its own; "
                         "give the LM's node group tp_size instead, and leave it out of args")


class ModelAndGroups(Section):
    """What every deployment config has: the model and where its nodes run. An in-process
    group's ``tp_size`` becomes ``model.args.tp_size`` (the serving process builds the model
    from ``model``); it needs every group in-process, since worker processes build the model
    from the same args and would each start a tensor-parallel group of their own."""

    model: ModelSpec
    node_groups: tuple[NodeGroup, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _tp_to_model(cls, data: Any) -> Any:
        groups = data.get("node_groups") if isinstance(data, Mapping) else None
        if not isinstance(groups, (list, tuple)):
            return data
        raw = [g for g in groups if isinstance(g, Mapping)]
        sizes = {g["tp_size"] for g in raw if g.get("process") is False
                 and type(g.get("tp_size")) is int and g["tp_size"] > 1}
        if not sizes:
            refuse_tp_args_beside_workers(data.get("model"), raw)
            return data
        if len(sizes) > 1:
            raise KeyProblem("node_groups", f"in-process groups ask for tp_size {sorted(sizes)}; "
                             "the serving process builds one model: give them one tp_size")
        if any(g.get("process", True) is not False for g in raw):
            raise KeyProblem("node_groups", "an in-process group with tp_size beside worker "
                             "processes (process: true) is not supported yet: give the LM's "
                             "group process: true and tp_size there, or serve every group "
                             "in-process")
        tp = sizes.pop()
        model = data.get("model")
        if isinstance(model, str):  # the "pkg.mod:Name" shorthand
            model = {"class": model}
        if isinstance(model, ModelSpec):
            model = model.model_dump(exclude_defaults=True)
        if not isinstance(model, Mapping):
            return data  # the model's own checks say what is wrong with it
        key = "kwargs" if "kwargs" in model else "args"
        args = model.get(key) or {}
        if isinstance(args, Mapping):
            if args.get("tp_size", tp) != tp:
                raise KeyProblem("model", f"args.tp_size is {args['tp_size']!r} but "
                                 f"node_groups ask for tp_size {tp}; give it once")
            data = {**data, "model": {**model, key: {**args, "tp_size": tp}}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _model_given(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("model") is None:
            raise KeyProblem("model", "missing; give model: {class: 'package.module:factory', "
                             "args: {...}} or model: {checkpoint: path/to/dir}")
        return data

    @field_validator("node_groups", mode="before")
    @classmethod
    def _a_list(cls, v: Any) -> Any:
        if v is None:
            return ()
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"must be a list of node groups, not {type(v).__name__}")
        return v


class PlacementConfig(ModelAndGroups, PlacementOptions):
    """The placement config file: ``model``, ``node_groups`` and the PlacementOptions."""


def for_workers(spec: ModelSpec, base_dir: str) -> ModelSpec:
    """``spec`` as worker processes can build it: its ``path`` folders absolute and on
    PYTHONPATH (workers are fresh interpreters), and no checkpoint."""
    if spec.checkpoint is not None:
        raise ConfigError("model.checkpoint: worker processes (process: true) build the model "
                          "from model.class; a checkpoint is not supported there")
    folders = spec.search_path(base_dir)
    if folders:
        old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join(folders + [p for p in old if p not in folders])
    factory = spec.factory
    module, _, attr = (factory or "").rpartition(":")
    if (module.endswith(".py") or "/" in module) and not os.path.isabs(module):
        # a model file beside the config: the parent and the workers build it from anywhere
        factory = f"{os.path.abspath(os.path.join(base_dir, module))}:{attr}"
    return spec.model_copy(update={"path": tuple(folders), "factory": factory})


def read_placement(source: Union[str, os.PathLike, Mapping[str, Any]],
                   base_dir: Optional[str] = None) -> dict[str, Any]:
    """PlacedRuntime keyword arguments from a placement config (YAML file or mapping)."""
    raw, base = read_mapping(source, base_dir)
    config: PlacementConfig = validate(PlacementConfig, raw)
    check_groups(config.node_groups)
    model = raw.get("model")
    if isinstance(model, Mapping) and "name" in model:
        raise ConfigError("model.name: a placement config serves no clients; drop 'name' (it "
                          "is the id of a served model, see docs/serving.md)")
    return {**config.given(), "model": for_workers(config.model, base),
            "node_groups": list(config.node_groups)}
