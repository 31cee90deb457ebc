"""The disk tier in the engine (--kv-disk-cache): a prefix the pool evicted (even before the writer thread wrote
it), or that an earlier engine computed, is read back bit for bit in every KV format and every layer group of a
hybrid model, and greedy output is the same from the pool, from disk and recomputed; another model, format or
cache_salt never hits; a record that fails its check halfway through a prefix costs only the blocks after it, and
every block goes back to the pool; other requests run while a prefix is read."""
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.kv.block_hash import hash_full_blocks
from kvserve.kv.tiers import disk as disk_module
from kvserve.kv.tiers import store as store_module
from kvserve.kv.tiers import writer as writer_module
from kvserve.kv.tiers.chain_read import ChainRead
from kvserve.kv.tiers.store import DiskBlockStore
from tests.conftest import make_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
FORMATS = ["float32", "bfloat16", "fp8", "int8", "int4", "nuq4", "nuq3", "nuq3k4v"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama-gqa")


@pytest.fixture(scope="module")
def gemma_hybrid(tmp_path_factory):
    """Layer groups of one layer each: sliding, sliding, full, sliding (a 32-token window)."""
    return make_tiny_model(tmp_path_factory.mktemp("gemma"), "gemma3-mqa", num_hidden_layers=4, sliding_window=32,
                           max_position_embeddings=512,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                        "sliding_attention"])


def engine(model_dir, disk_dir, **options) -> LLM:
    return LLM(str(model_dir), **{"kv_cache_memory": "1MiB", "max_model_len": 512, "enforce_eager": True,
                                  "kv_disk_cache": str(disk_dir), **options})


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def written(llm: LLM) -> LLM:
    assert llm.engine.disk_cache.store.flush(10)
    return llm


def generated_and_written(llm: LLM, request: list[int] | dict):
    """Generate greedily, then wait until the blocks are on disk."""
    output = llm.generate(request, GREEDY)[0]
    written(llm)
    return output


def prefix_keys(llm: LLM, tokens: list[int], num_blocks: int) -> list[bytes]:
    """The pool keys of a prompt's first `num_blocks` blocks, each group's (a hybrid model's end in the group)."""
    chain = hash_full_blocks(tokens[: num_blocks * 16], 16, namespace=llm.engine.config.kv_cache_format)
    groups = llm.engine.layout.num_groups
    return chain if groups == 1 else [key + bytes([g]) for key in chain for g in range(groups)]


def pool_bytes(llm: LLM, keys: list[bytes]) -> dict[bytes, list[bytes]]:
    """The bytes (every tensor of the format) of each of `keys` the pool's prefix index holds."""
    pool, cache = llm.engine.kv.pool, llm.engine.cache
    blocks = {key: pool.lookup(key) for key in keys}
    return {key: [t.view(-1).view(torch.uint8).numpy().tobytes() for t in cache.export_block(block.block_id)]
            for key, block in blocks.items() if block is not None}


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_a_restarted_engine_reads_the_prefix_back_bitwise_with_the_same_output(llama, tmp_path, kv_cache_dtype):
    tokens = prompt(100)
    first = engine(llama, tmp_path, kv_cache_dtype=kv_cache_dtype)
    recomputed = first.generate(tokens, GREEDY)[0]
    from_pool = first.generate(tokens, GREEDY)[0]
    written(first)
    second = engine(llama, tmp_path, kv_cache_dtype=kv_cache_dtype)
    from_disk = second.generate(tokens, GREEDY)[0]
    assert (recomputed.num_cached_tokens, from_pool.num_cached_tokens, from_disk.num_cached_tokens) == (0, 96, 96)
    assert (from_pool.num_disk_cached_tokens, from_disk.num_disk_cached_tokens) == (0, 96)
    assert from_disk.outputs[0].token_ids == from_pool.outputs[0].token_ids == recomputed.outputs[0].token_ids
    stats = second.stats()
    assert stats["disk_cache_hit_tokens"] == 96 and stats["disk_cache_reads"] == 6
    assert stats["num_prefill_tokens"] == 4  # the last prompt token and the partial block's
    keys = prefix_keys(first, tokens, 6)
    assert pool_bytes(second, keys) == pool_bytes(first, keys) and len(pool_bytes(second, keys)) == 6


