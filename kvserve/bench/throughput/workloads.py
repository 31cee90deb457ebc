"""What `kvserve bench throughput` runs: synthetic prompts of fixed seeds and lengths in three mixes (decode-heavy,
prefill-heavy, long-context) and the rewrite workload's real documents, each with its number of new tokens."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.bench.rewrite import RewriteWorkload

LONG_CONTEXT_KV_MEMORY = "4GiB"  # 16 x 4,128 tokens of SmolLM2's float32 KV (45 KiB/token) is 2.9 GiB


@dataclass(frozen=True)
class Workload:
    num_requests: int = 32
    min_prompt_len: int = 64
    max_prompt_len: int = 512
    output_len: int = 128
    seed: int = 0
    name: str = "decode-heavy"

    def prompts(self, vocab_size: int, tokenizer=None) -> list[list[int]]:
        import torch

        g = torch.Generator().manual_seed(self.seed)
        lengths = torch.randint(self.min_prompt_len, self.max_prompt_len + 1, (self.num_requests,), generator=g)
        # stay clear of the special tokens at both ends of the vocabulary
        return [torch.randint(100, vocab_size - 100, (int(n),), generator=g).tolist() for n in lengths]

    @property
    def max_len(self) -> int:
        return self.max_prompt_len + self.output_len

    def describe(self, prompts: list[list[int]]) -> str:
        return (f"{self.name}: {len(prompts)} requests, prompts {self.min_prompt_len}-{self.max_prompt_len} tokens "
                f"({sum(map(len, prompts)):,} in all), {self.output_len} output tokens each")


PREFILL_HEAVY = Workload(12, 50, 400, 48, name="prefill-heavy")
LONG_CONTEXT = Workload(16, 4096, 4096, 32, name="long-context")
WORKLOADS = ("decode", "prefill", "long-context", "rewrite")


def selected_workloads(names: list[str], decode_heavy: Workload) -> dict[str, Workload]:
    """The workloads named (each once, in the order given), the decode-heavy one as the options shaped it."""
    every = {"decode": decode_heavy, "prefill": PREFILL_HEAVY, "long-context": LONG_CONTEXT,
             "rewrite": RewriteWorkload()}
    return {name: every[name] for name in dict.fromkeys(names)}


def kv_cache_memory(option: str | None, workloads: dict[str, Workload]) -> str | None:
    """kvserve's KV cache size: the option's, else room for long-context's prompts where it runs (else the engine's)."""
    return option or (LONG_CONTEXT_KV_MEMORY if "long-context" in workloads else None)
