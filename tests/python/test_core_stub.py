"""python/mstar_rt/_core.pyi types the compiled core as it is: the stub and mstar_rt._core name
the same classes, members (with the same kind: method, static method, read-only property,
attribute), parameters and base classes. A binding added, removed or renamed without its stub
(or the other way round) fails here."""

from __future__ import annotations

import ast
import pathlib
import types
from typing import Optional

import pytest

from mstar_rt import _core

# Next to the extension, so that run against an installed wheel this also checks the stub ships.
STUB = pathlib.Path(_core.__file__).with_name("_core.pyi")
FIX = "; update python/mstar_rt/_core.pyi to match bindings/"

# Class entries that are Python's or pybind11's machinery, not the bindings' API.
MACHINERY = {"__doc__", "__module__", "__dict__", "__weakref__", "_pybind11_conduit_v1_"}

Param = tuple[Optional[str], bool]  # (name, None when positional-only; has a default)


def _stub_module() -> ast.Module:
    return ast.parse(STUB.read_text(), filename=str(STUB))


def _public(name: str) -> bool:
    return not name.startswith("_")


def _stub_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if _public(n)}


def _stub_classes() -> dict[str, ast.ClassDef]:
    return {n.name: n for n in _stub_module().body if isinstance(n, ast.ClassDef)}


def _stub_kind(node: ast.AST) -> str:
    if isinstance(node, ast.AnnAssign):
        return "attribute"
    decorators = [ast.unparse(d) for d in node.decorator_list]
    if "property" in decorators:
        return "property"
    if any(d.endswith(".setter") for d in decorators):
        return "attribute"  # a property with a setter
    if "staticmethod" in decorators:
        return "staticmethod"
    return "method"


