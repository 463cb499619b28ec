"""Values across the process boundary: msgpack for structure, the shared-memory arena for bytes.

Never pickle: a message is a msgpack map. Plain data (None, bool, int, float, str, bytes, list,
dict) is msgpack itself; a few extension types carry the rest:

* tensor (torch or numpy): ``[kind, dtype, shape, offset, nbytes]`` -- the bytes lie in the
  sender's arena at ``offset``; the receiver copies them out before it frees the span;
* small tensor (at most ``inline_bytes``, 1 KiB by default): ``[kind, dtype, shape, bytes]`` -- the
  bytes ride in the message itself (a decode loop's token, a robot's state): an arena span costs
  more than the few bytes it would hold, and a token stream's replies carry hundreds of them;
* tuple: a packed list (kept apart from lists, so outputs compare equal to in-process ones);
* registered dataclass: ``["module:QualName", {field: value}]``, rebuilt only for types that the
  receiving process registered too (:func:`register_type`), never by importing what a message
  names;
* numpy scalar: ``[dtype, raw bytes]``;
* remote tensor: ``[rank, gen, key, offset, nbytes, kind, dtype, shape]`` -- bytes left in
  worker ``rank``'s export arena for another worker to read (placement/direct.py).

A CUDA tensor crosses as a host copy of kind ``_CUDA``: a worker whose group is on a CUDA device
puts it back on that device as it decodes it, so a node sees its input where the node that made
it left it; a process without one (the parent, a CPU worker) keeps the host copy, marked, so
that it leaves again as ``_CUDA`` (a hop through the parent keeps the kind). A CUDA IPC handle
or a torch.distributed send would spare the host copy (see docs/placement.md).
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys
from typing import Any, Callable, Optional

import msgpack
import numpy as np

from mstar_rt.placement.arena import ShmArena
from mstar_rt.placement.direct import Export, ExportArena, RemoteTensor

EXT_TENSOR, EXT_TUPLE, EXT_DATACLASS, EXT_NPSCALAR, EXT_REMOTE, EXT_INLINE = 1, 2, 3, 4, 5, 6
INLINE_BYTES = 1024  # tensors up to this size travel inside the message (measured: cheaper)
_TORCH, _NUMPY, _CUDA = 0, 1, 2  # tensor kinds: _CUDA is a torch tensor made on a CUDA device
_WAS_CUDA = "_mstar_was_cuda"  # the mark on a host copy of a CUDA tensor (this module's own)

_NUMPY_DTYPES = {str(np.dtype(t)): np.dtype(t) for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128")}

_TYPES: dict[str, type] = {}
_TORCH_DTYPES: Optional[dict[str, Any]] = None
_TORCH_NAMES: dict[Any, str] = {}  # torch dtype -> its name in a header
_NP_OF_TORCH = {d: np.dtype(d) for d in ("bool", "int8", "int16", "int32", "int64", "uint8",
                                          "float16", "float32", "float64", "complex64",
                                          "complex128")}
_UINT16 = np.dtype(np.uint16)  # bfloat16's bits, which numpy cannot name


class CodecError(ValueError):
    """A value cannot cross the process boundary, or a message is malformed."""


def register_type(cls: type) -> type:
    """Lets instances of dataclass ``cls`` cross between processes (by fields). Call it in the
    module that defines ``cls``, so the parent and every worker that imports it register it;
    usable as a class decorator."""
    if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
        raise TypeError(f"register_type: {cls!r} is not a dataclass type")
    _TYPES[f"{cls.__module__}:{cls.__qualname__}"] = cls
    return cls


def _torch_dtypes() -> dict[str, Any]:
    global _TORCH_DTYPES
    if _TORCH_DTYPES is None:
        import torch

        _TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
            torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
            torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
            torch.complex128)}
        _TORCH_NAMES.update({d: name for name, d in _TORCH_DTYPES.items()})
    return _TORCH_DTYPES


def _register_builtin_types() -> None:
    from mstar_rt.model import StreamChunk

    register_type(StreamChunk)
    try:
        from mstar_rt.engines.sampling import SamplingParams
    except ImportError:  # torch missing: no LM, no SamplingParams to send
        return
    register_type(SamplingParams)


class Encoder:
    """Packs messages; tensors larger than ``inline_bytes`` go into ``arena`` (the caller marks /
    publishes around it), smaller ones inside the message."""

    def __init__(self, arena: Optional[ShmArena], timeout_s: float = 10.0,
                 exports: Optional[ExportArena] = None, rank: int = 0, gen: int = 0,
                 inline_bytes: int = INLINE_BYTES) -> None:
        self.arena = arena
        self.inline_bytes = inline_bytes
        self.timeout_s = timeout_s
        self.exports, self.rank, self.gen = exports, rank, gen  # a worker's export arena
        self.exported: list[int] = []  # the keys the last pack exported
        # One message's tensors by identity: one that appears twice (a request's input, in its
        # inputs and in its first node's) crosses once; the receiver still makes two.
        self._memo: Optional[dict[int, tuple]] = None
        self._alive: Optional[Callable[[], bool]] = None

    def pack(self, message: Any, alive: Optional[Callable[[], bool]] = None) -> bytes:
        """``alive``: whether the arena's reader lives; a full arena is waited on only while it
        does (:class:`~mstar_rt.placement.arena.ReaderGone` then)."""
        top = self._memo is None
        if top:
            self._memo = {}
            self.exported = []
            self._alive = alive
        try:
            return msgpack.packb(message, default=self._default, strict_types=True,
                                 use_bin_type=True)
        except CodecError:
            raise
        except OverflowError as e:
            raise CodecError(f"cannot send an integer outside the 64-bit range ({e})") from None
        except (TypeError, ValueError) as e:
            raise CodecError(str(e)) from None
        finally:
            if top:
                self._memo, self._alive = None, None

    def _default(self, obj: Any) -> msgpack.ExtType:
        t = type(obj)
        if t is RemoteTensor:  # routed on: the reader takes the bytes from their maker
            return msgpack.ExtType(EXT_REMOTE, msgpack.packb(obj.header))
        if t is Export:
            remote = self._export(obj.tensor)
            return remote if remote is not None else self._default(obj.tensor)
        torch = sys.modules.get("torch")  # no tensor can exist unless torch was imported
        if torch is not None and isinstance(obj, torch.Tensor):
            seen = self._memo.get(id(obj)) if self._memo is not None else None
            if seen is None:
                seen = (obj, self._pack_torch(obj))
                if self._memo is not None:
                    self._memo[id(obj)] = seen
            return seen[1]
        if t is tuple:
            return msgpack.ExtType(EXT_TUPLE, self.pack(list(obj)))
        if t is np.ndarray:
            return self._pack_numpy(obj)
        if isinstance(obj, np.generic):
            dt = str(obj.dtype)
            if dt not in _NUMPY_DTYPES:
                raise CodecError(f"cannot send a numpy scalar of dtype {dt}")
            return msgpack.ExtType(EXT_NPSCALAR, msgpack.packb([dt, obj.tobytes()]))
        # strict_types sends subclasses here: cross as their plain base (torch.Size: tuple)
        if isinstance(obj, tuple):
            return msgpack.ExtType(EXT_TUPLE, self.pack(list(obj)))
        for base in (bool, int, float, str, bytes, list, dict):
            if isinstance(obj, base):
                return base(obj)
        if isinstance(obj, (bytearray, memoryview)):
            return bytes(obj)
        key = f"{t.__module__}:{t.__qualname__}"
        if _TYPES.get(key) is t:
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            return msgpack.ExtType(EXT_DATACLASS, self.pack([key, fields]))
        hint = (" (register the dataclass with mstar_rt.placement.register_type)"
                if dataclasses.is_dataclass(obj) else "")
        raise CodecError(f"cannot send a value of type {t.__module__}.{t.__qualname__} between "
                         "processes; send tensors, numpy arrays, numbers, strings, bytes, lists, "
                         f"tuples, dicts or registered dataclasses{hint}")

    def _export(self, t: Any) -> Optional[msgpack.ExtType]:
        """``t`` into the export arena (None: no room or not a plain CPU tensor -- it then
        goes through the parent)."""
        dt = _TORCH_NAMES.get(t.dtype) or (_torch_dtypes() and _TORCH_NAMES.get(t.dtype))
        kind = _kind(t)
        if t.is_cuda:  # its host copy is what crosses
            t = t.detach().cpu()
        if (self.exports is None or dt is None or t.device.type != "cpu" or not t.is_contiguous()
                or t.is_conj() or t.is_neg()):
            return None
        nbytes = t.nbytes
        got = self.exports.put(nbytes)
        if got is None:
            return None
        key, offset = got
        self.exported.append(key)
        ctypes.memmove(self.exports.arena.address(offset), t.data_ptr(), nbytes)
        header = [self.rank, self.gen, key, offset, nbytes, kind, dt, list(t.shape)]
        if self.exports.at:  # fetched over tcp by a worker on another machine
            header.append(self.exports.at)
        return msgpack.ExtType(EXT_REMOTE, msgpack.packb(header))

    def _alloc(self, nbytes: int) -> int:
        if self.arena is None:
            raise CodecError("this message cannot carry tensors")
        return self.arena.alloc(nbytes, self.timeout_s, self._alive)

    def _pack_torch(self, t: Any) -> msgpack.ExtType:
        dt = _TORCH_NAMES.get(t.dtype)
        if dt is None:
            _torch_dtypes()
            dt = _TORCH_NAMES.get(t.dtype)
            if dt is None:
                raise CodecError(f"cannot send a torch tensor of dtype {t.dtype}")
        torch = sys.modules["torch"]
        if t.layout != torch.strided:
            raise CodecError(f"cannot send a {t.layout} tensor; make it dense first")
        src, kind = t, _kind(t)
        # A contiguous CPU tensor (the common case) is copied straight from its memory: one
        # memmove, no torch op (each would take and drop the GIL among busy threads).
        if not src.is_cpu:  # a host copy (CUDA IPC would spare it)
            src = src.detach().cpu()
        if src.is_conj() or src.is_neg():
            src = src.detach().resolve_conj().resolve_neg()
        if not src.is_contiguous():
            src = src.detach().contiguous()
        nbytes = src.nbytes
        if nbytes <= self.inline_bytes:
            raw = ctypes.string_at(src.data_ptr(), nbytes) if nbytes else b""
            return msgpack.ExtType(EXT_INLINE, msgpack.packb([kind, dt, list(t.shape), raw]))
        offset = self._alloc(nbytes)
        ctypes.memmove(self.arena.address(offset), src.data_ptr(), nbytes)
        return msgpack.ExtType(EXT_TENSOR, msgpack.packb([kind, dt, list(t.shape), offset,
                                                          nbytes]))

    def _pack_numpy(self, a: np.ndarray) -> msgpack.ExtType:
        dt = str(a.dtype)
        if dt not in _NUMPY_DTYPES or a.dtype.byteorder == ">":
            raise CodecError(f"cannot send a numpy array of dtype {a.dtype!r}")
        nbytes = a.nbytes
        src = np.ascontiguousarray(a)
        if nbytes <= self.inline_bytes:
            return msgpack.ExtType(EXT_INLINE, msgpack.packb([_NUMPY, dt, list(a.shape),
                                                              src.tobytes()]))
        offset = self._alloc(nbytes)
        ctypes.memmove(self.arena.address(offset), src.ctypes.data, nbytes)
        return msgpack.ExtType(EXT_TENSOR, msgpack.packb([_NUMPY, dt, list(a.shape), offset,
                                                          nbytes]))


class Decoder:
    """Unpacks messages; tensors are copied out of ``arena`` (validated against its bounds)."""

    def __init__(self, arena: Optional[ShmArena],
                 remote: Optional[Callable[[list], Any]] = None,
                 remote_arena: Optional[Callable[[list], tuple[Any, int]]] = None,
                 cuda: Optional[str] = None) -> None:
        self.arena = arena
        self.cuda = cuda  # where tensors made on a CUDA device go (None: stay on the host)
        # A remote tensor becomes remote(header) (the parent's handle), or is copied out of
        # remote_arena(header) -> (arena, offset) (a worker that reads it); neither: it may not
        # come here.
        self.remote, self.remote_arena = remote, remote_arena
        self.fetched = 0  # remote tensors copied out of their makers' arenas so far

    def unpack(self, data: bytes) -> Any:
        try:
            return msgpack.unpackb(data, ext_hook=self._ext, raw=False, strict_map_key=False,
                                   use_list=True)
        except CodecError:
            raise
        except Exception as e:  # msgpack raises several types for garbage
            raise CodecError(f"not a valid msgpack message ({type(e).__name__}: {e})") from None

    def _ext(self, code: int, data: bytes) -> Any:
        if code == EXT_TUPLE:
            value = self.unpack(data)
            if not isinstance(value, list):
                raise CodecError("a tuple extension must hold a list")
            return tuple(value)
        if code == EXT_INLINE:
            return self._inline(msgpack.unpackb(data))
        if code == EXT_TENSOR:
            return self._tensor(msgpack.unpackb(data))
        if code == EXT_DATACLASS:
            value = self.unpack(data)
            if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
                    and isinstance(value[1], dict)):
                raise CodecError("a dataclass extension must hold [type name, fields]")
            cls = _TYPES.get(value[0])
            if cls is None:
                raise CodecError(f"type {value[0]} is not registered in this process; call "
                                 "mstar_rt.placement.register_type on it in the module that "
                                 "defines it")
            try:
                return cls(**value[1])
            except Exception as e:
                raise CodecError(f"cannot rebuild {value[0]}: {type(e).__name__}: {e}") from None
        if code == EXT_REMOTE:
            h = msgpack.unpackb(data)
            if not (isinstance(h, list) and (len(h) == 8 or len(h) == 9 and type(h[8]) is str)
                    and all(type(x) is int and x >= 0 for x in h[:5])):
                raise CodecError("malformed remote tensor header; expected [rank, gen, key, "
                                 "offset, nbytes, kind, dtype, shape(, endpoint)]")
            if self.remote_arena is not None:
                arena, offset = self.remote_arena(h)
                out = self._tensor([h[5], h[6], h[7], offset, h[4]], arena)
                self.fetched += 1
                return out
            if self.remote is not None:
                self._tensor([h[5], h[6], h[7], h[3], h[4]], check_only=True)
                return self.remote(h)
            raise CodecError("a remote tensor cannot arrive here")
        if code == EXT_NPSCALAR:
            value = msgpack.unpackb(data)
            if not (isinstance(value, list) and len(value) == 2 and value[0] in _NUMPY_DTYPES
                    and isinstance(value[1], bytes)
                    and len(value[1]) == _NUMPY_DTYPES[value[0]].itemsize):
                raise CodecError("malformed numpy scalar")
            return np.frombuffer(value[1], dtype=_NUMPY_DTYPES[value[0]])[0]
        raise CodecError(f"unknown msgpack extension type {code}")

    def _inline(self, h: Any) -> Any:
        if not (type(h) is list and len(h) == 4 and type(h[3]) is bytes):
            raise CodecError("malformed small tensor; expected [kind, dtype, shape, bytes]")
        kind, dt, shape, raw = h
        dtype, count = _checked(kind, dt, shape, len(raw))
        np_dtype = dtype if kind == _NUMPY else _NP_OF_TORCH.get(dt, _UINT16)
        arr = np.frombuffer(raw, np_dtype, count).reshape(shape).copy()  # writable, its own
        if kind == _NUMPY:
            return arr
        out = sys.modules["torch"].from_numpy(arr)
        return self._placed(kind, out if dt in _NP_OF_TORCH else out.view(dtype))

    def _placed(self, kind: int, t: Any) -> Any:
        """A torch tensor where it belongs: a CUDA one's host copy back on this process's
        device, or marked so that it leaves again as one."""
        if kind != _CUDA:
            return t
        if self.cuda is not None:
            return t.to(self.cuda)
        setattr(t, _WAS_CUDA, True)
        return t

    def _tensor(self, h: Any, arena: Optional[ShmArena] = None, check_only: bool = False) -> Any:
        if not (isinstance(h, list) and len(h) == 5):
            raise CodecError("malformed tensor header; expected [kind, dtype, shape, offset, "
                             "nbytes]")
        kind, dt, shape, offset, nbytes = h
        dtype, count = _checked(kind, dt, shape, nbytes)
        if check_only:
            return None
        arena = arena or self.arena
        if nbytes:
            if arena is None:
                raise CodecError("this message cannot carry tensors")
            try:
                arena.check_span(offset, nbytes)
            except ValueError as e:
                raise CodecError(str(e)) from None
        np_dtype = dtype if kind == _NUMPY else _NP_OF_TORCH.get(dt, _UINT16)
        # One copy out of the arena into an array numpy allocates; torch adopts it: no torch op,
        # which would drop and retake the GIL among the process's busy threads (bfloat16, which
        # numpy lacks, takes one).
        arr = (arena.array(offset, np_dtype, count).reshape(shape).copy() if nbytes
               else np.empty(shape, dtype=np_dtype))
        if kind == _NUMPY:
            return arr
        out = sys.modules["torch"].from_numpy(arr)
        return self._placed(kind, out if dt in _NP_OF_TORCH else out.view(dtype))


def _kind(t: Any) -> int:
    """A torch tensor's kind in a header: _CUDA for one on a CUDA device or the host copy of one."""
    return _CUDA if t.is_cuda or getattr(t, _WAS_CUDA, False) else _TORCH


