"""A 2-link planar arm reaching a random target, simulated with MuJoCo (physics only).

The arm moves in the horizontal plane (hinges about z), so gravity does no work and a joint
position command is held without drift. Its actuators are position servos (kp, kv): an action is
the pair of joint angles to go to. That makes a chunk of actions a plan in time — "be here at
tick t0 + k" — which stays meaningful when it arrives late, the property chunked, asynchronous
execution relies on; torque actuators would turn every late action into an unstable push.

Observation (float32, 8): shoulder and elbow angle, their velocities, target xy, end-effector xy.
The target is sampled from the episode seed in an annulus the arm reaches without stretching
straight (a singularity) or folding onto its base. The episode starts with the elbow bent
positively, the same IK branch the expert aims for, so every target has one nearby solution.
"""

from __future__ import annotations

import math

import mujoco
import numpy as np

L1 = 0.2  # link lengths, m
L2 = 0.2
OBS_DIM = 8
ACTION_DIM = 2
SUCCESS_RADIUS = 0.02  # m
TIMESTEP = 0.002  # physics step, s; the demo steps period / TIMESTEP substeps per control tick
TARGET_RADIUS = (0.12, 0.36)  # the annulus targets come from
TARGET_ANGLE = 0.8 * math.pi  # |polar angle of the target| <= this (keeps IK angles continuous)

MJCF = f"""
<mujoco model="planar_reacher">
  <compiler angle="radian"/>
  <option timestep="{TIMESTEP}" integrator="implicitfast"/>
  <default>
    <joint type="hinge" axis="0 0 1" damping="0.02"/>
    <geom type="capsule" size="0.015" density="1000" contype="0" conaffinity="0"/>
    <!-- kv damps the servo near critically for the arm's inertia (about 0.01-0.03 kg m^2) -->
    <position kp="8" kv="0.4" forcerange="-4 4" forcelimited="true"/>
  </default>
  <worldbody>
    <body name="upper" pos="0 0 0">
      <joint name="shoulder"/>
      <geom fromto="0 0 0 {L1} 0 0"/>
      <body name="fore" pos="{L1} 0 0">
        <joint name="elbow" range="-2.95 2.95" limited="true"/>
        <geom fromto="0 0 0 {L2} 0 0"/>
        <site name="ee" pos="{L2} 0 0" size="0.01"/>
      </body>
    </body>
    <body name="target" mocap="true" pos="0.2 0.2 0">
      <site name="target" size="0.012" rgba="1 0 0 1"/>
    </body>
  </worldbody>
  <actuator>
    <position name="shoulder" joint="shoulder"/>
    <position name="elbow" joint="elbow"/>
  </actuator>
</mujoco>
"""


def forward_kinematics(q: np.ndarray) -> np.ndarray:
    """End-effector xy for joint angles q (..., 2)."""
    q = np.asarray(q, dtype=np.float64)
    a, b = q[..., 0], q[..., 0] + q[..., 1]
    return np.stack([L1 * np.cos(a) + L2 * np.cos(b), L1 * np.sin(a) + L2 * np.sin(b)], axis=-1)


def inverse_kinematics(xy: np.ndarray) -> np.ndarray:
    """Joint angles (..., 2) reaching xy (..., 2) on the elbow-positive branch (the one episodes
    start on). Vectorised: training labels a whole data set in one call."""
    xy = np.asarray(xy, dtype=np.float64)
    x, y = xy[..., 0], xy[..., 1]
    c2 = np.clip((x * x + y * y - L1 * L1 - L2 * L2) / (2 * L1 * L2), -1.0, 1.0)
    q2 = np.arccos(c2)
    q1 = np.arctan2(y, x) - np.arctan2(L2 * np.sin(q2), L1 + L2 * np.cos(q2))
    return np.stack([q1, q2], axis=-1)


class ArmEnv:
    """reset(seed) -> obs; apply(action); step_physics(n); observe(); success()."""

    def __init__(self) -> None:
        self.model = mujoco.MjModel.from_xml_string(MJCF)
        self.data = mujoco.MjData(self.model)
        self._ee = self.model.site("ee").id
        self.target = np.zeros(2)

    def reset(self, seed: int) -> np.ndarray:
        """A new episode: start pose and target both drawn from `seed` (same seed, same episode)."""
        rng = np.random.default_rng(seed)
        mujoco.mj_resetData(self.model, self.data)
        q0 = np.array([rng.uniform(-0.6, 0.6), rng.uniform(0.4, 2.2)])
        self.data.qpos[:] = q0
        self.data.ctrl[:] = q0  # the servos hold the start pose until the first action
        r = rng.uniform(*TARGET_RADIUS)
        phi = rng.uniform(-TARGET_ANGLE, TARGET_ANGLE)
        self.target = np.array([r * math.cos(phi), r * math.sin(phi)])
        # Redraw a target that is already reached: such an episode would test nothing.
        while np.linalg.norm(forward_kinematics(q0) - self.target) < 3 * SUCCESS_RADIUS:
            phi = rng.uniform(-TARGET_ANGLE, TARGET_ANGLE)
            self.target = np.array([r * math.cos(phi), r * math.sin(phi)])
        self.data.mocap_pos[0, :2] = self.target
        mujoco.mj_forward(self.model, self.data)
        return self.observe()

    def observe(self) -> np.ndarray:
        d = self.data
        obs = np.concatenate([d.qpos[:2], d.qvel[:2], self.target, self.end_effector()])
        return obs.astype(np.float32)

    def apply(self, action: np.ndarray) -> None:
        """Sets the servo set-points (joint angles, rad); held until the next apply()."""
        self.data.ctrl[:] = action

    def step_physics(self, n_substeps: int) -> None:
        mujoco.mj_step(self.model, self.data, nstep=n_substeps)

    def end_effector(self) -> np.ndarray:
        return self.data.site_xpos[self._ee, :2].copy()

    def distance(self) -> float:
        return float(np.linalg.norm(self.end_effector() - self.target))

    def success(self) -> bool:
        return self.distance() < SUCCESS_RADIUS
