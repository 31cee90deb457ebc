import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.server.api_models import MAX_JSON_CONTAINERS, CompletionRequest, _num_brackets_outside_strings, \
    parse_request

# Text rich in what could fool a scan of the raw bytes: quotes, backslashes, brackets, escapes, non-ASCII.
TRICKY_TEXT = st.text(alphabet=st.sampled_from('[]{}"\\/nu0aé\n\t\x00😀'), max_size=12)
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | TRICKY_TEXT,
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY_TEXT, inner, max_size=4),
                           max_leaves=30)


def num_containers(value) -> int:
    if isinstance(value, list):
        return 1 + sum(map(num_containers, value))
    if isinstance(value, dict):
        return 1 + sum(map(num_containers, value.values()))
    return 0


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES, st.booleans())
def test_brackets_outside_strings_are_the_json_containers(value, ascii_only):
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert _num_brackets_outside_strings(raw) == num_containers(value)


def test_brackets_in_a_prompts_text_are_not_containers():
    code = "x = [[{}]] if a[0] else {'\\\"': [1]}\n" * (MAX_JSON_CONTAINERS // 4)  # 25,000 brackets of text
    request = parse_request(CompletionRequest, json.dumps({"prompt": [code, "[" * 20_000]}).encode())
    assert request.prompt == [code, "[" * 20_000]


def test_counting_containers_costs_memory_by_the_bodys_bytes_not_an_object_per_string():
    """The check runs on the event loop, holding the GIL: a cost per JSON string (a regex taking 350,000 strings of
    one `[` out built an object for each, 62 MB for a 1.4 MB body) stalled every stream. Measured in memory, not
    time, so that it holds on any CPU."""
    import tracemalloc

    raw = json.dumps({"prompt": ["["] * 350_000}, separators=(",", ":")).encode()
    tracemalloc.start()
    try:
        assert _num_brackets_outside_strings(raw) == 2
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * len(raw), f"{peak:,} bytes at peak to check a body of {len(raw):,}"