def _stub_members(cls: ast.ClassDef) -> dict[str, tuple[str, ast.AST]]:
    members = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            kind = _stub_kind(node)
            if members.get(node.name, ("",))[0] == "property" and kind == "attribute":
                members[node.name] = (kind, members[node.name][1])  # the setter of a property
            elif node.name not in members:
                members[node.name] = (kind, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members[node.target.id] = ("attribute", node)
    return members


def _live_kind(value: object) -> str:
    if isinstance(value, property):
        return "property" if value.fset is None else "attribute"
    if isinstance(value, (types.MemberDescriptorType, types.GetSetDescriptorType)):
        return "attribute"
    if isinstance(value, staticmethod):
        return "staticmethod"
    return "method"


def _live_members(cls: type) -> dict[str, tuple[str, object]]:
    """What the bindings define on `cls` itself; slot wrappers (the generic __init__ of a class
    bound without a constructor, a C type's tp_repr) are inherited behaviour, not API."""
    return {name: (_live_kind(value), value) for name, value in vars(cls).items()
            if name not in MACHINERY and not isinstance(value, types.WrapperDescriptorType)}


def _split_top_level(text: str) -> list[str]:
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _signature_params(line: str) -> list[Param]:
    """Parameters of a pybind11 signature line, `name(a: T, b: T = d) -> R`, or of a C type's
    `Name(a, b=d)`. pybind11 calls the parameters a binding leaves unnamed arg0, arg1...;
    those cannot be passed by keyword."""
    body = line[line.index("(") + 1:]
    depth = 1
    for end, ch in enumerate(body):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            break
    params = []
    for part in _split_top_level(body[:end]):
        if part.startswith("*"):
            params.append(("**" if part.startswith("**") else "*", False))
            continue
        name = part.split(":")[0].split("=")[0].strip()
        unnamed = name.startswith("arg") and name[3:].isdigit()
        params.append((None if unnamed else name, "=" in part))
    return params


def _live_params(cls: type, name: str, value: object) -> list[Param] | None:
    """The parameters after self (none to skip for static methods), or None if the core does
    not say."""
    if name == "__new__":  # a C type: its doc opens with the constructor's signature
        first = (cls.__doc__ or "").splitlines()[0] if cls.__doc__ else ""
        return _signature_params(first) if first.startswith(cls.__name__ + "(") else None
    func = value.__func__ if isinstance(value, staticmethod) else value
    first = (func.__doc__ or "").lstrip().splitlines()[0] if func.__doc__ else ""
    if not first.startswith(name + "("):
        return None
    params = _signature_params(first)
    return params if isinstance(value, staticmethod) else params[1:]


def _stub_params(fn: ast.FunctionDef, static: bool) -> list[Param]:
    a = fn.args
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    params = [(None if i < len(a.posonlyargs) else arg.arg, i >= first_default)
              for i, arg in enumerate(positional)]
    if a.vararg:
        params.append(("*", False))
    params += [(arg.arg, default is not None) for arg, default in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append(("**", False))
    return params if static else params[1:]  # self / cls


LIVE_CLASSES = sorted(n for n in dir(_core) if _public(n) and isinstance(getattr(_core, n), type))
# C struct sequences (WorkItem, Outcome): named tuples made in C; their fields are what counts.
RECORDS = [n for n in LIVE_CLASSES if hasattr(getattr(_core, n), "n_fields")]
BOUND = [n for n in LIVE_CLASSES if n not in RECORDS]


def test_the_stub_ships_next_to_the_extension_with_py_typed():
    assert STUB.is_file(), f"{STUB} is missing; the wheel must ship _core.pyi next to the extension"
    assert STUB.with_name("py.typed").is_file()


def test_the_stub_and_the_core_export_the_same_names():
    live = {n for n in dir(_core) if _public(n)}
    stub = _stub_names(_stub_module())
    assert not live - stub, f"the core exports {sorted(live - stub)}, which the stub lacks{FIX}"
    assert not stub - live, f"the stub declares {sorted(stub - live)}, which the core lacks{FIX}"


@pytest.mark.parametrize("name", LIVE_CLASSES)
def test_class_bases_match(name):
    cls = getattr(_core, name)
    live = [b.__name__ for b in cls.__bases__ if b.__name__ not in ("object", "pybind11_object")]
    stub = [ast.unparse(b.value if isinstance(b, ast.Subscript) else b)
            for b in _stub_classes()[name].bases]
    assert stub == live, f"class {name}: the core derives from {live}, the stub from {stub}{FIX}"


@pytest.mark.parametrize("name", RECORDS)
def test_record_fields_match(name):
    cls = getattr(_core, name)
    stub = [m for m, (kind, _) in _stub_members(_stub_classes()[name]).items() if kind == "property"]
    assert stub == list(cls.__match_args__), (
        f"{name}: the core's fields are {list(cls.__match_args__)}, the stub's {stub}{FIX}")


@pytest.mark.parametrize("name", BOUND)
def test_class_members_match_in_name_and_kind(name):
    cls = getattr(_core, name)
    live = {m: kind for m, (kind, _) in _live_members(cls).items()}
    stub = {m: kind for m, (kind, _) in _stub_members(_stub_classes()[name]).items()}
    missing = sorted(set(live) - set(stub))
    assert not missing, f"{name}: the core defines {missing}, which the stub lacks{FIX}"
    extra = sorted(m for m in set(stub) - set(live) if not hasattr(cls, m))
    assert not extra, f"{name}: the stub declares {extra}, which the core lacks{FIX}"
    wrong = {m: (live[m], stub[m]) for m in live if live[m] != stub[m]}
    assert not wrong, f"{name}: kinds differ as (core, stub): {wrong}{FIX}"


@pytest.mark.parametrize("name", BOUND)
def test_method_parameters_match_the_bindings(name):
    """Same names in the same order, the same ones defaulted; unnamed binding parameters are
    positional-only in the stub."""
    cls = getattr(_core, name)
    stub = _stub_members(_stub_classes()[name])
    checked = 0
    for member, (kind, value) in _live_members(cls).items():
        if kind not in ("method", "staticmethod") or member not in stub:
            continue
        live = _live_params(cls, member, value)
        if live is None:
            continue
        declared = _stub_params(stub[member][1], static=(kind == "staticmethod"))
        assert declared == live, (
            f"{name}.{member}: the core takes {live}, the stub declares {declared} "
            f"(as (name, has default); None: positional-only){FIX}")
        checked += 1
    methods = [m for m, (k, _) in _live_members(cls).items()
               if k in ("method", "staticmethod") and m in stub]
    assert checked == len(methods), f"{name}: the core's docstrings give no signature for some of {methods}"
