"""LeRobot's processor pipeline files (``policy_preprocessor.json``,
``policy_postprocessor.json``): their steps, each checked against the steps a family reproduces
-- a step we do not reproduce would make our actions differ from LeRobot's, so it is refused by
name at load rather than ignored."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Union

PathLike = Union[str, "os.PathLike[str]"]


def processor_steps(path: PathLike, name: str, known: frozenset[str]) -> list[Mapping[str, Any]]:
    """The steps of pipeline file ``name`` in checkpoint folder ``path``; a ValueError naming
    the step for one outside ``known``, an enabled relative-actions step or a non-empty
    observation rename map, FileNotFoundError when the file is missing."""
    file = os.path.join(path, name)
    try:
        with open(file) as f:
            steps = json.load(f).get("steps")
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} is missing; LeRobot saves it beside the weights "
                                "(make_pre_post_processors(...) then save_pretrained)") from None
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{file} is not a LeRobot processor file ({e})") from None
    if not isinstance(steps, list) or not all(isinstance(s, Mapping) for s in steps):
        raise ValueError(f"{file} must hold a list of 'steps'")
    for s in steps:
        reg, cfg = s.get("registry_name"), s.get("config") or {}
        if reg not in known:
            raise ValueError(f"{file}: processor step {reg!r} is not one mstar_rt reproduces "
                             f"({sorted(known)}); its actions would differ from LeRobot's")
        if reg in ("relative_actions_processor", "absolute_actions_processor") and \
                cfg.get("enabled"):
            raise ValueError(f"{file}: {reg} is enabled (relative actions); not supported")
        if reg == "rename_observations_processor" and cfg.get("rename_map"):
            raise ValueError(f"{file}: the observation rename map {cfg['rename_map']} is not "
                             "supported; give the images under the policy's own camera names")
    return steps


__all__ = ["processor_steps"]
