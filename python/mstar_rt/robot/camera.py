"""Camera observations: frame sources that grab at their own rate into a drop-oldest ring, so a
policy always reads the newest frame and a slow reader never stalls the camera.

>>> with VideoCaptureSource("clip.avi", fps=30) as cam:  # doctest: +SKIP
...     frame = cam.latest(timeout=1.0)  # Frame(image=(H, W, 3) uint8 RGB, timestamp, index)
"""

from __future__ import annotations

import abc
import collections
import contextlib
import math
import os
import sys
import threading
import time
from typing import Any, ContextManager, Deque, NamedTuple, Optional, Tuple, Union

import numpy as np

from mstar_rt.streaming import Ring

# MuJoCo picks its OpenGL backend once, when `mujoco` is first imported, from MUJOCO_GL. The
# default (GLFW) needs a display and a context on the main thread; we render offscreen on a
# background thread, often headless, which EGL does (Mesa's too). Setting it after mujoco is
# imported would be silently ignored, so only default it while that is still possible.
if sys.platform.startswith("linux") and "mujoco" not in sys.modules:
    os.environ.setdefault("MUJOCO_GL", "egl")

__all__ = ["Frame", "FrameSource", "MujocoRenderSource", "VideoCaptureSource"]


class Frame(NamedTuple):
    image: np.ndarray  # (H, W, 3) uint8 RGB, a copy the caller owns
    timestamp: float  # time.monotonic() when the frame was grabbed
    index: int  # 0-based count of frames the source grabbed, dropped ones included


def _check_fps(fps: Any) -> None:
    """1/fps paced nothing for 0, a negative or NaN: the grab thread spun at full speed."""
    try:
        ok = fps is None or (not isinstance(fps, bool) and math.isfinite(fps) and fps > 0)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"fps must be a finite number > 0 (or None: the device paces itself), "
                         f"got {fps!r}")


