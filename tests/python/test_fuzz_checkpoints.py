"""Checkpoint loading fuzzed (issue 16, item 2): for every model family that loads a Hugging
Face-layout checkpoint directory (Llama / CausalLM, pi0, the world model, SNAC), random damage to
a good tiny checkpoint -- safetensors files cut at any offset, bytes flipped, header JSON rewritten
(dtypes, shapes, offsets, names), shard indexes broken, config fields deleted, set to absurd sizes
or to the wrong types, config.json replaced by junk.

Each case either still loads (a flipped bit in the tensor data is indistinguishable from a
weight) or fails with ValueError / FileNotFoundError whose message names the file, key or field
at fault -- never a segfault, a raw KeyError / TypeError / RuntimeError from deep inside, an
allocation of an absurd size (the test runs under an address-space limit) or a long stall. Every
family prints how many cases it tried."""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import time
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar_rt.models.llama import load_llama
from mstar_rt.models.pi0_layers import load_pi0, random_pi0, save_pi0
from mstar_rt.models.snac import SnacConfig, SnacDecoder, load_snac
from mstar_rt.models.world_model_layers import (load_world_model, random_world_model,
                                                save_world_model)

import tiny_checkpoints

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

SETTINGS = dict(derandomize=True, deadline=None, database=None, print_blob=False,
                suppress_health_check=list(HealthCheck))
CASES = 150  # per family
CASE_SECONDS = 10.0
HEADROOM = 3 << 30  # address space a case may add: far below any absurd size, far above a load

LOADERS: dict[str, Callable[[str], Any]] = {
    "llama": lambda p: load_llama(p, progress=False),
    "pi0": lambda p: load_pi0(p, progress=False),
    "world_model": lambda p: load_world_model(p, progress=False),
    "snac": lambda p: load_snac(p, progress=False),
}

