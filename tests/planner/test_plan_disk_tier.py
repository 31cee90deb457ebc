"""`kvserve plan --kv-disk-cache-size`: how many tokens and whole conversations a disk tier holds, beside the pool
(a hybrid model's state checkpoints included)."""
import json

from kvserve.cli import main
from kvserve.planner.kv_size import kv_bytes_per_token, resolve_kv_dtype, state_slot_bytes
from kvserve.planner.loaders import load_model_spec
from kvserve.planner.units import format_bytes

LLAMA_8B_BYTES_PER_TOKEN = 131_072  # bf16: 2 × 32 layers × 8 KV heads × 128 × 2 B


def test_disk_tier_tokens_count_every_block_record_and_its_header(capsys):
    assert main(["plan", "llama-3.1-8b", "--kv-disk-cache-size", "100GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    record_bytes = 16 * LLAMA_8B_BYTES_PER_TOKEN + 1024
    assert data["disk_cache_tokens"] == 100 * 2**30 // record_bytes * 16 == 818_800


def test_disk_tier_line_compares_with_the_pool_in_conversations(capsys):
    assert main(["plan", "llama-3.1-8b", "--gpu", "h100-80", "--conversation", "--kv-disk-cache-size", "100GiB"]) == 0
    assert ("disk tier (--kv-disk-cache-size 100.00 GiB): 818,800 tokens in blocks of 16, 1.8x the pool's; 102 whole "
            "conversations of 8,000 tokens (the pool: 56)") in capsys.readouterr().out.replace("\n", " ")


def test_a_hybrid_models_conversations_on_disk_count_the_state_checkpoints_each_turn_leaves(capsys):
    """Qwen3-Next: 12 attention layers keep KV blocks, 36 linear layers a state slot; each turn saves up to two
    checkpoints of a whole slot to the disk tier, which holds far fewer conversations than its blocks alone allow."""
    spec = load_model_spec("qwen3-next-80b-a3b")
    args = ["plan", "qwen3-next-80b-a3b", "--conversation", "--kv-disk-cache-size", "100GiB", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    block_record = 16 * kv_bytes_per_token(spec, resolve_kv_dtype("auto", spec)) + 1024
    state_record = state_slot_bytes(spec) + 1024
    assert data["disk_state_record_bytes"] == state_record > 10 * block_record
    assert data["disk_cache_tokens"] == 100 * 2**30 // block_record * 16
    turns, final_tokens = 10, 8_000  # the --conversation defaults
    whole = 100 * 2**30 // (final_tokens // 16 * block_record + 2 * turns * state_record)
    assert data["disk_conversations"] == whole < data["disk_cache_tokens"] // final_tokens // 5
    assert main(args[:-1]) == 0
    assert (f"each request also leaves up to 2 state checkpoints of {format_bytes(state_record)} there"
            in capsys.readouterr().out.replace("\n", " "))
    assert main(["plan", "llama-3.1-8b", "--conversation", "--kv-disk-cache-size", "100GiB", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["disk_state_record_bytes"] == 0 and plain["disk_conversations"] == 818_800 // 8_000
