"""`kvserve chat`: a multi-turn conversation through the model's chat template, each reply equal to what the
offline API gives for the same messages, and later turns reusing the earlier ones from the prefix cache."""
import re

import pytest

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from tests.conftest import make_tiny_chat_model

ENGINE_ARGS = ["--kv-cache-memory", "16MiB", "--max-model-len", "512", "--max-tokens", "8"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("chat") / "tiny-chat")


def test_chat_keeps_the_conversation_and_reuses_it(model_dir, monkeypatch, capsys):
    lines = iter(["Hello there", "And a second question", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", str(model_dir), *ENGINE_ARGS]) == 0
    out, err = capsys.readouterr()
    replies = out.splitlines()

    llm = LLM(str(model_dir), kv_cache_memory="16MiB", max_model_len=512)
    params = SamplingParams(max_tokens=8, temperature=0)
    first = llm.chat([{"role": "user", "content": "Hello there"}], params).outputs[0].text
    second = llm.chat([{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first},
                       {"role": "user", "content": "And a second question"}], params).outputs[0].text
    assert replies == [first, second]
    reused = [int(n.replace(",", "")) for n in re.findall(r"prefix cache: ([\d,]+) of", err)]
    assert reused[0] == 0 and reused[1] > 0  # turn 2's prompt starts with turn 1's
