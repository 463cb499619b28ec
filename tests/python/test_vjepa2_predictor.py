"""The V-JEPA 2-AC predictor equals upstream's ``VisionTransformerPredictorAC`` (cc-vjepa2, an
MIT fork whose ac_predictor.py is upstream's) on the same random weights for several small
configs, loads its state dict under the same key names, builds the full-size published
predictor on the meta device with exactly the reference's parameters, and updates poses as
upstream's planner does.

The reference runs live: ``pip install --no-deps cc-vjepa2==0.0.3`` (it imports timm only for
``drop_path``, which is the identity at inference; a stand-in module replaces timm if absent).
"""

from __future__ import annotations

import math
import sys
import types
from contextlib import contextmanager

import pytest
import torch

from mstar_rt.models.vjepa2_predictor import (VJEPA2ACConfig, VJEPA2ACPredictor,
                                              euler_to_matrix, matrix_to_euler, next_pose,
                                              random_vjepa2_predictor)

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),  # conftest.py
              # upstream's attention still enters torch's deprecated sdp_kernel() context
              pytest.mark.filterwarnings("ignore:.*sdp_kernel:FutureWarning")]

TOL = 1e-4
#: Small configs: depth 2, widths 32-64, patch grids 2x2 .. 4x4, and upstream's options.
CONFIGS = {
    "grid2x2": dict(img_size=(32, 32), embed_dim=32, predictor_embed_dim=48, num_heads=2),
    "grid3x3": dict(img_size=(48, 48), embed_dim=40, predictor_embed_dim=64, num_heads=4),
    "grid4x4_swiglu": dict(img_size=(64, 64), embed_dim=64, predictor_embed_dim=64,
                           num_heads=2, use_silu=True),
    "grid4x3_extrinsics_odd_head": dict(img_size=(64, 48), embed_dim=32,
                                        predictor_embed_dim=60, num_heads=4,
                                        use_extrinsics=True),
    "no_rope": dict(img_size=(48, 32), embed_dim=48, predictor_embed_dim=48, num_heads=4,
                    use_rope=False),
}


def _stand_in_timm() -> None:
    """cc-vjepa2 imports ``timm.models.layers.drop_path`` (identity unless training with a
    drop rate); without timm (which needs torchvision) a module with that function does."""
    try:
        from timm.models.layers import drop_path  # noqa: F401
        return
    except ImportError:
        pass

    def identity(x, drop_prob=0.0, training=False):
        if drop_prob and training:
            raise NotImplementedError("the timm stand-in does not drop paths")
        return x

    timm, models, layers = (types.ModuleType(n) for n in
                            ("timm", "timm.models", "timm.models.layers"))
    layers.drop_path = identity
    timm.models, models.layers = models, layers
    sys.modules.update({"timm": timm, "timm.models": models, "timm.models.layers": layers})


def reference():
    """cc-vjepa2's ``vjepa2.models`` package (skips the test without it)."""
    pytest.importorskip("vjepa2", reason="the reference: pip install --no-deps cc-vjepa2==0.0.3")
    pytest.importorskip("einops")
    _stand_in_timm()
    import vjepa2.models.ac_predictor as ac
    import vjepa2.models.vision_transformer as vit

    return types.SimpleNamespace(ac=ac, vit=vit)


def tiny_config(**fields) -> VJEPA2ACConfig:
    return VJEPA2ACConfig(**{"patch_size": 16, "num_frames": 16, "depth": 2, **fields})


def upstream_predictor(config: VJEPA2ACConfig, seed: int = 0, std: float = 0.2):
    """Upstream's predictor for ``config`` with every parameter random (normal, ``std``),
    and ours holding the same weights (loaded by key name, strictly)."""
    ref = reference()
    assert (config.mlp_ratio, config.qkv_bias, config.layer_norm_eps) == (4.0, True, 1e-6)
    fields = {k: v for k, v in config.to_dict().items()  # vit_ac_predictor fixes the rest
              if k not in ("model_type", "mlp_ratio", "qkv_bias", "layer_norm_eps",
                           "normalize_reps")}
    torch.manual_seed(seed)
    up = ref.ac.vit_ac_predictor(**fields).eval()
    with torch.no_grad():
        for p in up.parameters():
            p.normal_(0, std)
    ours = VJEPA2ACPredictor(config).eval()
    ours.load_state_dict(up.state_dict(), strict=True)
    return up, ours


