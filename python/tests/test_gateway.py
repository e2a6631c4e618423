"""The gateway's OpenAPI document against the running gateway: a schema-driven fuzzer
(schemathesis) sends what the document allows and what it does not, and every answer must be
no server error and match the document (status, content type, body schema)."""

from __future__ import annotations

import hashlib
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import _free_port, rust_binary

API_KEY = "k-fuzz-5e1d9c3b7a2f4e6d8c0b1a3e5f7d9b2c"


def _wait_for_port(port: int, deadline: float) -> None:
    import socket

    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listens on {port}") from None
            time.sleep(0.05)


def test_the_openapi_document_holds_under_a_schema_driven_fuzzer(server: Any, tmp_path: Path) -> None:
    schemathesis = Path(__import__("sys").executable).parent / "schemathesis"
    if not schemathesis.exists():
        pytest.fail("schemathesis is not installed: run scripts/install-python-sdk")
    port = _free_port()
    config = tmp_path / "chorus.toml"
    config.write_text(
        "[gateway]\n"
        f'listen = "127.0.0.1:{port}"\n'
        "max_wait_ms = 200\n"
        "request_timeout_ms = 500\n"
        "hold_ms = 500\n"
        '[[gateway.identities]]\nid = "fuzzer"\n'
        '[[gateway.api_keys]]\nidentity = "fuzzer"\n'
        f'sha256 = "{hashlib.sha256(API_KEY.encode()).hexdigest()}"\n'
    )
    serve = subprocess.Popen(
        [rust_binary("chorus"), "--server", server.url, "serve", "--config", str(config)],
        env={"CHORUS_SERVE__METRICS_ADDR": "127.0.0.1:0", "RUST_LOG": "warn", "PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_port(port, time.monotonic() + 30)
        run = subprocess.run(
            [
                str(schemathesis), "run", f"http://127.0.0.1:{port}/openapi.json",
                "-H", f"X-API-Key: {API_KEY}",
                "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
                "--max-examples", "40",
                "--request-timeout", "10",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        # It tested every operation, hundreds of cases: a fuzzer that tested nothing must not pass.
        assert "Tested: 6" in run.stdout, run.stdout[-3000:]
        cases = re.search(r"(\d+) generated, \1 passed", run.stdout)
        assert cases is not None and int(cases.group(1)) >= 100, run.stdout[-3000:]
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=15)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