def test_a_hit_is_split_by_tier_between_the_pool_and_the_disk(llama, tmp_path):
    tokens = prompt(100)
    generated_and_written(engine(llama, tmp_path), tokens)
    llm = engine(llama, tmp_path)
    head = llm.generate(tokens[:50], GREEDY)[0]  # reads 3 blocks from disk; they stay in the pool
    whole = llm.generate(tokens, GREEDY)[0]  # the pool holds those 3, the disk the next 3
    assert (head.num_cached_tokens, head.num_disk_cached_tokens) == (48, 48)
    assert (whole.num_cached_tokens, whole.num_disk_cached_tokens) == (96, 48)
    again = llm.generate(tokens, GREEDY)[0]  # all in the pool now
    assert (again.num_cached_tokens, again.num_disk_cached_tokens) == (96, 0)


def test_every_layer_group_of_a_hybrid_model_is_restored(gemma_hybrid, tmp_path):
    tokens = prompt(150)
    first = engine(gemma_hybrid, tmp_path)
    recomputed = first.generate(tokens, GREEDY)[0]
    written(first)
    second = engine(gemma_hybrid, tmp_path)
    from_disk = second.generate(tokens, GREEDY)[0]
    assert from_disk.num_cached_tokens == 144 and from_disk.outputs[0].token_ids == recomputed.outputs[0].token_ids
    # the full group needs all 9 blocks; each of the 3 sliding groups only the 32-token window before token 144
    assert second.stats()["disk_cache_reads"] == 9 + 3 * 2
    keys = prefix_keys(first, tokens, 9)
    restored = pool_bytes(second, keys)
    assert len(restored) == 15 and {key[-1] for key in restored} == {0, 1, 2, 3}
    assert restored == {key: value for key, value in pool_bytes(first, keys).items() if key in restored}


def test_a_prefix_the_pool_evicted_comes_back_from_disk(llama, tmp_path):
    tokens, others = prompt(300), [prompt(300, seed) for seed in (1, 2, 3, 4, 5, 6)]
    llm = engine(llama, tmp_path, kv_cache_memory="384KiB")  # 48 blocks: the other prompts push the first one out
    reference = llm.generate(tokens, GREEDY)[0]
    for other in others:
        llm.generate(other, GREEDY)
    written(llm)
    assert all(llm.engine.kv.pool.lookup(key) is None for key in prefix_keys(llm, tokens, 18))
    again = llm.generate(tokens, GREEDY)[0]
    assert again.num_cached_tokens == 288 and again.outputs[0].token_ids == reference.outputs[0].token_ids
    assert llm.stats()["disk_cache_hit_tokens"] == 288


def test_a_prefix_the_pool_evicted_before_the_writer_wrote_it_comes_back_from_its_queue(llama, tmp_path,
                                                                                         monkeypatch):
    """The writer thread can be behind the step thread (a busy machine): a prefix evicted from the pool before its
    blocks reached the disk is read from the writer's queue, with the same output, not recomputed."""
    held, write = threading.Event(), DiskBlockStore._write
    monkeypatch.setattr(DiskBlockStore, "_write", lambda self, r: held.wait(30) and write(self, r))
    tokens, others = prompt(300), [prompt(300, seed) for seed in (1, 2, 3, 4, 5, 6)]
    llm = engine(llama, tmp_path, kv_cache_memory="384KiB")  # 48 blocks: the other prompts push the first one out
    reference = llm.generate(tokens, GREEDY)[0]
    for other in others:
        llm.generate(other, GREEDY)
    assert all(llm.engine.kv.pool.lookup(key) is None for key in prefix_keys(llm, tokens, 18))
    assert not any(llm.engine.disk_cache.store.path(key).exists() for key in prefix_keys(llm, tokens, 18))
    again = llm.generate(tokens, GREEDY)[0]
    held.set()
    assert again.num_cached_tokens == 288 and again.outputs[0].token_ids == reference.outputs[0].token_ids
    stats = llm.stats()
    assert stats["disk_cache_queued_reads"] == 18 and stats["disk_cache_reads"] == 0
    written(llm)


