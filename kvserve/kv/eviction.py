"""KV eviction policies: which whole blocks a sequence may drop from its table to bound its memory.

- StreamingLLM (`streaming`): keep the first `sink_tokens` ("attention sinks") and a window of the last
  `recent_tokens`; every query attends to exactly those, so a sequence streams on in fixed memory, past
  max_model_len. As in the paper, positions are those within the cache: a query's distance to a window key is
  the true one, its distance to the sinks is what it would be with the window right after them.
- H2O (`h2o`): keep the sinks, the recent window and the blocks that received the most attention ("heavy
  hitters") within `budget_tokens`; positions stay the original ones.
- Per head (`adakv`, `adakv-keydiff`, `adakv-knorm`, `perhead`, `perhead-mix`, `perhead-span`, `perhead-observed`,
  `perhead-observed-span`): each (layer, KV head) keeps its own tokens, per token rather than per block, in its own
  stream of head blocks (HeadBudgetPolicy; kv/head_manager.py).

Eviction is per block (16 tokens): a block is dropped only when no query will read it again (streaming) or when
its accumulated attention is the lowest among the droppable ones (h2o, summing its tokens' scores: a block
shares one slot range, so a per-block score is what can be freed). A dropped block shared with another
sequence only loses this sequence's reference.

A policy that needs more of attention than its output (H2O's scores, StreamingLLM's rotated sink queries) wraps
the cache's reader in a scored one once, at start (`attention_reader`, kv/scored_attention.py)."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv.readers import AttentionReader, GatherReader
from kvserve.kv.scored_attention import AttentionScores, H2OScoredReader, SinkScoredReader
from kvserve.planner.kv_size import eviction_max_blocks, round_up_to_blocks as blocks_for


@dataclass(frozen=True)
class EvictionPolicy:
    """No eviction: every block of a sequence stays until it finishes."""

    name: str = "none"
    sink_tokens: int = 0
    recent_tokens: int = 0
    budget_tokens: int = 0

    @property
    def evicts(self) -> bool:
        return self.name != "none"

    @property
    def unbounded_length(self) -> bool:
        """A sequence may grow past max_model_len (its positions stay within the cache)."""
        return False

    @property
    def needs_attention_scores(self) -> bool:
        return False

    @property
    def per_head(self) -> bool:
        """Whether each (layer, KV head) keeps its own tokens in its own stream (HeadBudgetPolicy)."""
        return False

    def max_blocks(self, block_size: int) -> int | None:
        """The most blocks a sequence holds between steps, or None when unbounded."""
        return eviction_max_blocks(self.name, self.sink_tokens, self.recent_tokens, self.budget_tokens, block_size)

    def exact_tokens(self) -> int | None:
        """Tokens from the start whose K/V equal an uncompressed run's whatever was evicted (prefix caching may
        share their blocks); None: all of them, until the first eviction."""
        return None

    def blocks_to_drop(self, logical: list[int], next_position: int, block_size: int,
                       block_scores: list[float] | None = None) -> list[int]:
        """Indices into the kept blocks (`logical` holds each one's block number) to drop before the query at
        `next_position`."""
        return []

    def attention_reader(self, reader: AttentionReader, scores: AttentionScores | None) -> AttentionReader:
        """The reader attention uses under this policy, given the cache's own: that one, for no eviction."""
        return reader


@dataclass(frozen=True)
class StreamingPolicy(EvictionPolicy):
    name: str = "streaming"

    @property
    def unbounded_length(self) -> bool:
        return True

    def exact_tokens(self) -> int:
        return self.sink_tokens + self.recent_tokens  # later queries already see a pruned context

    def blocks_to_drop(self, logical, next_position, block_size, block_scores=None) -> list[int]:
        sink_blocks = blocks_for(self.sink_tokens, block_size)
        window_start = next_position - self.recent_tokens + 1  # the oldest key any later query reads
        return [i for i, b in enumerate(logical) if b >= sink_blocks and (b + 1) * block_size <= window_start]

    def attention_reader(self, reader: GatherReader, scores: AttentionScores | None) -> SinkScoredReader:
        """Sink keys scored with the query rotated back by their gap, where a query's window has left them."""
        return SinkScoredReader(reader)


@dataclass(frozen=True)
class H2OPolicy(EvictionPolicy):
    name: str = "h2o"

    @property
    def needs_attention_scores(self) -> bool:
        return True

    def blocks_to_drop(self, logical, next_position, block_size, block_scores=None) -> list[int]:
        keep = blocks_for(self.budget_tokens, block_size)
        excess = len(logical) - keep
        if excess <= 0:
            return []
        sink_blocks = blocks_for(self.sink_tokens, block_size)
        recent_from = (next_position - self.recent_tokens) // block_size  # blocks holding the recent tokens
        last = next_position // block_size  # the block the next token goes to (or its predecessor, if new)
        droppable = [i for i, b in enumerate(logical) if sink_blocks <= b < min(recent_from, last)]
        droppable.sort(key=lambda i: block_scores[i])
        return sorted(droppable[:excess])

    def attention_reader(self, reader: GatherReader, scores: AttentionScores) -> H2OScoredReader:
        """Every group written out, the attention each key receives added to `scores`."""
        return H2OScoredReader(reader, scores)


@dataclass(frozen=True)
class HeadBudgetPolicy(EvictionPolicy):
    """Per-(layer, KV head) compression (`adakv`: expected attention, AdaKV's budgets; `adakv-layers`: the same
    budgets pooled over every layer's heads at once, so a layer may keep more than another; `adakv-knorm`: key norms;
    `perhead`: expected attention, every head the same count; `perhead-mix`: the same counts, half of each kept by
    expected attention and half by KeyDiff, kv/scorers.py's UnionScorer; `perhead-span`: the same, KeyDiff's scores
    pooled over SPAN_TOKENS neighbours first, kv/scorers.py's SpanScorer; `perhead-observed`: the attention the
    sequence's latest queries paid, every head the same count, kv/scorers.py's ObservedAttentionScorer;
    `perhead-observed-span`: `perhead-span` with that in place of expected attention; `headkv-span`: `perhead-span`
    with each head's share of the budget weighted by its retrieval score, engine/retrieval_heads.py;
    `headkv-observed-span`: `perhead-observed-span` so weighted): each head keeps its own
    tokens in its own stream of head blocks (kv/head_streams.py, kv/head_manager.py), `budget_tokens` per head on
    average, the sinks, the block being filled and the last `recent_tokens` always."""

    name: str = "adakv"
    scorer: str = "expected"
    adaptive: bool = True  # AdaKV's pooled budgets; False: every head of a layer keeps the same count
    across_layers: bool = False  # the budgets pooled over every (layer, head) of a sequence, not layer by layer
    retrieval_heads: bool = False  # each head's budget weighted by its retrieval score (HeadKV), not equal

    @property
    def per_head(self) -> bool:
        return True


SPAN_TOKENS = 9  # `perhead-span`'s window: KeyDiff's scores max-pooled over 9 tokens (docs/quality.md)
# name: (scorer, AdaKV's pooled budgets, pooled across layers too, budgets weighted by retrieval scores)
HEAD_POLICIES = {"adakv": ("expected", True, False, False), "adakv-layers": ("expected", True, True, False),
                 "adakv-knorm": ("knorm", True, False, False), "adakv-keydiff": ("keydiff", True, False, False),
                 "perhead": ("expected", False, False, False),
                 "perhead-mix": ("expected+keydiff", False, False, False),
                 "perhead-span": (f"expected+span{SPAN_TOKENS}(keydiff)", False, False, False),
                 "perhead-observed": ("observed", False, False, False),
                 "perhead-observed-span": (f"observed+span{SPAN_TOKENS}(keydiff)", False, False, False),
                 "headkv-span": (f"expected+span{SPAN_TOKENS}(keydiff)", False, False, True),
                 "headkv-observed-span": (f"observed+span{SPAN_TOKENS}(keydiff)", False, False, True)}


def make_policy(name: str, sink_tokens: int, recent_tokens: int, budget_tokens: int) -> EvictionPolicy:
    """The policy for EngineConfig's kv_eviction options (already validated there)."""
    if name in HEAD_POLICIES:
        scorer, adaptive, across_layers, retrieval_heads = HEAD_POLICIES[name]
        return HeadBudgetPolicy(name=name, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                                budget_tokens=budget_tokens, scorer=scorer, adaptive=adaptive,
                                across_layers=across_layers, retrieval_heads=retrieval_heads)
    if name == "streaming":
        return StreamingPolicy(sink_tokens=sink_tokens, recent_tokens=recent_tokens)
    if name == "h2o":
        return H2OPolicy(sink_tokens=sink_tokens, recent_tokens=recent_tokens, budget_tokens=budget_tokens)
    return EvictionPolicy()

