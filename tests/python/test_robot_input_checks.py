"""Robot-model arguments and request inputs refused by name where they were taken silently (and
served wrong), hung, or failed later than need be: guided-RTC settings, integer inputs, pi0
images and prompts, the world model's horizon, V-JEPA 2 pixels and SmolVLA's state. Found by an
audit of the robot APIs from Python."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mstar_rt
from mstar_rt.engines import KVCacheEngine
from mstar_rt.models.lerobot_rtc import RtcSettings
from mstar_rt.models.pi0 import Pi0Policy, check_images, check_pi0_inputs
from mstar_rt.models.pi0_layers import Pi0Config, random_pi0
from mstar_rt.models.sampling import request_seed, whole_number
from mstar_rt.models.vjepa2_encoder import NORMALIZED_RANGE
from mstar_rt.models.world_model import WorldModel
from mstar_rt.models.world_model_layers import WorldModelConfig, random_world_model

T = 60.0


@pytest.mark.parametrize("fields, needle", [
    (dict(schedule="CUBIC"), "schedule is 'CUBIC'; LeRobot knows"),
    (dict(max_guidance_weight=float("nan")), "max_guidance_weight is nan; give a finite number"),
    (dict(max_guidance_weight=float("inf")), "max_guidance_weight is inf"),
    (dict(max_guidance_weight=-5.0), "max_guidance_weight is -5.0"),
    (dict(execution_horizon=-3), "execution_horizon is -3; give an integer >= 0"),
])
def test_rtc_settings_built_by_hand_are_checked(fields, needle):
    # "exp" ran as LINEAR, a NaN cap served NaN actions, -3 failed every request in the flow
    with pytest.raises(ValueError, match=f"RtcSettings.{needle}"):
        RtcSettings(**fields)
    assert RtcSettings(schedule="exp").schedule == "EXP"


@pytest.fixture(scope="module")
def pi0():
    return random_pi0(Pi0Config(), seed=0)


@pytest.mark.parametrize("beta", [float("nan"), float("inf"), -1.0, 0.0])
def test_a_guidance_beta_that_is_not_a_positive_number_is_refused(pi0, beta):
    with pytest.raises(ValueError, match="guidance_beta must be a finite number > 0"):
        Pi0Policy(pi0, rtc="guided", guidance_beta=beta)


@pytest.mark.parametrize("field", ["page_size", "num_pages", "max_batch", "max_tokens_per_step"])
def test_kv_engine_sizes_below_one_are_refused(field):
    # max_batch=0 took no work: every request hung
    with pytest.raises(ValueError, match=f"KVCacheEngine {field}=0; give an integer >= 1"):
        KVCacheEngine(**{field: 0})
    KVCacheEngine(**{field: np.int64(2)})


@pytest.mark.parametrize("value", [torch.tensor(2.7), torch.tensor(True), np.array(2.0), 2.0,
                                   -1, True])
def test_integer_inputs_are_not_truncated(value):
    # tensor(2.7) served horizon 2, tensor(True) delay 1
    with pytest.raises(ValueError, match="'delay' must be an integer >= 0"):
        whole_number(value, "delay")


def test_integer_inputs_come_as_numbers_arrays_or_tensors_and_seeds_fit_torch():
    for v in (3, np.int64(3), np.array(3), torch.tensor(3), torch.tensor([3])):
        assert whole_number(v, "delay") == 3
    with pytest.raises(ValueError, match=r"'seed' must be below 2\*\*63"):
        request_seed(2**70)  # "Overflow when unpacking long long", naming nothing


def test_pi0_images_and_prompt_are_checked_at_submit(pi0):
    c = pi0.config
    one = torch.zeros(24, 40, 3, dtype=torch.uint8)
    assert len(check_images(c, one)) == 1  # one torch image, not 24 cameras
    with pytest.raises(ValueError, match=r"'images'\[0\] must be a uint8 array \[H >= 1"):
        check_images(c, [np.zeros((0, 10, 3), np.uint8)])  # failed later, in the vision node
    with pytest.raises(ValueError, match="'prompt' must be token ids .* got a string"):
        check_pi0_inputs(pi0, dict(prompt="pick up the cube", state=torch.zeros(c.state_dim)))


def test_world_model_horizons_are_bounded_by_what_the_predictor_takes():
    predictor = random_world_model(WorldModelConfig(), seed=0)
    frames = predictor.config.max_frames
    with pytest.raises(ValueError, match=f"max_horizon=20000: give an integer from 1 to the "
                                         f"predictor's max_frames={frames}"):
        WorldModel(predictor, max_horizon=20000)  # sized the cache for 80032 pages
    assert WorldModel(predictor).max_horizon == min(32, frames)


def test_world_model_frames_are_copies_not_views_of_the_batch():
    predictor = random_world_model(WorldModelConfig(), seed=0)
    c = predictor.config
    g = torch.Generator().manual_seed(0)
    with mstar_rt.Runtime(WorldModel(predictor, max_horizon=4)) as rt:
        hs = [rt.submit(dict(frames=torch.randn(1, c.num_patches, c.embed_dim, generator=g),
                             states=torch.randn(1, c.state_dim, generator=g),
                             actions=torch.randn(2, c.action_dim, generator=g)))
              for _ in range(4)]
        frames = [h.result(T)["frame"][0] for h in hs]
    with pytest.raises(ValueError, match="'horizon' must be an integer >= 1"):
        WorldModel(predictor).validate_inputs(dict(
            frames=torch.zeros(1, c.num_patches, c.embed_dim), states=torch.zeros(1, c.state_dim),
            actions=torch.zeros(3, c.action_dim), horizon=torch.tensor(2.7)))
    for f in frames:  # a kept frame pinned the whole batch's output
        assert f.untyped_storage().nbytes() == f.numel() * f.element_size()


def test_normalized_pixels_span_what_the_image_statistics_give():
    from mstar_rt.models.vjepa2_encoder import IMAGE_MEAN, IMAGE_STD, check_images as pixels

    rgb = torch.randint(0, 256, (2, 16, 16, 3), dtype=torch.uint8)
    assert pixels(pixels(rgb, 16), 16).shape == (2, 3, 16, 16)  # normalized ones pass
    with pytest.raises(ValueError, match=r"float 'images' must be normalized pixels .* got "
                                         r"values from 0 to 255: give uint8"):
        pixels(rgb.permute(0, 3, 1, 2).float().clamp(0, 255).index_fill(3, torch.tensor(
            [0]), 0.0).index_fill(3, torch.tensor([1]), 255.0), 16)  # 0-255 floats

    low = min((0 - m) / s for m, s in zip(IMAGE_MEAN, IMAGE_STD))
    high = max((1 - m) / s for m, s in zip(IMAGE_MEAN, IMAGE_STD))
    assert NORMALIZED_RANGE[0] < low < -2.0 and 2.6 < high < NORMALIZED_RANGE[1]
