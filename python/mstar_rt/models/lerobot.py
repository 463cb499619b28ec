"""LeRobot policy checkpoint directories: which family a directory holds, loading it as the
matching walk model, and how the openpi websocket maps a robot's observation onto it.

A LeRobot directory (``save_pretrained``: ``config.json`` with ``"type"``, ``model.safetensors``,
the processor files) is recognised by its ``type``: ``pi0`` / ``pi05``
(:class:`~mstar_rt.models.lerobot_pi0.LeRobotPi0Policy`) or ``smolvla``
(:class:`~mstar_rt.models.smolvla.SmolVLAPolicy`). ``mstar-rt serve`` with
``model: {checkpoint: DIR}`` loads it this way and serves it on the openpi websocket with
:func:`openpi_defaults` unless the config's ``policy`` section says otherwise.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

FAMILIES = ("pi0", "pi05", "smolvla")
PathLike = Union[str, "os.PathLike[str]"]


def lerobot_family(path: PathLike) -> Optional[str]:
    """The family of the LeRobot policy directory at ``path`` ("pi0", "pi05", "smolvla"), or None
    when it is not one (no ``config.json``, or another ``type``)."""
    try:
        with open(os.path.join(os.fspath(path), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    family = config.get("type") if isinstance(config, dict) else None
    return family if family in FAMILIES else None


def load_lerobot_policy(path: PathLike, **kwargs: Any) -> Any:
    """The walk model serving the LeRobot policy directory at ``path``. ``kwargs`` go to the
    family's loader and model (e.g. ``tokenizer``, ``dtype``, ``device``, ``max_batch``; for
    SmolVLA ``vlm_dir``)."""
    family = lerobot_family(path)
    if family in ("pi0", "pi05"):
        from mstar_rt.models.lerobot_pi0 import LeRobotPi0Policy

        return LeRobotPi0Policy.from_pretrained(path, **kwargs)
    if family == "smolvla":
        from mstar_rt.models.smolvla import SmolVLAPolicy
        from mstar_rt.models.smolvla_checkpoint import load_lerobot_smolvla

        load = {k: kwargs.pop(k) for k in ("dtype", "device", "vlm_dir", "progress")
                if k in kwargs}
        return SmolVLAPolicy(load_lerobot_smolvla(path, **load), **kwargs)
    raise ValueError(f"{os.fspath(path)} is not a LeRobot policy directory of a family served "
                     f"here ({', '.join(FAMILIES)}): its config.json has no such 'type'")


def openpi_defaults(config: Any, family: str, rtc: Any = None,
                    text_task: bool = True) -> dict[str, Any]:
    """The openpi websocket's mapping for a LeRobot policy (a PolicySpec's fields): the
    observation keys are LeRobot's own -- each camera key (an image: an array, or JPEG/PNG
    bytes) into the ``images`` input, ``observation.state`` into ``state``, ``task`` (the
    instruction) into ``task`` -- and the reply's ``actions`` are the unnormalised chunk.

    Real-time chunking over the socket: a client may add ``prev_actions`` (the previous reply's
    actions not yet executed, ``[N, action_dim]``, as they were sent) and ``inference_delay``
    (the actions it will execute while this chunk is computed); the server guides the new
    chunk as LeRobot's ``predict_action_chunk(inference_delay=, prev_chunk_left_over=)`` does
    with ``rtc`` (the model's guidance settings: the checkpoint's ``rtc_config``, else LeRobot's
    defaults; the metadata gives them). Without them a chunk is plain; with them on a model
    whose guidance is disabled the request is refused by name.

    Each chunk starts from fresh noise, as LeRobot's and openpi's do; a client that wants a
    chunk reproduced gives ``seed`` (an integer) or ``noise`` itself (``[chunk_size,
    max_action_dim]``, float32)."""
    observation = {cam: f"images/{cam}" for cam in config.cameras}
    observation.update({"observation.state": "state", "task": "task",
                        "prev_actions": "prev_actions", "inference_delay": "delay",
                        "seed": "seed", "noise": "noise"})
    return {"observation": observation, "images": tuple(config.cameras),
            # any camera may be missing (LeRobot masks it out; one at least is asked for)
            "optional": (*config.cameras, "prev_actions", "inference_delay", "seed", "noise"),
            "shapes": {"state": (config.state_dim,), "prev_actions": (None, config.action_dim),
                       "noise": (config.chunk_size, config.max_action_dim)},
            # the task as text (a SmolVLA without a tokenizer takes token ids instead)
            "dtypes": {"state": "float32", "prev_actions": "float32", "noise": "float32",
                       **({"task": "str"} if text_task else {})},
            "actions": "actions",
            "metadata": {"policy": family, "cameras": list(config.cameras),
                         "state_dim": config.state_dim, "action_dim": config.action_dim,
                         "action_horizon": config.chunk_size,
                         "rtc": None if rtc is None or not rtc.enabled else
                         {"schedule": rtc.schedule, "execution_horizon": rtc.execution_horizon,
                          "max_guidance_weight": rtc.max_guidance_weight}}}
