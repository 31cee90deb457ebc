"""The dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright): the page asks for the API
key, then within one refresh draws exactly the blocks the running requests hold, a shared prefix as shared cells
and each request in its own colour, says who holds a block on hover, and shows every block back to free or
cached once the requests finish. A screenshot is saved under the test's tmp dir (its path is printed).

Skipped, loudly, only where no browser can be installed; .ci/run installs one and sets KVSERVE_REQUIRE_BROWSER=1
so that there a missing browser fails the test instead."""
import json
import os
import shutil
import threading
import time

import httpx
import pytest

from kvserve import EngineConfig, LLMEngine
from kvserve.server.app import build_app
from kvserve.server.launch import ServerThread
from tests.conftest import make_tiny_chat_model
from tests.server.step_gate import StepGate

API_KEY = "sesame"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ENGINE_OPTIONS = dict(kv_cache_memory="8MiB", max_model_len=512)  # 1,024 blocks of 16 tokens
REFRESH_S = 1.0  # the page polls once a second
SLACK_S = 2.0  # a busy 2-core CI machine may be slow to fetch and draw
# Headless and a fresh profile are Playwright's own flags.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SYSTEM = list(range(1000, 1048))  # three full blocks both chats start with


def no_browser(reason: str):
    if os.environ.get("KVSERVE_REQUIRE_BROWSER"):
        pytest.fail(f"KVSERVE_REQUIRE_BROWSER is set but {reason}")
    pytest.skip(f"THE DASHBOARD BROWSER TEST DID NOT RUN: {reason}")


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        no_browser("playwright is not installed (pip install -e '.[test]')")
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        no_browser("no chromium executable on PATH (Debian: apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("browser") / "tiny-chat")


def complete(url: str, prompt: list[int]) -> None:
    body = {"model": "tiny-chat", "prompt": prompt, "max_tokens": 6, "ignore_eos": True}
    assert httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200


def server_view(url: str) -> dict:
    return httpx.get(url + "/v1/kv/blocks", headers=AUTH).json()


def wait_for_waiting(url: str, num_waiting: int) -> None:
    deadline = time.monotonic() + 10
    while server_view(url)["stats"]["num_waiting"] != num_waiting:
        assert time.monotonic() < deadline, f"never {num_waiting} waiting"
        time.sleep(0.01)


def page_counts(page) -> dict:
    return json.loads(page.eval_on_selector("#grid", "canvas => canvas.dataset.counts || '{}'"))


def wait_for_counts(page, expected: dict, started: float) -> float:
    """Wait until the grid shows `expected` cells per state; seconds since `started` it took."""
    page.wait_for_function(
        """expected => {
             const counts = JSON.parse(document.getElementById("grid").dataset.counts || "{}");
             return Object.entries(expected).every(([state, n]) => (counts[state] || 0) === n);
           }""",
        arg=expected, timeout=(REFRESH_S + SLACK_S) * 1000, polling=50)
    return time.monotonic() - started


def cell_center(page, block_id: int) -> tuple[float, float]:
    """Where block `block_id`'s cell is on the page (CSS pixels)."""
    grid = page.locator("#grid")
    pitch, columns = (int(grid.get_attribute(name)) for name in ("data-pitch", "data-columns"))
    box = grid.bounding_box()
    return box["x"] + (block_id % columns + 0.45) * pitch, box["y"] + (block_id // columns + 0.45) * pitch


def cell_color(page, block_id: int) -> tuple[int, int, int]:
    x, y = cell_center(page, block_id)
    box = page.locator("#grid").bounding_box()
    return tuple(page.eval_on_selector(
        "#grid", """(canvas, [x, y]) => {
            const scale = canvas.width / canvas.clientWidth;
            return Array.from(canvas.getContext("2d").getImageData(x * scale, y * scale, 1, 1).data.slice(0, 3));
        }""", [x - box["x"], y - box["y"]]))


def test_the_page_draws_the_blocks_requests_hold(browser, model_dir, tmp_path):
    engine = LLMEngine(EngineConfig(model=str(model_dir), **ENGINE_OPTIONS))
    gate = StepGate(engine)
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    problems, requested = [], []
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.on("console", lambda message: message.type == "error" and "401" not in message.text
            and problems.append(message.text))
    page.on("request", lambda request: requested.append(request.url))
    chats: list[threading.Thread] = []
    with ServerThread(build_app(engine, api_key=API_KEY)) as server:

        def start_chat(prompt: list[int]) -> None:
            chats.append(threading.Thread(target=complete, args=(server.url, prompt)))
            chats[-1].start()

        try:
            page.goto(server.url + "/dashboard")
            page.fill("#key-input", API_KEY)  # without the key the page gets 401 and asks for it
            page.click("#key-dialog button")
            wait_for_counts(page, {"free": 1024, "in_use": 0, "shared": 0}, time.monotonic())

            gate.hold()
            start_chat(SYSTEM + [7] * 20)  # 68 tokens: 5 blocks
            start_chat(list(range(2000, 2037)))  # 37 tokens: 3 blocks
            wait_for_waiting(server.url, 2)
            gate.run(1)  # both prefilled; the system prompt's blocks enter the prefix cache
            start_chat(SYSTEM + [9] * 40)  # 88 tokens: 6 blocks, the first 3 the system prompt's
            wait_for_waiting(server.url, 1)
            gate.run(1)  # the third reuses the system prompt's blocks: shared
            settled = time.monotonic()
            view = server_view(server.url)
            expected = {name: view["block_counts"][name] for name in ("in_use", "shared", "free", "cached")}
            assert expected["shared"] == 3 and view["stats"]["num_used_blocks"] == 5 + 3 + 6 - 3
            took_s = wait_for_counts(page, expected, settled)
            print(f"\nthe page showed the held blocks {took_s:.2f} s after the engine stopped")
            assert page.locator("#counters .value").first.inner_text() == str(view["stats"]["num_used_blocks"])

            by_size = {len(seq["block_ids"]): seq for seq in view["sequences"]}  # the first two race to be admitted
            first, second, third = by_size[5], by_size[3], by_size[6]
            shared_block = third["block_ids"][0]
            assert shared_block == first["block_ids"][0]
            colors = {name: cell_color(page, block_id) for name, block_id in [
                ("shared", shared_block), ("first", first["block_ids"][-1]), ("first again", first["block_ids"][-2]),
                ("second", second["block_ids"][-1]), ("third", third["block_ids"][-1]),
                ("free", view["blocks"]["state"].index("F"))]}
            assert colors["first"] == colors["first again"]  # a request keeps its colour
            assert len({colors[name] for name in ("shared", "first", "second", "third", "free")}) == 5, colors

            page.mouse.move(*cell_center(page, shared_block))
            tooltip = page.locator("#tooltip")
            tooltip.wait_for(state="visible", timeout=2000)
            text = tooltip.inner_text()
            assert f"Block {shared_block} · shared" in text and "ref count 2" in text
            assert first["request_id"] in text and third["request_id"] in text and "tokens 0–15" in text
            screenshot = tmp_path / "dashboard.png"
            page.screenshot(path=str(screenshot), full_page=True)
            print(f"dashboard screenshot: {screenshot}")
        finally:
            gate.release()
            for chat in chats:
                chat.join()
        wait_for_waiting(server.url, 0)
        done = server_view(server.url)
        assert done["stats"]["num_used_blocks"] == 0 and done["stats"]["num_cached_blocks"] > 0
        wait_for_counts(page, {"in_use": 0, "shared": 0, "cached": done["stats"]["num_cached_blocks"],
                               "free": 1024 - done["stats"]["num_cached_blocks"]}, time.monotonic())
        assert page.locator("#sequences").inner_text().startswith("none")
    page.close()
    assert problems == []
    assert requested and all(url.startswith(server.url) for url in requested)  # nothing from elsewhere


def test_the_page_shows_the_disk_tier_and_speculation(browser, model_dir, tmp_path):
    """With --kv-disk-cache the page adds the tier's fill and hit rate, as cards and as a chart; with
    --speculative-config, a card of the draft tokens accepted."""
    options = dict(ENGINE_OPTIONS, kv_disk_cache=str(tmp_path / "kv"), kv_disk_cache_size="64MiB",
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    first = LLMEngine(EngineConfig(model=str(model_dir), **options))
    first.add_request("warm", {"prompt_token_ids": SYSTEM + [7] * 20})
    while first.has_unfinished_requests():
        first.step()
    assert first.disk_cache.store.flush(10)
    engine = LLMEngine(EngineConfig(model=str(model_dir), **options))  # a restart: the prefix is on disk only
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    problems = []
    page.on("pageerror", lambda error: problems.append(str(error)))
    with ServerThread(build_app(engine)) as server:
        complete(server.url, SYSTEM + [9] * 20)  # its first 48 tokens (the system prompt) come from disk
        stats = server_view(server.url)["stats"]
        assert stats["disk_cache_hit_tokens"] == 48 and stats["disk_cache_blocks"] >= 4
        page.goto(server.url + "/dashboard")
        page.wait_for_function("""() => Array.from(document.querySelectorAll('#counters .label'))
                                  .some((e) => e.textContent === 'Disk hit rate')""", timeout=10_000)
        cards = dict(zip(page.locator("#counters .label").all_inner_texts(),
                         page.locator("#counters .sub").all_inner_texts()))
        assert cards["Disk hit rate"].startswith(f"48 of {stats['prefix_cache_queries']} prompt tokens")
        assert cards["Disk tier"].startswith(f"{stats['disk_cache_blocks']} blocks")
        drafted = f"{stats['spec_decode_num_accepted_tokens']} of {stats['spec_decode_num_draft_tokens']} · "
        assert cards["Draft tokens accepted"].startswith(drafted)
        page.wait_for_function("""() => Array.from(document.querySelectorAll('#charts .name'))
                                  .some((e) => e.textContent === 'Disk tier')""", timeout=10_000)
    page.close()
    assert problems == []
