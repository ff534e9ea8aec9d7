"""A hostile job's start command: everything it tries against another team's running job, given
all a job could learn of it but the cluster's token (test_containers.py's attack test).

`python attack_job.py TARGETS.json` prints one line per attack, `ATTACK <name>: refused: <why>`
or `ATTACK <name>: SUCCEEDED: <what>`, and exits 0 either way. It never prints what it finds:
a token or a secret is shown as the first 12 hex digits of its sha256, so its own log is no leak.
With `"harmless": true` (the same attacks run on the host, where they must succeed) it signals
with signal 0, stops nothing and removes what it writes.

Needs Python, Ray and grpcio, nothing of this project: it runs in the job's image.
"""

from __future__ import annotations

import glob
import hashlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Read-only calls of Ray's gRPC services: the GCS, the raylet, a worker (an actor), the
# dashboard agent's log service, the Ray Client server.
PROBES = (
    "/ray.rpc.ActorInfoGcsService/GetAllActorInfo",
    "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",
    "/ray.rpc.NodeManagerService/GetNodeStats",
    "/ray.rpc.CoreWorkerService/GetCoreWorkerStats",
    "/ray.rpc.LogService/ListLogs",
    "/ray.rpc.RayletDriver/ClusterInfo",
)
# What a refusal or a closed door looks like; any other answer means a handler ran.
NOT_REACHED = {"UNAUTHENTICATED", "UNIMPLEMENTED", "UNAVAILABLE", "INTERNAL", "UNKNOWN",
               "DEADLINE_EXCEEDED", "CANCELLED", "PERMISSION_DENIED"}  # fmt: skip
GUESS = "0123456789abcdef" * 4


def fingerprint(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:12]


def say(name: str, succeeded: bool, what: str) -> None:
    print(f"ATTACK {name}: {'SUCCEEDED' if succeeded else 'refused'}: {what}", flush=True)


def pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]


def read(path: str, limit: int = 1 << 20) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def find_token(targets: dict) -> str | None:
    """Ray's token wherever a process of this node might find it: this process's variables,
    every visible process's, Ray's default file and the paths the targets name."""
    places = [("own environment", dict(os.environ))]
    for pid in pids():
        raw = read(f"/proc/{pid}/environ") or b""
        pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        places.append((f"/proc/{pid}/environ", {k.decode(): v.decode(errors="replace")
                                                for k, v in pairs}))  # fmt: skip
    files = []
    for where, env in places:  # this process's own first
        if env.get("RAY_AUTH_TOKEN"):
            return found_token(f"RAY_AUTH_TOKEN in {where}", env["RAY_AUTH_TOKEN"])
        if env.get("RAY_AUTH_TOKEN_PATH"):
            files.append(env["RAY_AUTH_TOKEN_PATH"])
    files += [*targets["token_files"], os.path.expanduser("~/.ray/auth_token")]
    for path in files:
        content = read(path)
        if content and content.strip():
            return found_token(f"read {path}", content.decode().strip())
    say("token", False, f"not in {len(places)} environments nor in {len(files)} files")
    return None


def found_token(where: str, token: str) -> str:
    say("token", True, f"{where}: {fingerprint(token)}")
    return token


