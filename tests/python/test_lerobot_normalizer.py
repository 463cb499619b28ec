"""The one normalizer of every LeRobot policy (pi0, pi0.5, SmolVLA): LeRobot's formulas, their
inverse, and the load-time checks that name what to fix."""

import pytest
import torch

from mstar_rt.models.lerobot_normalizer import NORM_STATS, Normalizer

LOW_HIGH = {"mean": torch.tensor([0.5, -1.0, 2.0]), "std": torch.tensor([2.0, 0.5, 0.0]),
            "min": torch.tensor([-1.0, 0.0, 3.0]), "max": torch.tensor([1.0, 4.0, 3.0]),
            "q01": torch.tensor([-2.0, 0.0, 1.0]), "q99": torch.tensor([2.0, 1.0, 1.0]),
            "q10": torch.tensor([-1.0, 0.5, 0.0]), "q90": torch.tensor([1.0, 1.5, 0.0])}


def test_formulas_are_lerobots_and_unnormalize_inverts_them():
    x = torch.tensor([[0.3, 2.0, 3.0], [1.0, -0.5, 1.0]])
    eps = 1e-8
    mean, std = LOW_HIGH["mean"], LOW_HIGH["std"]
    assert torch.allclose(Normalizer("f", "MEAN_STD", LOW_HIGH).normalize(x),
                          (x - mean) / (std + eps))
    lo, hi = LOW_HIGH["min"], LOW_HIGH["max"]
    span = torch.where(hi == lo, torch.tensor(eps), hi - lo)  # a constant feature: eps
    assert torch.allclose(Normalizer("f", "MIN_MAX", LOW_HIGH).normalize(x),
                          2 * (x - lo) / span - 1)
    for mode in ("MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10"):
        n = Normalizer("f", mode, LOW_HIGH, size=3)
        back = n.unnormalize(n.normalize(x))
        keep = (LOW_HIGH[NORM_STATS[mode][1]] != LOW_HIGH[NORM_STATS[mode][0]])
        if mode == "MEAN_STD":
            keep = LOW_HIGH["std"] != 0
        assert torch.allclose(back[:, keep], x[:, keep], atol=1e-5), mode
    assert Normalizer("f", "IDENTITY", {}).normalize(x) is x


@pytest.mark.parametrize("mode, stats, size, words", [
    ("Z_SCORE", LOW_HIGH, None, r"mode 'Z_SCORE' of 'state' is not one of"),
    ("MEAN_STD", {"mean": LOW_HIGH["mean"]}, None,
     r"stats.safetensors lacks 'state.std', which MEAN_STD normalization"),
    ("MIN_MAX", LOW_HIGH, 4,
     r"'state' statistic 'min' has shape \[3\], but config.json gives 'state' 4 values "
     r"\(statistics read from stats.safetensors\)"),
    ("QUANTILES", {**LOW_HIGH, "q99": torch.tensor([1.0, float("inf"), 1.0])}, 3,
     r"'state' statistic 'q99' in stats.safetensors holds NaN or infinite values"),
])
def test_statistics_that_cannot_serve_are_refused_at_load(mode, stats, size, words):
    with pytest.raises(ValueError, match=words):
        Normalizer("state", mode, stats, size=size, source="stats.safetensors")
