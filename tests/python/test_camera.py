"""Camera sources: a video file through VideoCaptureSource and MuJoCo offscreen renders, each
grabbing into a drop-oldest ring so latest() always returns the newest frame."""

import threading
import time

import numpy as np
import pytest

# Imported before mujoco: it defaults MUJOCO_GL to egl, which only works before mujoco loads.
from mstar_rt.robot.camera import Frame, MujocoRenderSource, VideoCaptureSource

cv2 = pytest.importorskip("cv2")

N_FRAMES, W, H = 30, 64, 48


def _index_of(image: np.ndarray) -> int:
    # Written as BGR (8*i, 100, 255 - 8*i): after BGR->RGB the blue level, channel 2, is 8*i.
    # A uniform frame survives JPEG within a few levels, well under the step of 8.
    return int(round(float(image[..., 2].mean()) / 8))


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("video") / "counter.avi")
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 25, (W, H))
    assert writer.isOpened()
    for i in range(N_FRAMES):
        frame = np.empty((H, W, 3), np.uint8)
        frame[...] = (8 * i, 100, 255 - 8 * i)
        writer.write(frame)
    writer.release()
    return path


def _read_all(source, timeout: float = 5.0) -> list:
    frames = []
    while (frame := source.latest(timeout=timeout)) is not None:
        frames.append(frame)
    return frames


def test_file_frames_arrive_in_order_as_rgb(video):
    with VideoCaptureSource(video, fps=100) as cam:
        assert cam.shape == (H, W, 3)
        frames = _read_all(cam)
    assert frames and isinstance(frames[0], Frame)
    indices = [f.index for f in frames]
    assert indices == sorted(set(indices)), "indices strictly increase"
    assert indices[-1] == N_FRAMES - 1, "the last frame read is the file's last"
    for f in frames:
        assert f.image.shape == (H, W, 3) and f.image.dtype == np.uint8
        assert _index_of(f.image) == f.index
        red, green, blue = (float(f.image[..., c].mean()) for c in range(3))
        assert abs(red - (255 - 8 * f.index)) < 6 and abs(green - 100) < 6  # RGB, not BGR
    stamps = [f.timestamp for f in frames]
    assert stamps == sorted(stamps)
    assert cam.frames_captured == N_FRAMES
    assert cam.frames_delivered + cam.frames_dropped == N_FRAMES


def test_slow_reader_gets_the_newest_and_older_frames_are_dropped(video):
    with VideoCaptureSource(video, fps=100, loop=True, capacity=4) as cam:
        seen = []
        for _ in range(3):
            time.sleep(0.15)  # ~15 frames arrive meanwhile into 4 slots
            captured = cam.frames_captured
            frame = cam.latest(timeout=5.0)
            # Frame captured-1 may still be between its grab and its publication.
            assert frame.index >= captured - 2
            assert _index_of(frame.image) == frame.index % N_FRAMES  # loop restarts the file
            seen.append(frame.index)
        assert seen == sorted(set(seen))
        assert cam.frames_dropped > 0
        while cam.latest(timeout=5.0).index < N_FRAMES + 2:  # keeps going past the file's end
            pass
    assert not cam.running


def test_resize_keeps_aspect_and_content(video):
    with VideoCaptureSource(video, width=32, fps=200) as cam:
        frames = _read_all(cam)
    assert frames[0].image.shape == (24, 32, 3)
    assert all(_index_of(f.image) == f.index for f in frames)


def test_stop_joins_the_thread_and_ends_the_stream(video):
    before = threading.active_count()
    cam = VideoCaptureSource(video, fps=50, loop=True).start()
    assert cam.running and threading.active_count() == before + 1
    assert cam.latest(timeout=5.0) is not None
    cam.close()
    assert not cam.running and threading.active_count() == before
    while cam.latest(timeout=1.0) is not None:  # drains what was stored, then reports the end
        pass
    with pytest.raises(RuntimeError, match="already started"):
        cam.start()


def test_a_missing_or_unreadable_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="cannot open video .*no such file"):
        VideoCaptureSource(str(tmp_path / "missing.avi"))
    bad = tmp_path / "bad.avi"
    bad.write_text("not a video")
    with pytest.raises(OSError, match="cannot open video"):
        VideoCaptureSource(bad)