class FrameSource(abc.ABC):
    """Base: a grab thread fills a drop-oldest Ring of (H, W, 3) uint8 frames; latest() reads.

    The Ring is single-producer / single-consumer: only the grab thread writes it, and latest()
    must be called from one reader thread at a time. Subclasses implement _grab() and, for
    thread-bound resources (a GL context), _setup()/_teardown(), which run on the grab thread.
    """

    def __init__(self, height: int, width: int, *, fps: Optional[float] = None,
                 paced: bool = True, capacity: int = 4) -> None:
        if capacity < 2:
            # With one slot a drop-then-write would briefly leave the ring empty under the reader.
            raise ValueError(f"capacity must be a power of two >= 2, got {capacity}")
        _check_fps(fps)
        self.shape: Tuple[int, int, int] = (int(height), int(width), 3)
        self.fps = fps
        self._period = 1.0 / fps if (paced and fps) else 0.0
        self._frames = Ring(np.uint8, capacity, item_shape=self.shape, overflow="drop_oldest")
        # Rows (ring position, grab index, timestamp), pushed before the frame is published so a
        # reader that sees frame p always finds its row. Larger than the frame ring: it must still
        # hold the newest frame's row after rows of frames the reader never saw.
        self._stamps = Ring(np.float64, 64, item_shape=(3,), overflow="drop_oldest")
        self._backlog: Deque[np.ndarray] = collections.deque()  # rows popped ahead of their frame
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._torn_down = False
        self._captured = 0  # grab thread only
        self._skipped = 0  # reader only: older frames drained by latest()
        self._delivered = 0  # reader only

    # ---- subclass hooks (grab thread) ---------------------------------------------------------
    def _setup(self) -> None:
        """Acquire thread-bound resources before the first grab."""

    @abc.abstractmethod
    def _grab(self, out: np.ndarray) -> bool:
        """Write the next RGB frame into `out` (H, W, 3 uint8, writable); False ends the stream."""

    def _teardown(self) -> None:
        """Release what _setup() or __init__ acquired; runs once."""

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "FrameSource":
        """Start the grab thread; returns once _setup() is done, re-raising its error."""
        if self._thread is not None:
            raise RuntimeError("start: the source was already started (sources are one-shot)")
        if self._frames.closed:
            raise RuntimeError("start: the source was closed")
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise RuntimeError(f"{type(self).__name__}: setup failed: {self._error}") from self._error
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """End capture: the reader drains what is stored, then latest() returns None."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"stop: the grab thread did not finish within {timeout} s "
                                   "(a read blocked on the device, or a held render lock?)")
        self._frames.close()
        self._stamps.close()

    def close(self) -> None:
        self.stop()
        if self._thread is None and not self._torn_down:  # never started: nobody else will
            self._torn_down = True
            self._teardown()

    def __enter__(self) -> "FrameSource":
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- counters -----------------------------------------------------------------------------
    @property
    def frames_captured(self) -> int:
        return self._captured

    @property
    def frames_dropped(self) -> int:
        """Captured frames latest() will never return: overwritten in the ring, refused while
        the reader held it, or skipped as older than the newest."""
        stats = self._frames.stats
        return int(stats["dropped"]) + int(stats["rejected"]) + self._skipped

    @property
    def frames_delivered(self) -> int:
        return self._delivered

    # ---- grab thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            try:
                self._setup()
            except BaseException as e:  # noqa: BLE001 - handed to start()
                self._error = e
                return
            finally:
                self._ready.set()
            self._loop()
        except BaseException as e:  # noqa: BLE001 - re-raised by latest() once drained
            self._error = e
        finally:
            # Close before teardown so a waiting reader wakes up even if teardown is slow.
            self._frames.close()
            self._stamps.close()
            if not self._torn_down:
                self._torn_down = True
                self._teardown()

    def _loop(self) -> None:
        scratch = np.empty(self.shape, np.uint8)
        deadline = time.monotonic()
        while not self._stop.is_set():
            if self._period:
                delay = deadline - time.monotonic()
                if delay > 0 and self._stop.wait(delay):
                    break
                # Absolute deadlines keep the mean rate exact; after a stall restart the schedule
                # instead of bursting (a real camera does not replay frames it missed).
                deadline = max(deadline + self._period, time.monotonic())
            # In place when a slot is free; when full, reserve() never drops, so grab aside and
            # let push() drop the oldest.
            region = self._frames.reserve(1)
            in_place = region.shape[0] == 1
            try:
                ok = self._grab(region[0] if in_place else scratch)
            except BaseException:
                if in_place:
                    self._frames.commit(0)
                raise
            if not ok:
                if in_place:
                    self._frames.commit(0)
                return
            stamp = time.monotonic()
            pos = self._frames.stats["pushed"]  # our own write position: this frame's position
            self._stamps.push(np.array([pos, self._captured, stamp]))
            self._captured += 1
            if in_place:
                self._frames.commit(1)
            else:
                self._frames.push(scratch)  # 0 if the reader holds the full ring: counted rejected

    # ---- reader -------------------------------------------------------------------------------
    def latest(self, timeout: Optional[float] = None) -> Optional[Frame]:
        """The newest frame not yet returned, discarding older ones; waits up to `timeout` s
        (None: forever) for one. None once the stream ended and was drained; TimeoutError if
        nothing arrived in time; RuntimeError if the grab thread failed."""
        ring = self._frames
        if self._thread is None and not ring.closed:  # nothing will ever come
            raise RuntimeError(f"latest: {type(self).__name__} was not started; call start() "
                               "or use it as a context manager")
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            view = ring.peek(ring.capacity)  # holds the stored frames: the producer cannot drop them
            held = view.shape[0]
            if held == 0:
                ring.release(0)
                left = None if end is None else max(0.0, end - time.monotonic())
                if not ring.wait_for_items(1, left):
                    if ring.closed and len(ring) == 0:
                        if self._error is not None:
                            raise RuntimeError(f"{type(self).__name__} failed: {self._error}") \
                                from self._error
                        return None
                    if not ring.closed:
                        raise TimeoutError(f"latest: no frame within {timeout} s")
                continue
            if held < len(ring):  # the peek stopped at the wrap, or newer frames came: skip on
                ring.release(held)
                self._skipped += held
                continue
            stats = ring.stats  # while we hold, the read position is pinned
            pos = int(stats["popped"]) + int(stats["dropped"]) + held - 1
            image = np.array(view[held - 1])
            ring.release(held)
            self._skipped += held - 1
            self._delivered += 1
            index, stamp = self._stamp_for(pos)
            return Frame(image, stamp, index)

    def _stamp_for(self, pos: int) -> Tuple[int, float]:
        while len(self._stamps):
            self._backlog.extend(self._stamps.pop(self._stamps.capacity))
        found: Tuple[int, float] = (-1, math.nan)  # only if its row was dropped (never expected)
        while self._backlog and self._backlog[0][0] <= pos:
            row = self._backlog.popleft()
            if row[0] == pos:  # the last row for pos wins: earlier ones were refused frames
                found = (int(row[1]), float(row[2]))
        return found


class VideoCaptureSource(FrameSource):
    """Frames from cv2.VideoCapture: a camera index (device-paced) or a video file / URL (paced
    to `fps`, else the file's rate). Converts BGR to RGB; resizes when width/height are given
    (one of them alone keeps the aspect ratio). A failed read ends the stream."""

    def __init__(self, source: Union[int, str, "os.PathLike[str]"], width: Optional[int] = None,
                 height: Optional[int] = None, fps: Optional[float] = None, loop: bool = False,
                 capacity: int = 4) -> None:
        import cv2  # optional dependency: only this source needs it

        _check_fps(fps)  # before the device is opened
        self._cv2 = cv2
        self._is_camera = isinstance(source, int)
        what = f"camera {source}" if self._is_camera else f"video {os.fspath(source)!r}"
        if not self._is_camera:
            source = os.fspath(source)
            if "://" not in source and not os.path.exists(source):
                raise FileNotFoundError(f"cannot open {what}: no such file")
        cap = cv2.VideoCapture(source)
        if not cap.isOpened():
            cap.release()
            why = "no such device, or it is busy" if self._is_camera else "no backend decodes it"
            raise OSError(f"cannot open {what}: VideoCapture could not open it ({why})")
        if self._is_camera:  # ask the device first: a native mode beats resizing every frame
            for prop, value in ((cv2.CAP_PROP_FRAME_WIDTH, width),
                                (cv2.CAP_PROP_FRAME_HEIGHT, height), (cv2.CAP_PROP_FPS, fps)):
                if value:
                    cap.set(prop, value)
        native_w = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH))
        native_h = int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if native_w <= 0 or native_h <= 0:  # some backends only know after the first frame
            ok, probe = cap.read()
            if not ok:
                cap.release()
                raise OSError(f"cannot open {what}: no frame could be read")
            native_h, native_w = probe.shape[:2]
            if not self._is_camera:
                cap.set(cv2.CAP_PROP_POS_FRAMES, 0)
        if width and not height:
            height = max(1, round(native_h * width / native_w))
        elif height and not width:
            width = max(1, round(native_w * height / native_h))
        reported = cap.get(cv2.CAP_PROP_FPS)  # 0, or even NaN, when a stream does not say
        reported = reported if math.isfinite(reported) and reported > 0 else None
        rate = fps or reported or (None if self._is_camera else 30.0)
        super().__init__(height or native_h, width or native_w, fps=rate,
                         paced=not self._is_camera, capacity=capacity)
        self._cap = cap
        self._loop_file = loop and not self._is_camera
        self._bgr: Optional[np.ndarray] = None  # decode buffer, reused across reads
        self._resized = np.empty(self.shape, np.uint8)

    def _grab(self, out: np.ndarray) -> bool:
        cv2 = self._cv2
        ok, self._bgr = self._cap.read(self._bgr)
        if not ok and self._loop_file:
            self._cap.set(cv2.CAP_PROP_POS_FRAMES, 0)
            ok, self._bgr = self._cap.read(self._bgr)
        if not ok or self._bgr is None:
            return False
        bgr = self._bgr
        if bgr.shape != self.shape:
            bgr = cv2.resize(bgr, self.shape[1::-1], dst=self._resized, interpolation=cv2.INTER_AREA)
        rgb = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB, dst=out)
        if rgb.__array_interface__["data"][0] != out.__array_interface__["data"][0]:
            out[...] = rgb  # OpenCV allocated instead of writing in place
        return True

    def _teardown(self) -> None:
        self._cap.release()


class MujocoRenderSource(FrameSource):
    """Offscreen renders of a live MjData (mujoco.Renderer) at `fps`.

    The control loop steps `data` concurrently: pass the `lock` it holds while stepping, and it
    is held here only while update_scene() copies the state into the scene; the render itself,
    the slow part, runs outside it. Never stop() while holding that lock.
    """

    def __init__(self, model: Any, data: Any, width: int, height: int,
                 camera: Union[None, int, str] = None, fps: float = 30.0,
                 lock: Optional[ContextManager[Any]] = None, capacity: int = 4) -> None:
        import mujoco

        self._mujoco = mujoco
        if isinstance(camera, str):
            cam_id = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, camera)
            if cam_id < 0:
                raise ValueError(f"no camera named {camera!r} in the model")
        else:
            cam_id = -1 if camera is None else int(camera)  # -1: MuJoCo's default free camera
            if not -1 <= cam_id < model.ncam:
                raise ValueError(f"camera id {cam_id} out of range [-1, {model.ncam})")
        # Checked here, not on the grab thread, so the error reaches the caller directly.
        offw, offh = model.vis.global_.offwidth, model.vis.global_.offheight
        if width > offw or height > offh:
            raise ValueError(f"{width}x{height} exceeds the offscreen buffer {offw}x{offh}; raise "
                             "<visual><global offwidth=.. offheight=../></visual> in the model")
        super().__init__(height, width, fps=fps, capacity=capacity)
        self._model, self._data, self._camera = model, data, cam_id
        self._lock: ContextManager[Any] = lock if lock is not None else contextlib.nullcontext()
        self._renderer: Any = None

    def _setup(self) -> None:
        # A GL context is current on one thread only: create it on the thread that renders.
        try:
            self._renderer = self._mujoco.Renderer(self._model, self.shape[0], self.shape[1])
        except Exception as e:
            raise RuntimeError(f"cannot create an offscreen renderer ({e}); with no display set "
                               "MUJOCO_GL=egl (or osmesa) before mujoco is first imported "
                               f"(now {os.environ.get('MUJOCO_GL')!r})") from e

    def _grab(self, out: np.ndarray) -> bool:
        with self._lock:
            self._renderer.update_scene(self._data, self._camera)
        self._renderer.render(out=out)
        return True

    def _teardown(self) -> None:
        if self._renderer is not None:
            self._renderer.close()  # on the grab thread, where its context is current
            self._renderer = None
