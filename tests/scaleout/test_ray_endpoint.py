"""`kvserve serve --replicas 2` end to end, on a local Ray limited to two CPUs, with the tiny chat model: a
conversation's turns stay on one replica and find their prefix cached; streaming, auth and errors behave as on the
single server; /health and /metrics cover both replicas; killing a replica mid-run fails exactly its requests with a
503 naming the cause, nothing hangs, Ray restarts it; Ctrl-C stops every process the command started."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_tiny_chat_model

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[ray]'): the scale-out "
                                        "tests cannot run")
pytestmark = pytest.mark.ray

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
START_TIMEOUT_S = 240
FIRST_MESSAGE = "tell me about the sea and the ships that sail on it, the ports and the storms " * 4


def descendants(root: int) -> set[int]:
    """Every live process below `root` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ServeProcess:
    """`kvserve serve --replicas 2` in a subprocess; remembers every process it ever had below it."""

    def __init__(self, model_dir: Path, log_path: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "kvserve.cli", "serve", "--replicas", "2", "--model", str(model_dir),
                   "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--port", str(self.port),
                   "--api-key", API_KEY, "--no-access-log", "--shutdown-timeout", "2"]
        self.proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
        self.seen: set[int] = set()

    def remember_processes(self) -> None:
        self.seen |= descendants(self.proc.pid)

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=30)

    def wait_healthy(self, timeout_s: float, replicas_other_than: set[str] = frozenset()) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"kvserve serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                body = self.health().json()
            except (httpx.HTTPError, ValueError):  # not listening yet
                body = {}
            ok = [r for r in body.get("replicas", []) if r["status"] == "ok"]
            if len(ok) == 2 and not {r["replica"] for r in ok} & replicas_other_than:
                self.remember_processes()
                return body
            time.sleep(0.5)
        pytest.fail(f"the endpoint did not report two healthy replicas within {timeout_s} s:\n{self.log()}")

    def stop(self) -> int:
        self.remember_processes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=120)

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ray")
    server = ServeProcess(make_tiny_chat_model(directory / "tiny-chat"), directory / "serve.log")
    try:
        server.wait_healthy(START_TIMEOUT_S)
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()
        for pid in server.seen:  # a failed test must not leave Ray running on the machine
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def chat(server, messages, **extra) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)


def test_a_conversation_stays_on_one_replica_and_finds_its_prefix_cached(server):
    for conversation in range(3):
        messages, replicas, prompt, cached = [], [], [], []
        for turn in range(4):
            messages.append({"role": "user", "content": f"conversation {conversation}, turn {turn}: {FIRST_MESSAGE}"
                             if turn == 0 else f"and then what happened in turn {turn}?"})
            response = chat(server, messages)
            assert response.status_code == 200, response.text
            replicas.append(response.headers["x-kvserve-replica"])
            usage = response.json()["usage"]
            prompt.append(usage["prompt_tokens"])
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            messages.append(response.json()["choices"][0]["message"])
        assert len(set(replicas)) == 1, f"conversation {conversation} moved between replicas: {replicas}"
        # From turn 2 on, the whole previous prompt is found cached (but for its partly filled last block and
        # where the re-rendered answer joins it).
        assert all(cached[t] >= prompt[t - 1] - 32 for t in range(1, 4)), (prompt, cached)


def test_streaming_through_the_router_gives_the_same_answer(server):
    messages = [{"role": "user", "content": "stream this: " + FIRST_MESSAGE}]
    whole = chat(server, messages).json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
            "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == whole
    assert chunks[-1]["usage"]["completion_tokens"] == 8


ADD = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}


def test_constrained_requests_through_the_replicas_validate(server):
    """A named tool call and a JSON-schema output, served by a replica: both parse and fit their schemas."""
    sampled = {"temperature": 1.0, "max_tokens": 150, "ignore_eos": False, "seed": 3}
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
    called = chat(server, [{"role": "user", "content": "add two numbers"}], tools=tools,
                  tool_choice={"type": "function", "function": {"name": "add"}}, **sampled).json()
    choice = called["choices"][0]
    assert choice["finish_reason"] == "tool_calls", called
    [call] = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "add" and set(arguments) == {"a", "b"}
    assert all(isinstance(v, int) and 0 <= v <= 99 for v in arguments.values())
    answer = chat(server, [{"role": "user", "content": "a JSON object"}], response_format={
        "type": "json_schema", "json_schema": {"name": "add", "schema": ADD, "strict": True}}, **sampled).json()
    assert answer["choices"][0]["finish_reason"] == "stop", answer
    assert set(json.loads(answer["choices"][0]["message"]["content"])) == {"a", "b"}


