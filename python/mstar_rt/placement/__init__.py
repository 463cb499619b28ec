"""Placement: run node groups of a model in worker processes, without changing the model.

    from mstar_rt.placement import NodeGroup, PlacedRuntime

    with PlacedRuntime("my_pkg.models:build_policy",
                       node_groups=[NodeGroup(["vision"], rank=1),
                                    NodeGroup(["backbone", "action_head"], rank=2)],
                       model_kwargs={"size": "small"}) as rt:
        actions = rt.submit({"image": img, "state": q}).result()["actions"]

Control messages travel over ZeroMQ, tensors through shared memory, nothing is pickled. See
docs/placement.md.
"""

from mstar_rt.placement.codec import CodecError, register_type
from mstar_rt.placement.config import ModelSpec, NodeGroup, read_config
from mstar_rt.placement.link import WorkerStartError
from mstar_rt.placement.runtime import PlacedRuntime

__all__ = ["CodecError", "ModelSpec", "NodeGroup", "PlacedRuntime", "WorkerStartError",
           "read_config", "register_type"]