def test_another_model_or_format_never_hits(llama, tmp_path, tmp_path_factory):
    tokens = prompt(100)
    generated_and_written(engine(llama, tmp_path), tokens)
    other_model = make_tiny_model(tmp_path_factory.mktemp("other"), "llama-gqa", seed=1)
    for llm in (engine(other_model, tmp_path), engine(llama, tmp_path, kv_cache_dtype="int8"),
                engine(llama, tmp_path, dtype="bfloat16")):
        assert llm.generate(tokens, GREEDY)[0].num_cached_tokens == 0
        assert llm.stats()["disk_cache_reads"] == 0


def test_salts_stay_apart_across_a_restart(llama, tmp_path):
    tokens = prompt(100)
    generated_and_written(engine(llama, tmp_path), {"prompt_token_ids": tokens, "cache_salt": "tenant-a"})
    llm = engine(llama, tmp_path)
    assert llm.generate({"prompt_token_ids": tokens, "cache_salt": "tenant-b"}, GREEDY)[0].num_cached_tokens == 0
    assert llm.generate(tokens, GREEDY)[0].num_cached_tokens == 0
    again = engine(llama, tmp_path)
    assert again.generate({"prompt_token_ids": tokens, "cache_salt": "tenant-a"}, GREEDY)[0].num_cached_tokens == 96


