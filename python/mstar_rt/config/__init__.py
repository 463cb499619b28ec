"""One config schema for model, node groups, KV cache, serving and placement (pydantic models),
used by ``mstar-rt serve``, ``mstar_rt.placement`` and ``mstar_rt.embed``.

    model:                                  # ModelSpec
      class: "policy:ChunkPolicyModel"      # or factory:  "module:Name", "module:Class.method",
      args: {}                              # or kwargs:   "file.py:Name"; args are JSON data
      path: [../robot]                      # sys.path entries, relative to the config file
      name: robot-policy                    # serving only: the id clients use
    node_groups:                            # NodeGroup
      - {nodes: [mlp], rank: 1, device: cpu, process: true}
    kv_cache: {page_size: 16, num_pages: 1024}          # serving: KVCacheSpec
    server: {host: 127.0.0.1, port: 8000}               # serving: ServerSpec (and the rest of
                                                        # ServeConfig)
    placement: {restart: auto}                          # serving: PlacementOptions

A placement config file has ``model``, ``node_groups`` and the PlacementOptions at top level.
Every error is a :class:`ConfigError` naming the key (``node_groups[1].rank: ...``).
"""

from mstar_rt.config.errors import ConfigError
from mstar_rt.config.model_spec import ModelSpec, resolve_factory
from mstar_rt.config.placement import (NodeGroup, PlacementConfig, PlacementOptions, check_groups,
                                       for_workers, read_placement)
from mstar_rt.config.serving import (KVCacheSpec, PolicySpec, RaySpec, ServeConfig, ServerSpec,
                                     SpeechSpec, load_config)

__all__ = ["ConfigError", "KVCacheSpec", "ModelSpec", "NodeGroup", "PlacementConfig",
           "PlacementOptions", "PolicySpec", "RaySpec", "ServeConfig", "ServerSpec", "SpeechSpec",
           "check_groups", "for_workers", "load_config", "read_placement", "resolve_factory"]
