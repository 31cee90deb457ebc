"""`kvserve plan --kv-disk-cache-size`: how many tokens and whole conversations a disk tier holds, beside the pool."""
import json

from kvserve.cli import main

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