def ray_attempt(targets: dict, address: str, token: str | None) -> str:
    """One connection with Ray's own client, then the named actors a job must not reach: run in
    a process of its own (Ray connects once per process)."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # keep 127.0.0.1 as it is
    # Shorter waits than Ray's (20 s for the GCS, 30 s for Ray Client): a refusal comes at once,
    # and the same waits let the control (on the host, with the token) connect.
    env.update(RAY_NUM_REDIS_GET_RETRIES="4", RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S="1")
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    if token is not None:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    done = subprocess.run(
        [sys.executable, __file__, "--ray", address, json.dumps(targets)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RAY ")]
    return lines[-1][4:] if lines else f"ended {done.returncode}: {done.stderr.strip()[-200:]}"


def ray_connect(address: str, targets: dict) -> None:
    """In its own process: connect, then the secret store (B's secret), the queue service and
    B's node agent (what `orchestrator shell` goes through)."""
    import ray

    try:
        ray.init(address=address, namespace="orchestrator", log_to_driver=False,
                 logging_level="ERROR")  # fmt: skip
    except BaseException as e:  # whatever stops it, it is a refusal
        # ray.init's ConnectionError holds what the GCS answered, deep in a traceback's text
        lines = [line.strip() for line in str(e.__cause__ or e).splitlines() if line.strip()]
        why = next((line for line in lines if "uthentica" in line), lines[-1] if lines else "")
        print(f"RAY refused {type(e).__name__}: {why[:200]}", flush=True)
        return
    reached = []
    for actor in ("orchestrator-secret-store", "orchestrator-queue",
                  f"orchestrator-{targets['job']}-rank-0"):  # fmt: skip
        try:
            handle = ray.get_actor(actor)
        except ValueError:
            continue
        if actor == "orchestrator-secret-store":
            value = ray.get(handle.get.remote(targets["secret"], targets["team"]), timeout=30)
            reached.append(f"{actor} gave {targets['secret']}: {fingerprint(value or '')}")
        else:
            reached.append(actor)
    print(f"RAY SUCCEEDED connected; reached {reached}", flush=True)


def listening_ports() -> list[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in (read(table) or b"").decode().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def grpc_scan(ports: list[int], token: str | None) -> None:
    import grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else None
    reached, refused = [], 0

    def probe(port: int) -> None:
        nonlocal refused
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method in PROBES:
                try:
                    channel.unary_unary(method)(b"", timeout=3, metadata=metadata)
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                if code == "UNAUTHENTICATED":
                    refused += 1
                if code not in NOT_REACHED:
                    reached.append(f"{port}{method}")
                if code == "UNAVAILABLE":
                    return  # not a gRPC server

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(probe, ports))
    if reached:
        say("grpc", True, f"answered on {len(reached)} calls, e.g. {reached[:3]}")
    else:
        say("grpc", False, f"{len(ports)} ports, {refused} calls refused for want of a token")


def fetch(url: str, token: str | None, method: str = "GET") -> tuple[int | None, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, method=method, headers=headers,
                                     data=b"{}" if method == "POST" else None)  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read(1 << 20).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(300).decode(errors="replace")
    except (OSError, ValueError, http.client.HTTPException) as e:
        return None, type(e).__name__


def job_api(targets: dict, ports: list[int], token: str | None) -> None:
    """Ray's job API on the dashboard and on every other port that answers HTTP: B's logs, then
    stopping it."""
    job = targets["job"]
    urls = [targets["dashboard"], *(f"http://127.0.0.1:{p}" for p in ports)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda url: (url, *fetch(f"{url}/api/jobs/", token)), urls))
    shown = [url for url, status, body in answers if status == 200 and job in body]
    bodies = {url: body for url, _, body in answers}
    metrics = [url for url in shown if bodies[url].startswith("# HELP")]
    listed = [url for url in shown if url not in metrics]
    statuses = sorted({str(status) for url, status, _ in answers if status})
    if listed:
        say("job-api", True, f"{listed[0]}/api/jobs/ lists {job}")
    else:
        say("job-api", False, f"no port lists {job} (answers: {', '.join(statuses)})")
    # Prometheus's text on a metrics port (any path): numbers labelled with B's job id.
    say("metrics", bool(metrics), f"{len(metrics)} metrics ports name {job}")
    dashboard = targets["dashboard"]
    if targets.get("harmless"):
        status, body = fetch(f"{dashboard}/api/jobs/{job}", token)
        say("job-api-stop", status == 200, f"(harmless: looked it up) {status} {body[:80]}")
        return
    status, body = fetch(f"{dashboard}/api/jobs/{job}/stop", token, "POST")
    say("job-api-stop", status == 200, f"{status} {body[:120]!r}")


