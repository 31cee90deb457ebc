"""INT4 KV keeps a partly filled block's tokens in a staging row. A copy-on-write copy reads that row, so it must
still be there when the block's last other holders are preempted in the same step and the block is freed (and
even taken by another sequence) before the copies are made (issue 31)."""
import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_model

PROMPT_A = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(2)).tolist()  # 1 full block + 4
PROMPT_B = torch.randint(3, 256, (16,), generator=torch.Generator().manual_seed(3)).tolist()  # exactly 1 block
SAMPLES = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=30, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("int4-cow"), "llama-gqa")


def int4_llm(model_dir, num_blocks: int | None) -> LLM:
    options = dict(max_model_len=64, kv_cache_dtype="int4", enforce_eager=True)
    if num_blocks is None:
        return LLM(str(model_dir), kv_cache_memory="1MiB", **options)
    block_bytes = LLM(str(model_dir), kv_cache_memory="1MiB", **options).engine.cache_plan.block_bytes
    llm = LLM(str(model_dir), kv_cache_memory=num_blocks * block_bytes, **options)
    assert llm.engine.kv.pool.num_blocks == num_blocks
    return llm


def run(llm: LLM) -> list[list[int]]:
    a, b = llm.generate([PROMPT_A, PROMPT_B], [SAMPLES, GREEDY])
    return [c.token_ids for c in a.outputs] + [b.outputs[0].token_ids]


def test_a_copy_on_write_source_freed_by_preemption_in_the_same_step_keeps_its_staged_tokens(model_dir):
    """Four blocks: A's three samples share its prompt's 2 blocks, B holds 1. In the first decode step sample 0
    copies the shared partly filled block into the last free one; B then needs a block, so samples 2 and 1 are
    preempted, which frees the copied block, and B takes it, all before the step's copies are made."""
    expected = run(int4_llm(model_dir, None))
    llm = int4_llm(model_dir, num_blocks=4)
    cache, steps = llm.engine.cache, []
    begin_step = cache.begin_step

    def recording_begin_step(freed_blocks, copies, slot_mappings):
        steps.append((list(freed_blocks), list(copies)))
        begin_step(freed_blocks, copies, slot_mappings)

    cache.begin_step = recording_begin_step
    assert run(llm) == expected
    assert any(src in freed for freed, copies in steps for src, _ in copies), "the case did not happen"
    assert llm.stats()["num_preemptions"] >= 2