def _checked(kind: Any, dt: Any, shape: Any, nbytes: Any) -> tuple[Any, int]:
    """(dtype, element count) of a tensor of ``kind``, ``dt`` and ``shape`` holding ``nbytes``."""
    count = 1
    if kind in (_TORCH, _NUMPY, _CUDA) and type(dt) is str and type(shape) is list:
        for d in shape:
            if type(d) is not int or d < 0:
                break
            count *= d
        else:
            dtype = _NUMPY_DTYPES.get(dt) if kind == _NUMPY else _torch_dtypes().get(dt)
            if dtype is None:
                raise CodecError(f"tensor dtype '{dt}' is not allowed")
            if count * dtype.itemsize != nbytes:
                raise CodecError(f"tensor of shape {shape} and dtype {dt} needs "
                                 f"{count * dtype.itemsize} bytes, the header says {nbytes}")
            return dtype, count
    raise CodecError("malformed tensor header; expected [kind, dtype, shape, offset, nbytes]")


def scalar_items(state: dict) -> dict:
    """The entries of a request's state that are plain scalars (what the parent mirrors)."""
    return {k: v for k, v in state.items()
            if isinstance(k, str) and (v is None or type(v) in (bool, int, float, str))
            and not (type(v) is int and not -2**63 <= v < 2**64)}


_register_builtin_types()

__all__ = ["CodecError", "Decoder", "Encoder", "register_type", "scalar_items"]
