"""`kvserve serve` as a user runs it: a subprocess that prints its KV cache line and address, serves, and on SIGTERM
stops accepting, lets a short stream finish, aborts a long one with a proper end of stream, and exits 0.
Tiny random model (8K context) with SmolLM2's tokenizer, as in test_server_api.py."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import make_tiny_chat_model

SHUTDOWN_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("cli") / "tiny-chat", max_position_embeddings=8192)


def start_server(model_dir) -> tuple[subprocess.Popen, str, list[str]]:
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model_dir), "--port", "0",
               "--kv-cache-memory", "64MiB", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--no-access-log"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True).start()  # never let the pipe fill
    deadline = time.monotonic() + 120
    while not (url := next((m.group(1) for line in lines if (m := re.search(r"on (http://\S+/v1)", line))), None)):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail("kvserve serve did not start:\n" + "".join(lines))
        time.sleep(0.05)
    return process, url, lines


def data_lines(lines) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_serve_prints_its_address_and_shuts_down_cleanly_on_sigterm(model_dir):
    process, url, log = start_server(model_dir)
    try:
        assert any(line.startswith("KV cache (float32):") for line in log)
        assert re.search(r"http://127\.0\.0\.1:\d+/v1", url)
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/models").json()["data"][0]["id"] == "tiny-chat"
            short_body = {"prompt": "short", "max_tokens": 40, "ignore_eos": True, "stream": True}
            long_body = {"prompt": "long", "max_tokens": 8000, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/completions", json=short_body) as short, \
                    http.stream("POST", "/completions", json=long_body) as long:
                short_lines, long_lines = short.iter_lines(), long.iter_lines()
                next(short_lines), next(long_lines)  # both are generating
                process.send_signal(signal.SIGTERM)
                short_events = data_lines(short_lines)
                time.sleep(0.3)  # uvicorn notices the signal within 0.1 s
                with pytest.raises(httpx.ConnectError):
                    httpx.get(url + "/models")
                long_events = data_lines(long_lines)
        assert short_events[-1] == "[DONE]"
        assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
        assert long_events[-1] == "[DONE]"
        assert json.loads(long_events[-2])["choices"][0]["finish_reason"] == "abort"
        assert process.wait(timeout=30) == 0
        assert "Traceback" not in "".join(log)
    finally:
        process.kill()