def ray_connections(targets: dict, token: str | None) -> None:
    attempts = {"ray-gcs": (targets["gcs"], token), "ray-client": (targets["client"], token),
                "ray-gcs-guessed-token": (targets["gcs"], GUESS)}  # fmt: skip
    with ThreadPoolExecutor(len(attempts)) as pool:
        results = pool.map(lambda a: ray_attempt(targets, *a), attempts.values())
        for name, result in zip(attempts, results, strict=True):
            say(name, result.startswith("SUCCEEDED"), result.removeprefix("SUCCEEDED ")
                .removeprefix("refused "))  # fmt: skip


def files(label: str, path: str, targets: dict) -> None:
    """A directory of B's, of the node or of the head: listed, read and written. A `shared:` one
    (the node's root, the storage root) holds this job's own files too: reaching it counts only
    if something of B's is in it."""
    if not os.path.exists(path):
        say(f"files {label}", False, f"no {path} here")
        return
    entries = []
    for root, dirs, names in os.walk(path):
        entries += [os.path.join(root, n) for n in [*dirs, *names]]
        if len(entries) > 5000:
            break
    if label.startswith("shared:"):
        entries = [e for e in entries if targets["job"] in e]
        if not entries:
            say(f"files {label}", False, f"{path} holds nothing of {targets['job']}")
            return
    readable = [e for e in entries if os.path.isfile(e) and read(e, 64) is not None]
    probe = Path(path) / f".attack-{os.getpid()}"
    try:
        probe.write_text("written by another team's job")
        wrote = True
        if targets.get("harmless"):
            probe.unlink()
    except OSError:
        wrote = False
    say(f"files {label}", True, f"{path}: {len(entries)} entries listed, "
        f"{len(readable)} files read, written: {wrote}")  # fmt: skip


def processes(targets: dict) -> None:
    """Every process this job can see: does one belong to B (its job id in its environment or
    command line)?"""
    seen = pids()
    of_b = [pid for pid in seen
            if targets["job"].encode() in (read(f"/proc/{pid}/environ") or b"")
            + (read(f"/proc/{pid}/cmdline") or b"")]  # fmt: skip
    say("proc", bool(of_b), f"{len(seen)} processes visible, {len(of_b)} of {targets['job']}")


def signals(targets: dict) -> None:
    """B's processes by their pids on the node: SIGTERM (signal 0 when harmless). A pid that is
    a process of this job's own PID namespace here (the same number, by chance) is left alone."""
    sent = []
    own = os.readlink("/proc/self/ns/pid")
    for pid in targets["pids"]:
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") == own:
                continue
        except OSError:
            pass  # no such process here (or not ours to look at): signal it all the same
        try:
            os.kill(pid, 0 if targets.get("harmless") else signal.SIGTERM)
            sent.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    say("signal", bool(sent), f"signalled {len(sent)} of B's {len(targets['pids'])} processes")


def podman(targets: dict) -> None:
    """The node's podman, to exec into B's container: its API socket, or its command."""
    sockets = ["/run/podman/podman.sock", *glob.glob("/run/user/*/podman/podman.sock")]
    for path in filter(os.path.exists, sockets):
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(path)
                say("podman", True, f"connected to {path}")
                return
            except OSError:
                pass
    try:
        listed = subprocess.run(["podman", "ps", "--format", "{{.Names}}"], capture_output=True,
                                text=True, timeout=60).stdout  # fmt: skip
    except OSError as e:
        say("podman", False, f"no socket; the command: {type(e).__name__}")
        return
    container = f"orchestrator-{targets['job']}-rank-0"
    say("podman", container in listed, f"`podman ps` lists {len(listed.split())} containers")


def main(targets: dict) -> None:
    token = find_token(targets)
    ports = listening_ports()
    ray_connections(targets, token)
    grpc_scan(ports, token)
    job_api(targets, ports, token)
    for label, path in targets["paths"].items():
        files(label, path, targets)
    processes(targets)
    signals(targets)
    podman(targets)
    print("ATTACKS DONE", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--ray":
        ray_connect(sys.argv[2], json.loads(sys.argv[3]))
    else:
        main(json.loads(Path(sys.argv[1]).read_text()))
