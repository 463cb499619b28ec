"""Replicas on Ray Serve: ``mstar-rt serve CONFIG --ray-address ...`` with ``ray.replicas: 2``
runs the same app (HTTP + the openpi websocket) as two Ray Serve replicas, one on each node of
a two-node local cluster (both nodes on this machine, every node address on loopback). Clients on
HTTP and the websocket are answered by both replicas; a replica killed mid-run is replaced by
Ray while the other keeps serving; SIGTERM deletes the app and exits 0; bad replica settings are
refused with a message naming the key.

The cluster is started by a module fixture (tests/python/ray_cluster.py: ``ray start --head`` +
``ray start --address``) and its processes are ended at teardown, even after a failure."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import httpx
import numpy as np
import pytest
import yaml

# The shared cluster helper sets this run's Ray token; it must come before Ray is imported.
from ray_cluster import HEAD_IP, NODE2_IP, free_port, local_cluster

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'mstar_rt[ray]'; CI "
                                        "installs it)")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install "
                                                "'ray[serve]')")

from mstar_rt.serve import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KEY = "ray-key"
APP = "mstar-test"
START_TIMEOUT_S = 150.0
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used:DeprecationWarning")
_free_port = free_port


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimpleNamespace]:
    """Two Ray nodes on this machine (tests/python/ray_cluster.py), each with one
    ``replica_slot`` so two replicas land one per node."""
    # The proxy would otherwise send every request to the replica on its own node.
    with local_cluster({"replica_slot": 1}, {"replica_slot": 1, "second_node": 1},
                       RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING="0") as c:
        yield c


@pytest.fixture(scope="module")
def served(cluster: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[SimpleNamespace]:
    """``mstar-rt serve`` of the robot policy as 2 replicas on the cluster (a child process)."""
    config = yaml.safe_load((ROOT / "examples" / "serve" / "robot_policy.yaml").read_text())
    port = _free_port()
    config["model"]["path"] = [str(ROOT / "examples" / "robot")]
    config["server"] = {"host": "127.0.0.1", "port": port, "api_key": KEY}
    config["ray"] = {"replicas": 2, "num_cpus": 0.5, "resources": {"replica_slot": 1},
                     "health_check_period_s": 1, "app_name": APP}
    path = tmp_path_factory.mktemp("ray_serve") / "policy.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "mstar_rt.serve.cli", "serve", str(path),
                             "--ray-address", cluster.address], env=cluster.env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        end = time.monotonic() + START_TIMEOUT_S
        while not any("serving" in line for line in lines):
            assert proc.poll() is None, f"mstar-rt serve exited {proc.returncode}: {lines}"
            assert time.monotonic() < end, "the replicas did not start"
            time.sleep(0.2)
        yield SimpleNamespace(proc=proc, lines=lines, port=port,
                              url=f"http://127.0.0.1:{port}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _replica_of(response: httpx.Response) -> str:
    return response.headers["x-mstar-replica"]


def _policy(s: SimpleNamespace):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    client = WebsocketClientPolicy("127.0.0.1", s.port, api_key=KEY)
    replica = client._ws.response.headers["x-mstar-replica"]  # the handshake's answer
    return client, replica


def _obs(seed: int) -> dict:
    state = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
    return {"observation/state": state}


def _replacement(known: set[str]) -> str | None:
    """A replica not in ``known`` that answers, once Serve reports two running, else None."""
    status = serve.status().applications.get(APP)
    if status is None or dict(status.deployments["MstarServer"].replica_states).get(
            "RUNNING") != 2:
        return None
    try:
        where = serve.get_app_handle(APP).options(method_name="where").remote().result(
            timeout_s=5)
    except Exception:  # routed to the dead replica before the router heard of it
        return None
    return where["replica"] if where["replica"] not in known else None


def _actors() -> list[str]:
    from mstar_rt.serve.ray_serve import replica_actors

    return replica_actors(APP)


# ---- placement ---------------------------------------------------------------------------------

def test_two_replicas_run_one_on_each_node(served):
    handle = serve.get_app_handle(APP)
    seen: dict[str, dict] = {}
    for _ in range(40):
        where = handle.options(method_name="where").remote().result(timeout_s=30)
        seen[where["replica"]] = where
        if len(seen) == 2:
            break
    assert len(seen) == 2, seen
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert sorted(nodes[w["node_id"]] for w in seen.values()) == [HEAD_IP, NODE2_IP]
    assert len({w["pid"] for w in seen.values()}) == 2
    assert len(_actors()) == 2


# ---- clients -----------------------------------------------------------------------------------

def test_http_clients_are_answered_by_both_replicas(served):
    arr = np.arange(8, dtype=np.float32)
    body = {"inputs": {"obs": {"dtype": "float32", "shape": [8],
                               "data": base64.b64encode(arr.tobytes()).decode()}},
            "arrays": "list"}
    replicas = set()
    with httpx.Client(base_url=served.url, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == "robot-chunk-policy"
        assert httpx.get(served.url + "/v1/models").status_code == 401  # the key, per replica
        for _ in range(30):
            health = http.get("/health")
            assert health.json()["status"] == "ok"
            replicas.add(_replica_of(health))
            r = http.post("/generate", json=body)
            assert r.status_code == 200, r.text
            last = json.loads(r.text.strip().splitlines()[-1])
            assert last["done"] is True, r.text
            replicas.add(_replica_of(r))
        assert "mstar_requests_total" in http.get("/metrics").text
    assert len(replicas) == 2, replicas


def test_openpi_websocket_clients_are_answered_by_both_replicas(served):
    clients = [_policy(served) for _ in range(8)]
    try:
        assert len({r for _, r in clients}) == 2, [r for _, r in clients]
        answers = {}
        for client, replica in clients:
            assert client.get_server_metadata()["model"] == "robot-chunk-policy"
            out = client.infer(_obs(1))
            assert out["actions"].shape == (20, 2) and out["actions"].dtype == np.float32
            answers.setdefault(replica, out["actions"])
        a, b = answers.values()
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # same weights on both
    finally:
        for client, _ in clients:
            client._ws.close()


# ---- failure -----------------------------------------------------------------------------------

def test_a_killed_replica_is_replaced_while_the_other_keeps_serving(served):
    clients = []
    for _ in range(16):  # until both replicas hold some connections
        clients.append(_policy(served))
        if len({r for _, r in clients}) == 2 and len(clients) >= 4:
            break
    victim = clients[0][1]
    survivor = next(r for _, r in clients if r != victim)
    name = next(n for n in _actors() if n.endswith(f"#{victim}"))
    counts: list[list] = [[0, None] for _ in clients]
    stop = threading.Event()

    def drive(i: int, client) -> None:
        while not stop.is_set():
            try:
                client.infer(_obs(i))
                counts[i][0] += 1
            except Exception as e:  # the killed replica's connections end here
                counts[i][1] = e
                return
            time.sleep(0.01)

    threads = [threading.Thread(target=drive, args=(i, c), daemon=True)
               for i, (c, _) in enumerate(clients)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        before = [n for n, _ in counts]
        t0 = time.monotonic()
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        health, new = [], None
        while new is None:
            assert time.monotonic() - t0 < 90, f"no replacement for {name} after 90 s"
            health.append(httpx.get(served.url + "/health", timeout=10).status_code)
            new = _replacement({victim, survivor})
            time.sleep(0.2)
        replaced_s = time.monotonic() - t0
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for client, _ in clients:
            client._ws.close()
    for i, (_, replica) in enumerate(clients):
        if replica == victim:
            assert counts[i][1] is not None, "a connection to the killed replica kept working"
        else:  # the survivor's connections never failed and kept being answered
            assert counts[i][1] is None, f"{replica}: {counts[i][1]!r}"
            assert counts[i][0] > before[i] + 10, (counts[i][0], before[i])
    assert health.count(200) == len(health), health  # new HTTP requests: the survivor
    assert name not in _actors() and len(_actors()) == 2
    client, replica = _policy(served)  # new clients are answered after the replacement
    try:
        assert client.infer(_obs(0))["actions"].shape == (20, 2)
    finally:
        client._ws.close()
    print(f"replica {victim} killed; {new} answering {replaced_s:.1f} s later; HTTP during "
          f"that time: {len(health)} requests, all 200")


def test_sigterm_deletes_the_app_and_stops_serve_and_exits_0(served):
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(60) == 0
    assert any("stopped" in line for line in served.lines), served.lines
    # The app is deleted and, as no other app uses it, Serve (controller and proxy) is shut down:
    # no Serve actor is left on the cluster and the port is closed.
    end = time.monotonic() + 20
    while [a for a in ray.util.list_named_actors(all_namespaces=True)
           if a["namespace"] == "serve"]:
        assert time.monotonic() < end, ray.util.list_named_actors(all_namespaces=True)
        time.sleep(0.2)
    with pytest.raises(httpx.ConnectError):
        httpx.get(served.url + "/health", timeout=5)


def test_benchmark_quick_run_measures_both_replica_counts(cluster, served, tmp_path):
    # The benchmark serves its own app at route "/": the served one must be gone first.
    if served.proc.poll() is None:
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(60) == 0
    out = tmp_path / "serve_replicas.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_replicas.py"),
                           "--quick", "--clients", "4", "--port", str(_free_port()),
                           "--ray-address", cluster.address, "--out", str(out)],
                          env=cluster.env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["name"] == "serve_replicas" and result["quick"] is True
    assert result["ratios"]["rps_2_replicas_vs_1"] > 0
    figures = result["figures"]
    assert figures["rps_1_replica"] > 0 and figures["rps_2_replicas"] > 0
    assert 0 < figures["cpu_busy_pct_2_replicas"] <= 100
    assert "rps_2_replicas_vs_1" in proc.stdout


# ---- config ------------------------------------------------------------------------------------

def _cli(capsys, tmp_path: Path, ray_section: object, *flags: str) -> tuple[int, str]:
    config = {"model": {"class": "policy:ChunkPolicyModel",
                        "path": [str(ROOT / "examples" / "robot")]},
              "server": {"port": 18999}}
    if ray_section is not None:
        config["ray"] = ray_section
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    rc = cli.main(["serve", str(path), *flags])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("section, flags, message", [
    (None, ("--replicas", "0"), "--replicas: must be a positive integer, not 0"),
    ({"replicas": 0}, (), "ray.replicas: must be a positive integer, not 0"),
    ({"replica": 2}, (), "ray.replica: unknown key (unknown ray keys: ['replica'])"),
    ({"min_replicas": 3, "max_replicas": 2}, (), "ray.min_replicas: 3 is above max_replicas 2"),
    ({"replicas": 2, "max_replicas": 4}, (), "not both"),
    ({"num_gpus": -1}, (), "ray.num_gpus: must be a number >= 0"),
    ({"proxy_location": "Nowhere"}, (), "ray.proxy_location: must be HeadOnly"),
], ids=["replicas-0-flag", "replicas-0", "unknown-key", "min-above-max", "fixed-and-bounds",
        "negative-gpus", "proxy"])
def test_bad_replica_settings_are_refused_naming_the_key(capsys, tmp_path, section, flags,
                                                         message):
    rc, err = _cli(capsys, tmp_path, section, *flags)
    assert rc == 2 and message in err, err


def test_port_0_is_refused_with_replicas(capsys, tmp_path):
    rc, err = _cli(capsys, tmp_path, None, "--replicas", "2", "--port", "0")
    assert rc == 2 and "server.port: Ray Serve's proxy listens on a fixed port" in err, err


def test_replica_options_from_the_ray_section():
    from mstar_rt.serve.config import load_config
    from mstar_rt.serve.ray_serve import deployment_options

    config = load_config({"model": {"class": "x:y"}, "max_concurrent_requests": 12,
                          "ray": {"min_replicas": 1, "max_replicas": 4, "num_gpus": 0.5,
                                  "target_ongoing_requests": 3, "resources": {"slot": 1}}})
    opts = deployment_options(config, config.ray)
    assert opts["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4,
                                          "target_ongoing_requests": 3.0}
    assert "num_replicas" not in opts and opts["max_ongoing_requests"] == 12
    assert opts["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.5,
                                         "resources": {"slot": 1.0}}
    fixed = deployment_options(config, config.ray.with_replicas(3))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed


def test_a_replica_whose_model_cannot_serve_fails_ray_serves_health_check():
    """Ray Serve calls check_health on each replica every health_check_period_s; one that
    raises is replaced. It raises Runtime.health's reason (a tensor-parallel rank lost)."""
    from mstar_rt.serve.ray_serve import MstarReplica

    replica = MstarReplica.__new__(MstarReplica)  # no model: only the probe is under test
    replica.mstar_runtime = SimpleNamespace(health=lambda: None)
    replica.check_health()
    replica.mstar_runtime = SimpleNamespace(health=lambda: "rank 1 lost; load it again")
    with pytest.raises(RuntimeError, match="rank 1 lost; load it again"):
        replica.check_health()
    replica.mstar_runtime = None  # __del__ then has nothing to close
