"""The served chaos section: `mstar-rt serve` with its nodes in worker processes (restart auto)
while a worker is SIGKILLed every few seconds -- first the camera policy of
examples/serve/vision_policy.yaml split over two workers (encode; denoise and finish) under 8
openpi_client connections, then the Orpheus-style TTS of speech_orpheus_tiny.yaml with its LM on
one worker and its codec on the other under 4 streaming HTTP clients, one request in 8 abandoned
after its first audio.

Every answer is checked against the same server's answers to the same inputs before the chaos
(actions within 1e-4; PCM samples within 2 LSB: a stream's decode windows may batch
differently). A failure must name what happened: the policy's error frame names the killed
worker; a speech stream that loses its worker ends broken (no terminating chunk). After the
chaos: /health ok, clean requests right, no live request, and the server's fds and threads
back where they were after the warm-up (each restart brings new sockets and mailboxes, which
must go with the dead worker)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml

from bench_common import ROOT
from soak_proc import ServedModel, snapshot, wait_until

KILL_EVERY_S = 4.0
TEXTS = ["Hello there. How can I help you today?", "The robot picked up the red cube.",
         "Please wait while I check the schedule.", "It is sunny outside. The wind is calm."]


def _configs(directory: Path) -> tuple[Path, Path]:
    serve = ROOT / "examples" / "serve"
    policy = yaml.safe_load((serve / "vision_policy.yaml").read_text())
    policy["model"]["path"] = [str(serve)]
    policy["node_groups"] = [{"nodes": ["encode"], "rank": 1, "process": True},
                             {"nodes": ["denoise", "finish"], "rank": 2, "process": True}]
    speech = yaml.safe_load((serve / "speech_orpheus_tiny.yaml").read_text())
    speech["node_groups"] = [{"nodes": ["prefill", "decode"], "rank": 1, "process": True},
                             {"nodes": ["snac_decoder"], "rank": 2, "process": True}]
    out = []
    for name, raw in (("policy", policy), ("speech", speech)):
        raw["placement"] = {"restart": "auto", "max_restarts": 1_000_000}
        path = directory / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        out.append(path)
    return out[0], out[1]


def _workers(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    out = []
    for p in found.split():
        try:
            if b"mstar_rt.placement.worker" in Path(f"/proc/{p}/cmdline").read_bytes():
                out.append(int(p))
        except OSError:  # it ended meanwhile
            pass
    return out


class _Killer:
    def __init__(self, pid: int, seed: int) -> None:
        self.pid, self.rng, self.kills = pid, random.Random(seed), 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(KILL_EVERY_S * self.rng.uniform(0.5, 1.5)):
            workers = _workers(self.pid)
            if workers:
                try:
                    os.kill(self.rng.choice(workers), signal.SIGKILL)
                    self.kills += 1
                except ProcessLookupError:
                    pass

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.kills


def _clients(n: int, seconds: float, one: Callable[[int, random.Random], str]) -> dict:
    counts: dict[str, int] = {}
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def client(k: int) -> None:
        rng = random.Random(k)
        while time.monotonic() < end:
            outcome = one(k, rng)
            with lock:
                counts[outcome] = counts.get(outcome, 0) + 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


def _observation(i: int) -> dict:
    g = np.random.default_rng(i)
    return {"observation/image": g.integers(0, 256, (64, 64, 3), dtype=np.uint8),
            "observation/state": g.standard_normal(8).astype(np.float32)}


def _policy(server: ServedModel, seconds: float, warmup_s: float) -> dict:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    observations = [_observation(i) for i in range(16)]
    first = WebsocketClientPolicy("127.0.0.1", server.port)
    want = [first.infer(o)["actions"] for o in observations]
    first._ws.close()
    conns: dict[int, Any] = {}

    def one(k: int, rng: random.Random) -> str:
        j = rng.randrange(len(observations))
        try:
            if k not in conns or rng.random() < 0.01:
                if k in conns:
                    conns.pop(k)._ws.close()
                conns[k] = WebsocketClientPolicy("127.0.0.1", server.port)
            actions = conns[k].infer(observations[j])["actions"]
        except RuntimeError as e:  # an error frame: the connection stays open
            return "failed_by_kill" if "killed by signal 9" in str(e) else "error"
        except Exception:  # noqa: BLE001  (a broken connection: counted, reconnected)
            conns.pop(k, None)
            return "error"
        return "finished" if np.abs(actions - want[j]).max() < 1e-4 else "wrong"

    def clean() -> bool:
        client = WebsocketClientPolicy("127.0.0.1", server.port)
        try:
            return all(np.abs(client.infer(o)["actions"] - w).max() < 1e-4
                       for o, w in zip(observations, want))
        finally:
            client._ws.close()

    return _chaos(server, 8, seconds, warmup_s, one, clean, conns)


def _speak(url: str, text: str, leave: bool) -> bytes:
    from mstar_rt.serve.client import MstarClient

    got = bytearray()
    with MstarClient(url, timeout=120) as client:
        stream = client.speech(text, response_format="pcm")
        try:
            for chunk in stream:
                got += chunk
                if leave and got:
                    break
        finally:
            stream.close()
    return bytes(got)


def _same(a: bytes, b: bytes) -> bool:
    if len(a) != len(b):
        return False
    x, y = (np.frombuffer(v, np.int16).astype(np.int32) for v in (a, b))
    return int(np.abs(x - y).max(initial=0)) <= 2


def _speech(server: ServedModel, seconds: float, warmup_s: float) -> dict:
    from mstar_rt.serve.client import ServeError

    want = {t: _speak(server.url, t, False) for t in TEXTS}

    def one(k: int, rng: random.Random) -> str:
        text, leave = rng.choice(TEXTS), rng.random() < 0.125
        try:
            got = _speak(server.url, text, leave)
        except ServeError as e:  # a broken stream, or a 500 naming the killed worker
            return "failed_by_kill" if ("broke off" in str(e) or "killed by signal 9" in str(e)) \
                else "error"
        if leave:
            return "cancelled"
        return "finished" if _same(got, want[text]) else "wrong"

    def clean() -> bool:
        return all(_same(_speak(server.url, t, False), want[t]) for t in TEXTS)

    return _chaos(server, 4, seconds, warmup_s, one, clean, {})


def _chaos(server: ServedModel, clients: int, seconds: float, warmup_s: float,
           one: Callable[[int, random.Random], str], clean: Callable[[], bool],
           conns: dict) -> dict:
    import httpx

    _clients(clients, warmup_s, one)

    idle = server.idle
    for c in list(conns.values()):
        c._ws.close()
    conns.clear()
    wait_until(idle, 30.0)
    time.sleep(0.5)
    start = snapshot(server.pid)
    killer = _Killer(server.pid, 5)
    t0 = time.perf_counter()
    try:
        counts = _clients(clients, seconds, one)
    finally:
        kills = killer.close()
    elapsed = time.perf_counter() - t0
    for c in list(conns.values()):
        c._ws.close()
    recovered = wait_until(lambda: len(_workers(server.pid)) == 2 and httpx.get(
        server.url + "/health", timeout=10).status_code == 200, 60.0)
    clean_ok = recovered and clean()
    settled = wait_until(idle, 30.0)
    time.sleep(0.5)
    end = snapshot(server.pid)
    wrong = counts.get("wrong", 0)
    other = counts.get("error", 0)
    return {
        "requests": sum(counts.values()), "requests_per_s": sum(counts.values()) / elapsed,
        "finished": counts.get("finished", 0), "cancelled": counts.get("cancelled", 0),
        "failed_by_kill": counts.get("failed_by_kill", 0), "other_failures": other,
        "kills": kills, "wrong_outputs": wrong, "recovered": int(clean_ok),
        "fds_start": start["fds"], "fds_end": end["fds"],
        "leaked_fds": end["fds"] - start["fds"],
        "threads_start": start["threads"], "threads_end": end["threads"],
        "leaked_threads": end["threads"] - start["threads"],
        "rss_start_mb": start["rss_mb"], "rss_end_mb": end["rss_mb"],
        "errors": wrong + other + (0 if clean_ok else 1) + (0 if settled else 1),
    }


def run_served(quick: bool, seconds: float) -> dict:
    """Each server for half of ``seconds`` of chaos, after a warm-up with its clients."""
    directory = Path(tempfile.mkdtemp(prefix="mstar_soak_served_"))
    policy, speech = _configs(directory)
    figures: dict[str, Any] = {}
    workers_left, shm_left = 0, 0
    for name, config, run in (("policy", policy, _policy), ("speech", speech, _speech)):
        with ServedModel(config) as server:
            part = run(server, seconds / 2, 10.0 if quick else 30.0)
            children = _workers(server.pid)
        workers_left += sum(Path(f"/proc/{p}").exists() for p in children)
        shm_left += sum(n.startswith(f"mstar_{server.pid}_") for n in os.listdir("/dev/shm"))
        figures.update({f"{name}_{k}": v for k, v in part.items()})
    figures["wrong_outputs"] = figures["policy_wrong_outputs"] + figures["speech_wrong_outputs"]
    figures["errors"] = figures["policy_errors"] + figures["speech_errors"]
    figures["leaked_fds"] = figures["policy_leaked_fds"] + figures["speech_leaked_fds"]
    figures["leaked_threads"] = figures["policy_leaked_threads"] + figures["speech_leaked_threads"]
    figures["workers_left"], figures["shm_files_left"] = workers_left, shm_left
    figures["requests"] = figures["policy_requests"] + figures["speech_requests"]
    return {"figures": figures}