def test_latest_before_start_says_so_and_after_close_ends(video):
    cam = VideoCaptureSource(video)  # never started: latest() waited forever (or timed out)
    with pytest.raises(RuntimeError, match=r"was not started; call start\(\)"):
        cam.latest(timeout=0.05)
    cam.close()
    assert cam.latest(timeout=0.05) is None


def test_latest_times_out_when_nothing_arrives(video):
    with VideoCaptureSource(video, fps=0.5) as cam:  # one frame per 2 s: the first at once
        assert cam.latest(timeout=5) is not None
        with pytest.raises(TimeoutError):
            cam.latest(timeout=0.05)


@pytest.mark.parametrize("fps", [0, -30, float("nan"), float("inf"), "30"])
def test_an_fps_that_cannot_pace_is_refused_before_the_device_opens(video, fps):
    # 1/fps paced nothing: the grab thread spun (120,000 frames in 0.5 s at fps=0)
    with pytest.raises(ValueError, match="fps must be a finite number > 0"):
        VideoCaptureSource(video, fps=fps)


# ---- MuJoCo ----------------------------------------------------------------------------------

MJCF = """
<mujoco>
  <option gravity="0 0 0"/>
  <worldbody>
    <light pos="0 0 3"/>
    <geom type="plane" size="2 2 .1" rgba=".3 .3 .3 1"/>
    <body name="box" pos="-0.8 0 0.3">
      <joint name="slide" type="slide" axis="1 0 0"/>
      <geom type="box" size=".15 .15 .15" rgba="1 0 0 1"/>
    </body>
    <camera name="front" pos="0 -2.5 0.8" xyaxes="1 0 0 0 0.3 1"/>
  </worldbody>
</mujoco>
"""


@pytest.fixture()
def sim():
    mujoco = pytest.importorskip("mujoco")
    model = mujoco.MjModel.from_xml_string(MJCF)
    data = mujoco.MjData(model)
    data.qvel[0] = 2.0  # slides across the camera's view without gravity or friction
    mujoco.mj_forward(model, data)
    return mujoco, model, data


def _started(source):
    # scripts/setup.sh installs EGL and Mesa, so a missing offscreen GL is a set-up defect to
    # report, not a reason to skip the rendering tests.
    try:
        return source.start()
    except RuntimeError as e:
        if "offscreen renderer" in str(e):
            pytest.fail(f"no offscreen GL (MUJOCO_GL=egl with Mesa): {e}; run scripts/setup.sh")
        raise


def _frame_after(source, captured: int) -> Frame:
    # Frame `captured` may have copied the scene before the caller's last step; the next cannot.
    while (frame := source.latest(timeout=10.0)).index < captured + 1:
        pass
    return frame


def test_mujoco_renders_moving_frames_of_the_right_shape(sim):
    mujoco, model, data = sim
    lock = threading.Lock()
    cam = _started(MujocoRenderSource(model, data, W, H, camera="front", fps=60, lock=lock))
    with cam:
        images = []
        for _ in range(3):
            with lock:
                for _ in range(50):
                    mujoco.mj_step(model, data)  # 0.1 s of motion: 0.2 m
            images.append(_frame_after(cam, cam.frames_captured).image)
    assert not cam.running
    for image in images:
        assert image.shape == (H, W, 3) and image.dtype == np.uint8
        assert image.std() > 0  # a scene, not a blank buffer
    assert not np.array_equal(images[0], images[1]) and not np.array_equal(images[1], images[2])


def test_mujoco_holds_the_lock_only_to_copy_the_scene(sim):
    _, model, data = sim
    lock = threading.Lock()
    with _started(MujocoRenderSource(model, data, W, H, fps=200, lock=lock)) as cam:
        cam.latest(timeout=10.0)
        with lock:  # the control loop "steps": no scene copy may happen meanwhile
            before = cam.frames_captured
            time.sleep(0.4)
            during = cam.frames_captured - before
        assert during <= 1  # at most the one frame that was already past its update_scene
        _frame_after(cam, cam.frames_captured)  # and capture resumes once it is released


def test_mujoco_argument_errors(sim):
    _, model, data = sim
    with pytest.raises(ValueError, match="no camera named 'nope'"):
        MujocoRenderSource(model, data, W, H, camera="nope")
    with pytest.raises(ValueError, match="camera id 5 out of range"):
        MujocoRenderSource(model, data, W, H, camera=5)
    with pytest.raises(ValueError, match="offscreen buffer"):
        MujocoRenderSource(model, data, 4096, 4096)
