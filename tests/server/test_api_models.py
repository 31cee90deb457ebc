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
