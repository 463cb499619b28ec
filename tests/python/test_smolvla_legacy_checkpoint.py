"""A SmolVLA checkpoint saved before LeRobot had processor pipelines (the first
``lerobot/smolvla_base``) keeps its dataset statistics as buffers in ``model.safetensors``
(``normalize_inputs.buffer_observation_state.mean``, ``unnormalize_outputs.buffer_action.std``,
...) and has no ``policy_*processor.json``. The loader reads them as LeRobot 0.6.1's migration
script (``migrate_policy_normalization.py``) turns them into normalizer states, so the chunk
equals the fixture's (made from the same statistics in processor files); with processor files
present the buffers are skipped, as LeRobot 0.6.1 skips them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar_rt.engines import KVCacheEngine
from mstar_rt.models.smolvla import SmolVLAPolicy
from mstar_rt.models.smolvla_checkpoint import load_lerobot_smolvla
from mstar_rt.models.smolvla_reference import sample_actions_reference

from walk_models import ZERO_LIVE, settled

FIXTURE = Path(__file__).resolve().parents[1] / "reference" / "fixtures" / "smolvla"
VLM = str(FIXTURE / "smolvlm_tiny")
TOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

#: The old layout: module -> feature whose mean / std it held.
BUFFERS = {"normalize_inputs": "observation.state", "normalize_targets": "action",
           "unnormalize_outputs": "action"}


@pytest.fixture(scope="module")
def io() -> dict:
    return load_file(str(FIXTURE / "io.safetensors"))


def inputs(io: dict) -> dict:
    meta = json.loads((FIXTURE / "io.json").read_text())
    return {"images": {k: io[f"input.{k}"] for k in meta["cameras_in_order"]},
            "state": io["input.observation.state"], "task": meta["prompt"],
            "noise": io["input.noise"]}


def legacy_checkpoint(path: Path, io: dict, keep_processors: bool = False,
                      value=None) -> Path:
    """The fixture's checkpoint in the old layout: the statistics as weights buffers
    (``value(feature, stat)`` instead of the fixture's when given)."""
    shutil.copytree(FIXTURE / "checkpoint", path)
    if not keep_processors:
        for f in path.glob("policy_*processor*"):
            f.unlink()
    weights = load_file(str(path / "model.safetensors"))
    for module, feature in BUFFERS.items():
        for stat in ("mean", "std"):
            v = io[f"stats.{feature}.{stat}"] if value is None else value(feature, stat)
            weights[f"{module}.buffer_{feature.replace('.', '_')}.{stat}"] = v.clone()
    save_file(weights, str(path / "model.safetensors"))
    return path


def max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().reshape(want.shape) - want.float()).abs().max())


def test_in_weights_statistics_give_lerobots_chunk_direct_and_served(tmp_path, io, serve):
    policy = load_lerobot_smolvla(legacy_checkpoint(tmp_path / "ckpt", io), vlm_dir=VLM,
                                  progress=False)
    for norm, feature in ((policy.state_normalizer, "observation.state"),
                          (policy.action_normalizer, "action")):
        assert norm.mode == "MEAN_STD" and norm.eps == 1e-8
        assert all(torch.equal(norm.stats[s], io[f"stats.{feature}.{s}"]) for s in ("mean", "std"))
    assert not any("normalize" in k for k in policy.module.state_dict())
    want = io["output.action_chunk"]
    assert max_diff(sample_actions_reference(policy, inputs(io)), want) <= TOL
    rt = serve(SmolVLAPolicy(policy, engine=KVCacheEngine(page_size=16, num_pages=16)))
    assert max_diff(rt.submit(inputs(io)).result(timeout=60)["actions"][0], want) <= TOL
    assert settled(rt) == ZERO_LIVE


def test_processor_files_win_over_in_weights_buffers(tmp_path, io):
    path = legacy_checkpoint(tmp_path / "ckpt", io, keep_processors=True,
                             value=lambda feature, stat: torch.full((6,), 123.0))
    policy = load_lerobot_smolvla(path, vlm_dir=VLM, progress=False)
    assert torch.equal(policy.state_normalizer.stats["mean"], io["stats.observation.state.mean"])
    assert max_diff(sample_actions_reference(policy, inputs(io)), io["output.action_chunk"]) <= TOL


def test_statistics_never_set_are_refused_naming_the_buffer(tmp_path, io):
    path = legacy_checkpoint(tmp_path / "ckpt", io,
                             value=lambda feature, stat: torch.full((6,), float("inf")))
    with pytest.raises(ValueError, match=r"normalize_inputs\.buffer_observation_state\..*NaN or "
                                         "infinite.*with its dataset's statistics"):
        load_lerobot_smolvla(path, vlm_dir=VLM, progress=False)


def test_buffers_of_the_wrong_size_are_refused(tmp_path, io):
    def value(feature: str, stat: str) -> torch.Tensor:
        return torch.zeros(4 if feature == "action" else 6)

    path = legacy_checkpoint(tmp_path / "ckpt", io, value=value)
    words = r"\[4\], but config.json gives 'action' 6 values .*unnormalize_outputs\.buffer_action"
    with pytest.raises(ValueError, match=words):
        load_lerobot_smolvla(path, vlm_dir=VLM, progress=False)
