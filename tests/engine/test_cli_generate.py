"""`kvserve generate` streams the completion to stdout as it is produced: the same text the offline API gives."""
import argparse
import sys

import pytest

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.engine.cli import add_engine_args, engine_config_from_args
from tests.conftest import make_tiny_model
from tests.conftest import save_char_tokenizer

ENGINE_ARGS = ["--kv-cache-memory", "1MiB", "--max-model-len", "64"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_char_tokenizer(make_tiny_model(tmp_path_factory.mktemp("cli"), "llama-gqa"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=64)


def test_generate_prints_the_greedy_completion(model_dir, llm, capsys):
    expected = llm.generate("hello world", SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    assert expected

    assert main(["generate", "hello", "world", "--model", str(model_dir), "--max-tokens", "12", *ENGINE_ARGS]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_generate_streams_piece_by_piece(model_dir, llm, monkeypatch):
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3)
    expected = llm.generate("hello", params)[0].outputs[0].text
    writes: list[str] = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stdout", Recorder())
    main(["generate", "hello", "--model", str(model_dir), "--max-tokens", "8", "--temperature", "0.8",
          "--sampling-seed", "3", *ENGINE_ARGS])
    monkeypatch.undo()
    pieces = [w for w in writes if w]
    assert "".join(pieces) == expected + "\n"  # the sampling options reach the request
    assert len(pieces) >= 3  # text in more than one piece, then the newline


@pytest.mark.parametrize("option, message", [
    (["--block-size", "0"], "block_size must be a positive integer"),
    (["--block-size", "15", "--kv-cache-dtype", "int4"], "block_size must be a multiple of 2, got 15"),
    (["--kv-cache-memory", "64TiB"], "is more than this machine's memory"),  # not an allocator traceback
])
def test_generate_refuses_bad_engine_options_with_a_message(model_dir, capsys, option, message):
    assert main(["generate", "hi", "--model", str(model_dir), *ENGINE_ARGS, *option]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvserve generate: ") and message in err and "Traceback" not in err


def test_enforce_eager_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--enforce-eager"])).enforce_eager is True
    assert engine_config_from_args(parser.parse_args([])).enforce_eager is False
