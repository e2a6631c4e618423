"""What the scripts that hold Chorus to an outside test suite share (`scripts/a2a-tck`,
`scripts/mcp-conformance`): free loopback ports, bounded waits, the processes a run starts,
and a nats-server of the run's own."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(what: str, ready: Callable[[], bool], deadline_s: float = 60.0) -> None:
    """Polls `ready` until it holds, or exits naming `what` after `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"{Path(sys.argv[0]).name}: {what} not ready within {deadline_s:.0f} s")
        time.sleep(0.1)


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def target_dir() -> Path:
    meta = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=REPO,
                          check=True, capture_output=True, text=True)
    return Path(json.loads(meta.stdout)["target_directory"])


class Processes:
    """What the run started, stopped in reverse order at the end."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
        out = log.open("wb")
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
        self.started.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.started):
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_nats(procs: Processes, work: Path) -> str:
    """nats-server with JetStream on a loopback port the OS picks; returns its URL."""
    nats = os.environ.get("NATS_SERVER") or shutil.which("nats-server")
    if not nats:
        nats = subprocess.run([str(REPO / "scripts" / "install-nats-server")], check=True,
                              capture_output=True, text=True).stdout.strip().splitlines()[-1]
    port = free_port()
    procs.start([nats, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(work / "js")],
                work / "nats.log")
    wait_for("nats-server", lambda: listening(port))
    return f"nats://127.0.0.1:{port}"