@pytest.mark.parametrize("frames", [2, 3, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_equals_upstream_predictor(name, frames):
    config = tiny_config(**CONFIGS[name])
    up, ours = upstream_predictor(config, seed=frames)
    g = torch.Generator().manual_seed(frames)
    b, n = 2, config.num_patches
    x = torch.randn(b, frames * n, config.embed_dim, generator=g)
    actions, states = torch.randn(b, frames, 7, generator=g), torch.randn(b, frames, 7, generator=g)
    extrinsics = torch.randn(b, frames, 6, generator=g) if config.use_extrinsics else None
    with torch.no_grad():
        want = up(x, actions, states, extrinsics)
        got = ours.forward_frames(x, actions, states, extrinsics)
    assert got.shape == want.shape == (b, frames * n, config.embed_dim)
    assert want.abs().max() > 0.5  # the weights make the comparison meaningful
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_the_action_changes_only_its_own_and_later_frames():
    config = tiny_config(**CONFIGS["grid2x2"])
    _, ours = upstream_predictor(config)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3 * config.num_patches, config.embed_dim, generator=g)
    actions, states = torch.randn(1, 3, 7, generator=g), torch.randn(1, 3, 7, generator=g)
    moved = actions.clone()
    moved[0, 1] += 1.0
    with torch.no_grad():
        a, b = ours.forward_frames(x, actions, states), ours.forward_frames(x, moved, states)
    n = config.num_patches
    assert torch.equal(a[:, :n], b[:, :n])                # frame 0 does not see action 1
    assert not torch.allclose(a[:, n:], b[:, n:])         # frames 1 and 2 do


@contextmanager
def upstream_on_meta(monkeypatch):
    """Upstream's constructors call ``.item()`` on a ``linspace`` (the drop-path schedule),
    which a meta tensor cannot give: that one call runs on the CPU, everything else on meta."""
    real = torch.linspace
    monkeypatch.setattr(torch, "linspace",
                        lambda *a, **k: real(*a, **{**k, "device": "cpu"}))
    with torch.device("meta"):
        yield
    monkeypatch.setattr(torch, "linspace", real)


def test_full_size_predictor_builds_on_meta_with_the_references_parameters(monkeypatch):
    ref = reference()
    with upstream_on_meta(monkeypatch):  # upstream's hub: vjepa2_ac_vit_giant
        up = ref.ac.vit_ac_predictor(img_size=256, patch_size=16, num_frames=64,
                                     tubelet_size=2, embed_dim=1408)
    with torch.device("meta"):
        ours = VJEPA2ACPredictor(VJEPA2ACConfig())
    want = {k: tuple(v.shape) for k, v in up.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert list(got) == list(want) and got == want
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in up.parameters()) == 305_220_992
    c = ours.config
    assert (c.depth, c.hidden_size, c.num_heads, c.embed_dim, c.num_patches, c.max_frames) == \
        (24, 1024, 16, 1408, 256, 32)
    assert all(p.is_meta for p in ours.parameters())


def test_config_refuses_sizes_upstream_cannot_run():
    with pytest.raises(ValueError, match="not a multiple of num_heads"):
        VJEPA2ACConfig(predictor_embed_dim=100, num_heads=16)
    with pytest.raises(ValueError, match="head_dim >= 12"):
        VJEPA2ACConfig(predictor_embed_dim=32, num_heads=4)
    with pytest.raises(ValueError, match="allows no frame"):
        VJEPA2ACConfig(num_frames=1)
    with pytest.raises(ValueError, match="is_frame_causal"):
        VJEPA2ACConfig(is_frame_causal=False)
    with pytest.raises(ValueError, match="field 'depth'"):
        VJEPA2ACConfig.from_dict({"depth": "24"})


def test_random_predictor_draws_every_parameter():
    p = random_vjepa2_predictor(tiny_config(**CONFIGS["grid2x2"]), seed=1)
    for name, t in p.named_parameters():
        assert t.std() > 0 or t.numel() == 1, name


# ---- the pose update of upstream's planner -----------------------------------------------------

def _rotation(axis: int, angle: float) -> torch.Tensor:
    c, s = math.cos(angle), math.sin(angle)
    m = torch.eye(3, dtype=torch.float64)
    i, j = [(1, 2), (0, 2), (0, 1)][axis]
    m[i, i], m[j, j] = c, c
    m[i, j], m[j, i] = (-s, s) if axis != 1 else (s, -s)
    return m


def _extrinsic_xyz(angles) -> torch.Tensor:
    """x, then y, then z about the fixed axes: Rz @ Ry @ Rx, one elementary rotation each."""
    return _rotation(2, angles[2]) @ _rotation(1, angles[1]) @ _rotation(0, angles[0])


def test_euler_angles_are_scipys_extrinsic_xyz():
    g = torch.Generator().manual_seed(0)
    angles = (torch.rand(64, 3, generator=g, dtype=torch.float64) * 2 - 1) * \
        torch.tensor([math.pi, math.pi / 2, math.pi], dtype=torch.float64)
    m = euler_to_matrix(angles)
    for a, r in zip(angles, m):
        torch.testing.assert_close(r, _extrinsic_xyz(a.tolist()), atol=1e-12, rtol=0)
    torch.testing.assert_close(matrix_to_euler(m), angles, atol=1e-9, rtol=0)


def test_next_pose_composes_the_rotation_on_the_left_and_clips_the_gripper():
    pose = torch.tensor([0.1, 0.2, 0.3, 0.4, -0.5, 2.0, 0.9], dtype=torch.float64)
    action = torch.tensor([0.01, -0.02, 0.03, 0.2, 0.1, -0.3, 0.5], dtype=torch.float64)
    new = next_pose(pose, action)
    torch.testing.assert_close(new[:3], pose[:3] + action[:3])
    want = _extrinsic_xyz(action[3:6].tolist()) @ _extrinsic_xyz(pose[3:6].tolist())
    torch.testing.assert_close(euler_to_matrix(new[3:6]), want, atol=1e-12, rtol=0)
    assert float(new[6]) == 1.0  # 0.9 + 0.5 clipped
    batch = next_pose(pose.float().expand(5, 7), action.float().expand(5, 7))
    assert batch.dtype == torch.float32 and batch.shape == (5, 7)


def test_next_pose_equals_scipy_when_installed():
    rotation = pytest.importorskip("scipy.spatial.transform").Rotation
    g = torch.Generator().manual_seed(1)
    pose, action = torch.rand(16, 7, generator=g, dtype=torch.float64), \
        0.3 * torch.randn(16, 7, generator=g, dtype=torch.float64)
    new = next_pose(pose, action)
    for p, a, n in zip(pose.numpy(), action.numpy(), new):
        m = rotation.from_euler("xyz", a[3:6]).as_matrix() @ \
            rotation.from_euler("xyz", p[3:6]).as_matrix()
        want = rotation.from_matrix(m).as_euler("xyz")
        torch.testing.assert_close(n[3:6], torch.from_numpy(want), atol=1e-9, rtol=0)
