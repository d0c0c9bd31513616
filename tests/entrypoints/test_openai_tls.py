"""`tokenloom serve` over HTTPS with vLLM's --ssl-keyfile / --ssl-certfile: the official client
talks to it through a CA it trusts, plain HTTP to the same port gets no answer, and a key that
does not fit its certificate is a one-line error before any model loads."""
from __future__ import annotations

import os
import subprocess

import httpx
import pytest
from conftest import TOKENLOOM, ServerProcess


def _self_signed(directory, name: str) -> tuple[str, str]:
    key, cert = str(directory / f"{name}.key"), str(directory / f"{name}.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


@pytest.mark.slow
def test_https_with_vllms_flags(tmp_path):
    key, cert = _self_signed(tmp_path, "server")
    srv = ServerProcess(["--ssl-keyfile", key, "--ssl-certfile", cert, "--max-model-len", "256",
                         "--num-kv-blocks", "64"], None, tls_ca=cert)
    try:
        out = srv.client().chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0,
                                                   messages=[{"role": "user", "content": "Hi"}])
        assert out.choices[0].message.content and out.usage.completion_tokens > 0
        assert f"https://127.0.0.1:{srv.port}" in srv.log_text()  # the start-up line says https
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port: no HTTP answer
            httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=10)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(srv.url("/health"), timeout=10)
    finally:
        srv.stop()
        os.unlink(srv.log.name)


def test_a_key_that_does_not_fit_its_certificate_is_one_line(tmp_path):
    key, _ = _self_signed(tmp_path, "one")
    _, cert = _self_signed(tmp_path, "two")
    r = subprocess.run([str(TOKENLOOM), "serve", "--ssl-keyfile", key, "--ssl-certfile", cert, "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert f"--ssl-certfile {cert!r} / --ssl-keyfile {key!r} cannot be loaded" in r.stderr
    assert "loaded" not in r.stderr.split("cannot be loaded")[0]  # nothing before it: no model was loaded
    r = subprocess.run([str(TOKENLOOM), "serve", "--ssl-keyfile", key, "--port", "0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "HTTPS needs both --ssl-keyfile and --ssl-certfile" in r.stderr
