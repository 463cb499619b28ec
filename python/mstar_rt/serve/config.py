"""The serving config (:mod:`mstar_rt.config`), turned into a model and a runtime for
``mstar-rt serve``: the model's factory is called, the node groups are checked against the
model's nodes, walks and engines, and the runtime is the in-process Runtime or, with any
``process: true`` group, the placement runtime."""

from __future__ import annotations

from typing import Any, Optional

from mstar_rt.config import (ConfigError, KVCacheSpec, ModelSpec, NodeGroup, PolicySpec,
                             RaySpec, ServeConfig, ServerSpec, SpeechSpec, check_groups,
                             for_workers, load_config)

__all__ = ["ConfigError", "KVCacheSpec", "ModelSpec", "NodeGroup", "PolicySpec", "RaySpec",
           "ServeConfig", "ServerSpec", "SpeechSpec", "build_model", "build_runtime",
           "check_placement", "kv_engines", "load_config"]


def build_model(config: ServeConfig) -> Any:
    """Calls the model factory (or loads the checkpoint) and checks the config against the
    model's nodes, walks and engines."""
    try:
        model = config.model.build(base_dir=config.base_dir)
    except Exception as e:  # the group's tp_size reached the model as an arg the user never wrote
        tp = [i for i, g in enumerate(config.node_groups) if g.tp_size > 1 and not g.process]
        if not (tp and "tp_size" in str(e)):
            raise
        raise ConfigError(f"node_groups[{tp[0]}].tp_size: {config.node_groups[tp[0]].tp_size} "
                          "needs a model that runs tensor-parallel (the Llama family), and this "
                          f"one takes no tp_size ({type(e).__name__}: {e}); drop tp_size") from None
    check_placement(config, model)
    return model


def check_placement(config: ServeConfig, model: Any) -> None:
    """Every node of a group exists, every walk too, a (node, walk) pair sits on one rank, a
    rank has one device and one kind (thread or process), and kv_cache has a KV engine to size."""
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
    kv = [e for e in model.engine_specs.values() if type(e).__name__ == "KVCacheEngine"]
    if config.kv_cache.sizes() and not kv:
        raise ConfigError(f"kv_cache: the model {type(model).__name__} has no KVCacheEngine "
                          "to size; drop the kv_cache section")


def kv_engines(config: ServeConfig, model: Any) -> dict[str, Any]:
    """Fresh KVCacheEngines sized by ``kv_cache`` for every KV engine of the model (keeping its
    other settings), to pass as ``Runtime(model, engines=...)``."""
    sizes = config.kv_cache.sizes()
    if not sizes:
        return {}
    from mstar_rt.engines.kv_engine import KVCacheEngine

    out = {}
    for name, e in model.engine_specs.items():
        if isinstance(e, KVCacheEngine):
            kw = dict(page_size=e.page_size, num_pages=e.num_pages, max_batch=e.max_batch,
                      max_tokens_per_step=e.max_tokens_per_step,
                      attention_backend=e.attention_backend,
                      num_threads="auto" if e.auto_threads else e.num_threads)
            out[name] = KVCacheEngine(**{**kw, **sizes})
    return out


def build_runtime(config: ServeConfig, model: Any) -> Any:
    """The runtime serving ``model`` as the config places it: the in-process
    :class:`~mstar_rt.Runtime` when every group is in-process, else the multi-process
    :class:`~mstar_rt.placement.PlacedRuntime` (which builds the model in every process from
    ``model.class`` and ``model.args``). A group that cannot run as written is refused."""
    check_groups(config.node_groups)
    if not any(g.process for g in config.node_groups):
        from mstar_rt.runtime import Runtime

        return Runtime(model, engines=kv_engines(config, model))
    try:
        from mstar_rt.placement import PlacedRuntime
    except ImportError as e:
        raise ConfigError(f"node_groups: 'process: true' needs the placement runtime "
                          f"(mstar_rt.placement: {e}); set process: false to serve every rank "
                          "in this process") from None
    spec = for_workers(config.model, config.base_dir)
    try:
        rt = PlacedRuntime(spec, list(config.node_groups), engines=kv_engines(config, model),
                           **config.placement.given())
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"node_groups: {e}") from None
    # Its operator has no Python prompt to call restart_worker from.
    rt.restart_hint = ("restart the server, or set 'placement: {{restart: auto}}' in its config "
                       "for worker {rank} and the others to be restarted on their own")
    return rt