def test_a_bad_record_halfway_costs_only_the_blocks_after_it(llama, tmp_path, caplog):
    tokens = prompt(100)
    first = engine(llama, tmp_path)
    reference = first.generate(tokens, GREEDY)[0]
    damaged = written(first).engine.disk_cache.store.path(chain_key(first, tokens, 3))  # the 4th of 6 blocks
    damaged.write_bytes(damaged.read_bytes()[:-50])
    second = engine(llama, tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        out = second.generate(tokens, GREEDY)[0]
    assert out.num_cached_tokens == 48 and out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert second.stats()["disk_cache_errors_corrupt"] == 1 and "rejected (corrupt" in caplog.text
    written(second)  # the record was removed and the recomputed block written again: the next engine reads it all
    assert engine(llama, tmp_path).generate(tokens, GREEDY)[0].num_cached_tokens == 96


def chain_key(llm: LLM, tokens: list[int], block: int) -> bytes:
    return prefix_keys(llm, tokens, block + 1)[block]


def test_two_engines_on_one_directory_read_each_others_blocks(llama, tmp_path):
    a, b = engine(llama, tmp_path), engine(llama, tmp_path)
    prompt_a, prompt_b = prompt(100, 1), prompt(100, 2)
    out_a, out_b = a.generate(prompt_a, GREEDY)[0], b.generate(prompt_b, GREEDY)[0]
    written(a), written(b)
    assert b.generate(prompt_a, GREEDY)[0].outputs[0].token_ids == out_a.outputs[0].token_ids
    assert a.generate(prompt_b, GREEDY)[0].outputs[0].token_ids == out_b.outputs[0].token_ids
    assert a.stats()["disk_cache_hit_tokens"] == b.stats()["disk_cache_hit_tokens"] == 96


def test_options_are_validated_and_off_by_default(llama, tmp_path):
    assert EngineConfig().kv_disk_cache is None
    assert "disk_cache_bytes" not in LLM(str(llama), kv_cache_memory="1MiB", max_model_len=512).stats()
    with pytest.raises(ValueError, match="cannot read 'lots' as a size"):
        EngineConfig(kv_disk_cache=str(tmp_path), kv_disk_cache_size="lots")
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        EngineConfig(kv_disk_cache=str(tmp_path), enable_prefix_caching=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot write there"):
        engine(llama, tmp_path / "file" / "kv")


def test_blocks_an_eviction_policy_changed_are_never_written(llama, tmp_path):
    llm = engine(llama, tmp_path, kv_eviction="streaming", kv_sink_tokens=4, kv_recent_tokens=32)
    llm.generate(prompt(200), GREEDY)
    # StreamingLLM keeps what an uncompressed run holds for the first sinks + recent = 36 tokens: 2 full blocks
    assert written(llm).stats()["disk_cache_writes"] == 2


def test_other_requests_run_while_a_prefix_is_read_from_disk(llama, tmp_path, monkeypatch):
    tokens = prompt(100)
    first = engine(llama, tmp_path)
    reference = first.generate(tokens, GREEDY)[0]
    written(first)
    gate, run = threading.Event(), ChainRead.run
    monkeypatch.setattr(ChainRead, "run", lambda self: gate.wait(10) and run(self))
    llm = engine(llama, tmp_path).engine
    llm.add_request("from-disk", tokens, GREEDY)
    llm.add_request("other", prompt(40, seed=5), GREEDY)
    finished = {}
    while "other" not in finished:  # the reads are held back: only the other request can move
        finished.update({out.request_id: out for out in llm.step() if out.finished})
    assert "from-disk" not in finished and llm.requests["from-disk"].sequences[0].num_computed_tokens == 0
    gate.set()
    while llm.has_unfinished_requests():
        finished.update({out.request_id: out for out in llm.step() if out.finished})
    assert finished["from-disk"].num_cached_tokens == 96
    assert finished["from-disk"].outputs[0].token_ids == reference.outputs[0].token_ids


def test_a_request_aborted_while_its_prefix_is_read_gives_every_block_back(llama, tmp_path, monkeypatch):
    tokens = prompt(100)
    generated_and_written(engine(llama, tmp_path), tokens)
    gate, run = threading.Event(), ChainRead.run
    monkeypatch.setattr(ChainRead, "run", lambda self: gate.wait(10) and run(self))
    llm = engine(llama, tmp_path).engine
    llm.add_request("from-disk", tokens, GREEDY)
    assert llm.step() == [] and llm.kv.pool.num_used_blocks == 6  # taken for the reads
    llm.abort_request("from-disk")
    assert llm.kv.pool.num_used_blocks == 0 and llm.kv.pool.num_cached_blocks == 0
    gate.set()


def test_a_prefix_is_recomputed_where_that_is_faster_than_reading_it(llama, tmp_path, caplog):
    tokens = prompt(100)
    generated_and_written(engine(llama, tmp_path), tokens)
    llm = engine(llama, tmp_path)
    tier = llm.engine.disk_cache
    tier.cost.read_bytes_per_s, tier.cost.prefill_tokens_per_s = 1e3, 1e6  # a slow disk beside a fast prefill
    with caplog.at_level(logging.INFO, logger="kvserve"):
        out = llm.generate(tokens, GREEDY)[0]
    assert out.num_cached_tokens == 0 and llm.stats()["disk_cache_recomputed_tokens"] == 96
    assert llm.stats()["disk_cache_reads"] == 0 and "rather than reading them" in caplog.text
    fast = engine(llama, tmp_path)
    fast.engine.disk_cache.cost.read_bytes_per_s, fast.engine.disk_cache.cost.prefill_tokens_per_s = 1e9, 1e3
    assert fast.generate(tokens, GREEDY)[0].num_cached_tokens == 96 and fast.stats()["disk_cache_reads"] == 6


def behind_writer(llm: LLM, monkeypatch) -> threading.Event:
    """Make the writer take at most two records at a time and hold its writes until the returned event is set."""
    gate, write = threading.Event(), DiskBlockStore._write
    monkeypatch.setattr(writer_module, "MAX_PENDING_BYTES", 2 * llm.engine.disk_cache.record_bytes)
    monkeypatch.setattr(DiskBlockStore, "_write", lambda self, record: (gate.wait(60), write(self, record))[1])
    return gate


def test_blocks_skipped_while_the_writer_was_behind_are_written_once_it_has_room(llama, tmp_path, monkeypatch):
    tokens, later = prompt(200), prompt(40, seed=7)
    llm = engine(llama, tmp_path)
    gate = behind_writer(llm, monkeypatch)
    llm.generate(tokens, GREEDY)  # 13 full blocks (200 prompt + 11 generated tokens): two queued, the rest skipped
    assert llm.stats()["disk_cache_writes_skipped"] == 11 and llm.stats()["disk_cache_writes"] == 0
    gate.set()
    assert llm.engine.disk_cache.store.flush(10)
    llm.generate(later, GREEDY)  # registering its blocks hands skipped ones again, room permitting
    assert llm.stats()["disk_cache_writes_retried"] >= 1
    assert llm.engine.disk_cache.flush(10)  # what a clean exit does: the rest
    stats = llm.stats()
    assert stats["disk_cache_writes_retried"] == stats["disk_cache_writes_skipped"]
    assert all(llm.engine.disk_cache.contains(key) for key in prefix_keys(llm, tokens, 13))
    again = engine(llama, tmp_path).generate(tokens, GREEDY)[0]
    assert again.num_disk_cached_tokens == 192  # the prompt's 12 full blocks


def test_a_skipped_block_the_pool_no_longer_holds_is_never_written(llama, tmp_path, monkeypatch):
    tokens = prompt(300)
    llm = engine(llama, tmp_path, kv_cache_memory="384KiB")  # 48 blocks
    gate = behind_writer(llm, monkeypatch)
    llm.generate(tokens, GREEDY)
    for seed in (1, 2, 3, 4):  # push the first prompt's blocks out of the pool
        llm.generate(prompt(300, seed), GREEDY)
    assert all(llm.engine.kv.pool.lookup(key) is None for key in prefix_keys(llm, tokens, 18))
    gate.set()
    assert llm.engine.disk_cache.flush(10)
    on_disk = [llm.engine.disk_cache.contains(key) for key in prefix_keys(llm, tokens, 18)]
    assert on_disk[:2] == [True, True] and not any(on_disk[2:])  # the two queued; the skipped were gone


EXITING_WRITER = """
import sys, threading, time
from kvserve import LLM, SamplingParams
from kvserve.kv.tiers import writer as writer_module
from kvserve.kv.tiers.store import DiskBlockStore

llm = LLM(sys.argv[1], kv_cache_memory="1MiB", max_model_len=512, enforce_eager=True, kv_disk_cache=sys.argv[2])
writer_module.MAX_PENDING_BYTES = 2 * llm.engine.disk_cache.record_bytes
write = DiskBlockStore._write
DiskBlockStore._write = lambda self, record: time.sleep(0.05) or write(self, record)
llm.generate([int(t) for t in sys.argv[3].split(",")], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
print(llm.stats()["disk_cache_writes_skipped"], llm.stats()["disk_cache_writes"], flush=True)
"""  # and exits, without a flush of its own


def test_a_clean_exit_writes_what_the_pool_holds_that_the_disk_lacks(llama, tmp_path):
    tokens = prompt(200)
    done = subprocess.run([sys.executable, "-c", EXITING_WRITER, str(llama), str(tmp_path), ",".join(map(str, tokens))],
                          cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    skipped, written_before_exit = map(int, done.stdout.split())
    assert skipped >= 10 and written_before_exit < 13  # the exit had work to do
    again = engine(llama, tmp_path).generate(tokens, GREEDY)[0]
    assert again.num_disk_cached_tokens == 192


def in_place_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def in_place_sparse_file(path: Path) -> None:
    with open(path, "r+b") as file:
        file.truncate(1 << 40)  # 1 TiB, none of it on disk


def in_place_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def in_place_symlink(path: Path) -> None:
    target = path.parent.parent / "elsewhere"
    os.replace(path, target)
    path.symlink_to(target)


@pytest.mark.parametrize("hostile, kind", [(in_place_directory, "not_regular"), (in_place_sparse_file, "oversized"),
                                           (in_place_fifo, "not_regular"), (in_place_symlink, "not_regular")])
def test_an_odd_file_in_place_of_a_record_is_a_miss_and_the_engine_serves_on(llama, tmp_path, hostile, kind):
    tokens, other = prompt(100), prompt(100, seed=3)
    first = engine(llama, tmp_path)
    reference, other_reference = first.generate(tokens, GREEDY)[0], first.generate(other, GREEDY)[0]
    path = written(first).engine.disk_cache.store.path(chain_key(first, tokens, 3))  # the 4th of 6 blocks
    hostile(path)
    for restart in range(2):  # removed and written again by the first restart; a directory stays, and still a miss
        still_there = restart == 0 or path.is_dir()
        llm = engine(llama, tmp_path)
        out = llm.generate(tokens, GREEDY)[0]
        assert out.num_cached_tokens == (48 if still_there else 96)
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
        assert llm.stats()[f"disk_cache_errors_{kind}"] == int(still_there)
        assert llm.generate(other, GREEDY)[0].outputs[0].token_ids == other_reference.outputs[0].token_ids
        assert llm.generate(tokens, GREEDY)[0].outputs[0].token_ids == reference.outputs[0].token_ids
        written(llm)


def test_an_unforeseen_error_while_reading_is_a_miss_not_a_failed_step(llama, tmp_path, monkeypatch, caplog):
    tokens = prompt(100)
    reference = generated_and_written(engine(llama, tmp_path), tokens)

    def unforeseen(self):
        raise RuntimeError("something no one foresaw")

    monkeypatch.setattr(ChainRead, "run", unforeseen)
    llm = engine(llama, tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        out = llm.generate(tokens, GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert llm.stats()["disk_cache_errors_unexpected"] == 1 and "something no one foresaw" in caplog.text


def test_a_read_slower_than_the_bound_is_abandoned_as_a_miss(llama, tmp_path, monkeypatch):
    tokens = prompt(100)
    reference = generated_and_written(engine(llama, tmp_path), tokens)
    stuck = threading.Event()
    monkeypatch.setattr(store_module, "read_fd", lambda fd, size: stuck.wait())  # a disk that never answers
    monkeypatch.setattr(disk_module, "READ_TIMEOUT_S", 0.5)
    llm = engine(llama, tmp_path)
    out = llm.generate(tokens, GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert llm.stats()["disk_cache_errors_timeout"] == 1
    assert not llm.engine.disk_cache.contains(chain_key(llm, tokens, 0))  # the stuck record is not tried again
    assert llm.generate(tokens, GREEDY)[0].outputs[0].token_ids == reference.outputs[0].token_ids
    stuck.set()


STUCK_READER = """
import sys, threading
from kvserve import LLM, SamplingParams
from kvserve.kv.tiers import disk, store

store.read_fd = lambda fd, size: threading.Event().wait()  # a read that never returns
disk.READ_TIMEOUT_S = 0.5
llm = LLM(sys.argv[1], kv_cache_memory="1MiB", max_model_len=512, enforce_eager=True, kv_disk_cache=sys.argv[2])
out = llm.generate([int(t) for t in sys.argv[3].split(",")], SamplingParams(max_tokens=4, temperature=0.0))[0]
print(out.num_cached_tokens, llm.stats()["disk_cache_errors_timeout"], flush=True)
"""  # and exits, with the reader thread still stuck


def test_shutdown_never_waits_on_a_stuck_reader(llama, tmp_path):
    tokens = prompt(100)
    generated_and_written(engine(llama, tmp_path), tokens)
    done = subprocess.run([sys.executable, "-c", STUCK_READER, str(llama), str(tmp_path), ",".join(map(str, tokens))],
                          cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1"]