def test_auth_and_errors_are_the_single_servers(server):
    unauthorized = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["code"] == "invalid_api_key"
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": -1}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    wrong_model = chat(server, [{"role": "user", "content": "hi"}], model="gpt-4")
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny-chat"


def metric_by_replica(server, name: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            replica = dict(part.split("=", 1) for part in labels.split(","))["replica"].strip('"')
            values[replica] = float(value)
    return values


def test_health_and_metrics_cover_every_replica(server):
    health = server.health().json()
    replicas = {r["replica"] for r in health["replicas"]}
    assert health["status"] == "ok" and len(replicas) == 2
    before = metric_by_replica(server, "kvserve:prompt_tokens_total")
    assert set(before) == replicas
    prompt_tokens = sum(chat(server, [{"role": "user", "content": f"count me {i}"}]).json()["usage"]["prompt_tokens"]
                        for i in range(4))
    after = metric_by_replica(server, "kvserve:prompt_tokens_total")
    assert sum(after.values()) - sum(before.values()) == prompt_tokens


class Outcome:
    """One long request run in a thread: how it ended."""

    def __init__(self, server, i: int, stream: bool):
        self.server, self.i, self.stream = server, i, stream
        self.started = threading.Event()
        self.status, self.finish_reason, self.error, self.num_chunks = None, None, None, 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        body = {"prompt": f"long request {self.i}", "max_tokens": 900, "ignore_eos": True, "stream": self.stream}
        try:
            if not self.stream:
                self.started.set()
                response = httpx.post(self.server.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
                self.status = response.status_code
                answer = response.json()
                self.error = answer.get("error")
                self.finish_reason = answer["choices"][0]["finish_reason"] if self.status == 200 else None
                return
            with httpx.stream("POST", self.server.url + "/v1/completions", json=body, headers=AUTH,
                              timeout=120) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    self.started.set()
                    if "error" in event:
                        self.error = event["error"]
                    elif event["choices"][0]["finish_reason"]:
                        self.finish_reason = event["choices"][0]["finish_reason"]
                    self.num_chunks += 1
        finally:
            self.started.set()


def test_killing_a_replica_mid_run_fails_only_its_requests_with_a_503_and_ray_restarts_it(server):
    health = server.wait_healthy(60)
    victim = health["replicas"][0]
    outcomes = [Outcome(server, i, stream=i < 4) for i in range(6)]
    for outcome in outcomes:
        assert outcome.started.wait(60)
    time.sleep(0.5)
    os.kill(victim["pid"], signal.SIGKILL)
    for outcome in outcomes:
        outcome.thread.join(120)
        assert not outcome.thread.is_alive(), f"request {outcome.i} hangs after the replica was killed"
    lost = [o for o in outcomes if o.error is not None]
    assert lost, "no request was running on the killed replica"
    for outcome in outcomes:
        if outcome.error is None:
            assert (outcome.status, outcome.finish_reason) == (200, "length")
        else:
            assert outcome.error["code"] == "replica_unavailable"
            assert "was lost" in outcome.error["message"] and "ActorDiedError" in outcome.error["message"]
            assert outcome.status == (200 if outcome.stream else 503)  # a stream's headers were already sent
    after = chat(server, [{"role": "user", "content": "are you still there?"}])
    assert after.status_code == 200 and after.headers["x-kvserve-replica"] != victim["replica"]
    server.wait_healthy(120, replicas_other_than={victim["replica"]})  # a new replica took its place


def test_ctrl_c_drains_then_stops_every_process_the_command_started(server):
    server.remember_processes()
    assert len(server.seen) >= 5  # Ray's own processes, the Serve controller and proxy, the ingress and replicas
    running = Outcome(server, 99, stream=True)  # outlasts --shutdown-timeout 2
    assert running.started.wait(60)
    server.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    late = httpx.post(server.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, headers=AUTH)
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
    running.thread.join(60)
    assert (running.status, running.finish_reason, running.error) == (200, "abort", None)  # a proper end
    assert server.stop() == 0
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in server.seen) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in server.seen if alive(pid)], server.log()