SNAC_SMALL = dict(encoder_dim=8, encoder_rates=[2, 4], decoder_dim=64, decoder_rates=[4, 2],
                  attn_window_size=None, codebook_size=64, codebook_dim=4, vq_strides=[4, 2, 1],
                  noise=True, depthwise=True)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, str]:
    """One good tiny checkpoint directory per family."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("pristine")
    dirs = {name: str(root / name) for name in LOADERS}
    tok = tiny_checkpoints.tokenizer_dir(root / "tok")
    tiny_checkpoints.llama_dir(dirs["llama"], tok, steps=0)
    save_pi0(random_pi0(), dirs["pi0"])
    save_world_model(random_world_model(), dirs["world_model"])
    os.makedirs(dirs["snac"])
    with open(os.path.join(dirs["snac"], "config.json"), "w") as f:
        json.dump(SNAC_SMALL, f)
    torch.manual_seed(0)
    decoder = SnacDecoder(SnacConfig.from_dict(SNAC_SMALL))
    save_file({k: v.contiguous() for k, v in decoder.state_dict().items()},
              os.path.join(dirs["snac"], "model.safetensors"))
    for name, path in dirs.items():
        LOADERS[name](path)  # each loads as it is
    return dirs


# ---- damage ---------------------------------------------------------------------------------------

ABSURD = st.sampled_from([-1, 0, -2**31, 2**31, 2**40, 10**12, 2**63, 2**64 + 1, 1e308, -0.5,
                          3.5, "abc", "", "64", None, [], [2, 2], {}, {"a": 1}, True, False])
JUNK_FILES = st.sampled_from([b"", b"{", b"[1, 2]", b"null", b"\xff\xfe\x00", b'{"a": NaN',
                              b"42", b"\x00" * 64, b'"text"', b"[" * 100_000,
                              b'{"vocab_size": 1' + b"0" * 400 + b"}"])
DTYPES = st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "I8", "U8", "BOOL", "F8_E4M3",
                          "XYZ", "", 3, None])


def read_header(file: str) -> tuple[dict, bytes]:
    with open(file, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(file: str, header: Any, data: bytes, length: int | None = None) -> None:
    blob = json.dumps(header).encode() if not isinstance(header, bytes) else header
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob) if length is None else length) + blob + data)


@st.composite
def damage(draw, family: str, path: str) -> tuple[str, Callable[[str], None], tuple[str, ...]]:
    """(what, how to apply it to a copy of the directory, words the error may name)."""
    weights = os.path.join(path, "model.safetensors")
    size = os.path.getsize(weights)
    header, _ = read_header(weights)
    keys = sorted(k for k in header if k != "__metadata__")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    target = draw(st.sampled_from(["config field", "config field", "config file", "cut", "flip",
                                   "flip", "header", "header", "index", "missing"]))
    names = ("config.json", "model.safetensors", "index.json", *keys)

    if target == "config field":
        field = draw(st.sampled_from(sorted(config) + ["vision", "rope_scaling"]))
        how = draw(st.sampled_from(["delete", "absurd", "absurd", "nested"]))
        value = draw(ABSURD)

        def apply(d: str) -> None:
            c = dict(config)
            if how == "delete":
                c.pop(field, None)
            elif how == "nested" and isinstance(c.get(field), dict) and c[field]:
                sub = dict(c[field])
                sub[sorted(sub)[0]] = value
                c[field] = sub
            else:
                c[field] = value
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(c, f)
        return f"config {field} {how} {value!r}"[:80], apply, names + (field,)

    if target == "config file":
        junk = draw(JUNK_FILES)

        def apply(d: str) -> None:
            with open(os.path.join(d, "config.json"), "wb") as f:
                f.write(junk)
        return f"config.json = {junk!r}", apply, names

    if target in ("cut", "flip"):
        # mostly in the length word and the header JSON, where damage is detectable
        end = 8 + struct.unpack("<Q", open(weights, "rb").read(8))[0]
        at = draw(st.one_of(st.integers(0, end), st.integers(0, size - 1)))
        bit = draw(st.integers(0, 7))

        def apply(d: str) -> None:
            file = os.path.join(d, "model.safetensors")
            with open(file, "rb") as f:
                raw = bytearray(f.read())
            if target == "cut":
                del raw[at:]
            else:
                raw[at] ^= 1 << bit
            with open(file, "wb") as f:
                f.write(raw)
        return f"{target} at {at}", apply, names

    if target == "header":
        key = draw(st.sampled_from(keys))
        how = draw(st.sampled_from(["dtype", "shape", "offsets", "drop", "rename", "add",
                                    "length", "not json", "metadata"]))
        dtype, dims = draw(DTYPES), draw(st.lists(st.sampled_from([0, 1, 3, -1, 2**40, 2**63]),
                                                   max_size=3))
        offsets = draw(st.lists(st.sampled_from([0, 4, size, 2**40, -4]), min_size=1,
                                max_size=3))
        length = draw(st.sampled_from([0, 1, 2**32, 2**63, 2**64 - 1]))

        def apply(d: str) -> None:
            file = os.path.join(d, "model.safetensors")
            h, data = read_header(file)
            entry = dict(h[key])
            if how == "dtype":
                entry["dtype"] = dtype
            elif how == "shape":
                entry["shape"] = dims
            elif how == "offsets":
                entry["data_offsets"] = offsets
            if how == "drop":
                del h[key]
            elif how == "rename":
                h[key + ".renamed"] = h.pop(key)
            elif how == "add":
                h["bogus.weight"] = entry
            elif how == "metadata":
                h["__metadata__"] = {"format": ["pt"], "x": 3}
            elif how not in ("length", "not json"):
                h[key] = entry
            if how == "length":
                write_header(file, h, data, length)
            elif how == "not json":
                write_header(file, b"{'" + key.encode() + b"': nope}", data)
            else:
                write_header(file, h, data)
        return f"header {how} of {key} ({dtype!r} {dims} {offsets} {length})", apply, names

    if target == "index":
        how = draw(st.sampled_from(["valid", "junk", "no map", "missing shard", "not str",
                                    "escape", "empty map"]))
        junk = draw(JUNK_FILES)

        def apply(d: str) -> None:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}
            if how == "no map":
                del index["weight_map"]
            elif how == "missing shard":
                index["weight_map"][keys[0]] = "model-00002-of-00002.safetensors"
            elif how == "not str":
                index["weight_map"][keys[0]] = 7
            elif how == "escape":
                index["weight_map"][keys[0]] = "../../etc/passwd"
            elif how == "empty map":
                index["weight_map"] = {}
            with open(os.path.join(d, "model.safetensors.index.json"), "wb") as f:
                f.write(junk if how == "junk" else json.dumps(index).encode())
        return f"index {how}", apply, names + ("model-00002-of-00002.safetensors",)

    gone = draw(st.sampled_from(["config.json", "model.safetensors"]))

    def apply(d: str) -> None:
        os.remove(os.path.join(d, gone))
    return f"no {gone}", apply, names


# ---- the property --------------------------------------------------------------------------------

ALLOWED = (ValueError, FileNotFoundError)


def vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


class AddressSpaceLimit:
    """RLIMIT_AS at the current size plus ``headroom`` while inside: an absurd allocation fails
    at once (MemoryError / RuntimeError, which the test then reports) instead of swapping or
    waking the OOM killer."""

    def __init__(self, headroom: int) -> None:
        self.headroom = headroom

    def __enter__(self) -> "AddressSpaceLimit":
        self.saved = resource.getrlimit(resource.RLIMIT_AS)
        limit = vm_bytes() + self.headroom
        hard = self.saved[1]
        resource.setrlimit(resource.RLIMIT_AS,
                           (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
        return self

    def __exit__(self, *exc: Any) -> None:
        resource.setrlimit(resource.RLIMIT_AS, self.saved)


@pytest.mark.parametrize("family", sorted(LOADERS))
def test_damaged_checkpoints_load_or_fail_naming_what_is_wrong(family, pristine, tmp_path):
    source = pristine[family]
    load = LOADERS[family]
    tried, outcomes, damaged, slowest = [], {}, {}, 0.0
    counter = iter(range(10**6))

    @settings(max_examples=CASES, **SETTINGS)
    @given(case=damage(family, source))
    def one(case):
        nonlocal slowest
        what, apply, names = case
        tried.append(what)
        d = str(tmp_path / f"case{next(counter)}")
        shutil.copytree(source, d)
        apply(d)
        t0 = time.monotonic()
        try:
            with AddressSpaceLimit(HEADROOM):
                load(d)
            kind = "loads"
        except ALLOWED as e:
            message = str(e)
            assert any(n in message for n in names), \
                f"{what}: the error names no file, key or field: {type(e).__name__}: {message}"
            kind = type(e).__name__
        except Exception as e:
            raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e
        finally:
            shutil.rmtree(d, ignore_errors=True)
        took = time.monotonic() - t0
        slowest = max(slowest, took)
        assert took < CASE_SECONDS, f"{what}: took {took:.1f} s"
        outcomes[kind] = outcomes.get(kind, 0) + 1
        damaged[what.split()[0]] = damaged.get(what.split()[0], 0) + 1

    t0 = time.monotonic()
    one()
    print(f"\ncheckpoints, {family}: {len(tried)} cases in {time.monotonic() - t0:.1f} s "
          f"(slowest {slowest:.2f} s); {outcomes}; damage {damaged}")
    assert len(tried) >= CASES * 0.9
    assert outcomes.get("ValueError", 0) >= CASES // 3


def test_an_absurd_config_size_is_refused_before_anything_is_allocated(pristine, tmp_path):
    """A width of 2**31 - 1 passes the field check (it is an integer in range) but does not
    match the weights (or makes a tensor too big for any machine): the meta-device build and
    the safetensors headers say so before the first byte is allocated."""
    for family, field in [("llama", "hidden_size"), ("pi0", "width"),
                          ("world_model", "hidden_size"), ("snac", "codebook_size")]:
        d = tmp_path / family
        shutil.copytree(pristine[family], d)
        config = json.loads((d / "config.json").read_text())
        config[field] = 2**31 - 1 if family != "world_model" else 2**30
        (d / "config.json").write_text(json.dumps(config))
        t0 = time.monotonic()
        with AddressSpaceLimit(1 << 30), pytest.raises(ValueError) as e:
            LOADERS[family](str(d))
        assert time.monotonic() - t0 < CASE_SECONDS
        assert any(w in str(e.value) for w in ("does not match", "does not fit",
                                                "no model can have")), str(e.value)


def test_config_errors_name_the_field_and_the_file(pristine, tmp_path):
    cases = [("llama", "vocab_size", None, "lacks the field 'vocab_size'"),
             ("llama", "num_hidden_layers", -2, "field 'num_hidden_layers'"),
             ("llama", "hidden_size", "64", "field 'hidden_size'"),
             ("llama", "rope_parameters", [1], "field 'rope_parameters'"),
             ("pi0", "num_layers", 10**9, "field 'num_layers'"),
             ("pi0", "vision", {"hidden_size": -1}, "field 'hidden_size' of field 'vision'"),
             ("world_model", "grid", [4], "field 'grid'"),
             ("world_model", "mlp_ratio", "wide", "field 'mlp_ratio'"),
             ("snac", "decoder_rates", [4, "2"], "field 'decoder_rates'"),
             ("snac", "noise", "yes", "field 'noise'")]
    for family, field, value, words in cases:
        d = tmp_path / f"{family}-{field}"
        shutil.copytree(pristine[family], d)
        config = json.loads((d / "config.json").read_text())
        if value is None:
            del config[field]
        else:
            config[field] = value
        (d / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError) as e:
            LOADERS[family](str(d))
        assert words in str(e.value) and "config.json" in str(e.value), str(e.value)
