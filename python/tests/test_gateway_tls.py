"""The gateway over HTTPS and WSS, with the development CA `chorus certs` makes: a client that
trusts the CA is served (HTTP and WebSocket); a plain-HTTP client and a client that does not
trust the CA get no answer; with a client CA configured, a client without a certificate is
refused in the handshake and one with the CA's certificate is served."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import rust_binary
from .test_gateway import API_KEY, WAIT, gateway


def _certs(tmp_path: Path) -> Path:
    tls = tmp_path / ".tls"
    subprocess.run(
        [rust_binary("chorus"), "certs", "--out", str(tls), "--host", "localhost", "--host", "127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return tls


def _tls_table(tls: Path, client_ca: bool) -> str:
    table = f'[gateway.tls]\ncert_file = "{tls / "server.pem"}"\nkey_file = "{tls / "server-key.pem"}"\n'
    if client_ca:
        table += f'client_ca_file = "{tls / "ca.pem"}"\n'
    return table


def _trusting(tls: Path, with_client_cert: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(tls / "ca.pem"))
    if with_client_cert:
        context.load_cert_chain(str(tls / "client.pem"), str(tls / "client-key.pem"))
    return context


def test_https_and_wss_serve_a_client_that_trusts_the_ca_and_no_other(server: Any, tmp_path: Path) -> None:
    import websockets

    tls = _certs(tmp_path)
    with gateway(server, tmp_path, "tls-edge", _tls_table(tls, client_ca=False)) as port:
        headers = {"X-API-Key": API_KEY}
        answer = httpx.get(f"https://127.0.0.1:{port}/v1/agents", headers=headers, verify=_trusting(tls), timeout=WAIT)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"agents": []}
        # Plain HTTP on the TLS port gets no HTTP answer.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/v1/agents", headers=headers, timeout=WAIT)
        # A client that trusts only the system's CAs refuses the development certificate.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"https://127.0.0.1:{port}/v1/agents", headers=headers, timeout=WAIT)

        async def over_wss() -> dict[str, Any]:
            url = f"wss://127.0.0.1:{port}/v1/ws"
            async with websockets.connect(url, ssl=_trusting(tls), additional_headers=headers) as ws:
                return dict(json.loads(await asyncio.wait_for(ws.recv(), WAIT)))

        welcome = asyncio.run(over_wss())
        assert (welcome["type"], welcome["identity"]) == ("welcome", "tls-edge")


def test_a_client_certificate_is_required_when_a_client_ca_is_configured(server: Any, tmp_path: Path) -> None:
    tls = _certs(tmp_path)
    with gateway(server, tmp_path, "mtls-edge", _tls_table(tls, client_ca=True)) as port:
        url = f"https://127.0.0.1:{port}/v1/agents"
        headers = {"X-API-Key": API_KEY}
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, headers=headers, verify=_trusting(tls), timeout=WAIT)
        answer = httpx.get(url, headers=headers, verify=_trusting(tls, with_client_cert=True), timeout=WAIT)
        assert answer.status_code == 200, answer.text
