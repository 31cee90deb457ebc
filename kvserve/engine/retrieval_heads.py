"""Retrieval heads (Wu et al., 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality"): the few
attention heads that copy a fact from far back in the context. `--kv-eviction headkv-span` and `headkv-observed-span`
(HeadKV, Fu et al., 2024) give each KV head a share of a sequence's K/V budget that grows with its retrieval score,
so the tokens stay where the copying happens (`head_weights`; docs/quality.md measures the rule).

A head's retrieval score is measured once per model and kept (`load_or_measure`): prompts of the standard library's
own reference prose (`pydoc_data.topics`, the default text of `kvserve eval`, from its 100,000th character on: the
evaluation reads the text's start) with one sentence naming a 7-digit code
put in at a random depth, the question after it and the answer appended (teacher forcing), run through transformers
with an attention function that also keeps the last rows' attention. For each answer token that the needle holds, a
query head scores a hit when its strongest attention (from the row that predicts the token) lands on that token in
the needle. A KV head's score is its best query head's share of hits. The prompts are not RULER-lite's (kvserve eval
--tasks ruler): other text, other wording, another generator."""
from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from pathlib import Path

import torch

from kvserve.private_files import not_private, write_private

logger = logging.getLogger("kvserve")

SAMPLES, PROMPT_TOKENS, SEED = 20, 2000, 7  # the measurement: 20 prompts of about 2,000 tokens, seeded
SLOPE = 4.0  # a head's share of the budget ∝ 1 + SLOPE·√score (docs/quality.md, "Retrieval heads get more")
METHOD = 1  # the measurement's version, part of the kept file's name: a change of method measures again
DIRECTORY_NAME = "retrieval-heads"
# past the text `kvserve eval` scores by default (its first tokens), so that no measurement there reads what chose
# the budgets
SKIP_CHARACTERS = 100_000
ROWS = 12  # the prompt's last rows whose attention is kept: those predicting the answer's tokens, with room
WORDS = ("cedar", "marble", "copper", "violet", "north", "silver", "harbor", "quartz", "willow", "ember")


def head_weights(scores: torch.Tensor, slope: float = SLOPE) -> torch.Tensor:
    """Each KV head's share of the per-head budget, [L, H]: 1 + slope·√score, scaled to average 1 (every head alike
    when none scores). The square root lets the many heads that copy now and then gain on the few that copy most."""
    raw = 1 + slope * scores.float().clamp(0, 1).sqrt()
    return raw / raw.mean()


def describe(scores: torch.Tensor, weights: torch.Tensor, source: str) -> str:
    """The start-up line's words for the measured heads."""
    L, H = scores.shape
    top = scores.flatten().argsort(descending=True)[:3].tolist()
    named = ", ".join(f"{i // H}.{i % H} ({float(scores.flatten()[i]):.2f})" for i in top)
    return (f"retrieval heads: each KV head keeps {float(weights.min()):.2f}x to {float(weights.max()):.2f}x the "
            f"per-head budget by its retrieval score ({int((scores > 0).sum())} of {L * H} heads copy at all; the "
            f"most, layer.head: {named}; {source})")


def load_or_measure(model_path: Path, num_layers: int, num_kv_heads: int, cache_dir: Path) -> tuple[torch.Tensor, str]:
    """The model's scores [L, KV heads] and where they came from: the kept file when it is this user's, readable and
    of the model's shape, else measured now (logged before it starts and, after, how long it took: 90 s for SmolLM2
    on two cores) and kept."""
    path = cache_dir / DIRECTORY_NAME / f"{model_digest(model_path)}-m{METHOD}.json"
    scores, problem = read_scores(path, num_layers, num_kv_heads)
    if scores is not None:
        return scores, f"measured before, kept in {path}"
    if problem is not None:
        logger.warning(f"measuring the retrieval heads again: {problem}")
    logger.info(f"measuring the retrieval heads of {model_path.name}: {SAMPLES} prompts of about {PROMPT_TOKENS} "
                "tokens through transformers, once for this model")
    start = time.perf_counter()
    scores = retrieval_scores(model_path)
    seconds = time.perf_counter() - start
    if tuple(scores.shape) != (num_layers, num_kv_heads):
        raise ValueError(f"transformers' model of {model_path} has {tuple(scores.shape)} (layers, KV heads), the "
                         f"engine's {num_layers, num_kv_heads}: its heads cannot be matched")
    write_private(path, json.dumps({"method": METHOD, "scores": scores.tolist()}))
    return scores, f"measured now over {SAMPLES} prompts in {seconds:.0f} s, kept in {path}"


def read_scores(path: Path, num_layers: int, num_kv_heads: int) -> tuple[torch.Tensor | None, str | None]:
    """The kept scores, or None and why not (None, None: no file yet). A file another user may have written, or one
    that is not this measurement of this shape, is not trusted."""
    if not path.exists():
        return None, None
    if (problem := not_private(path)) is not None:
        return None, problem
    try:
        found = json.loads(path.read_text())
        scores = torch.tensor(found["scores"], dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{path} is unreadable ({exc})"
    if found.get("method") != METHOD or tuple(scores.shape) != (num_layers, num_kv_heads):
        return None, f"{path} holds another measurement or shape"
    if not bool(((scores >= 0) & (scores <= 1)).all()):
        return None, f"{path} holds scores outside [0, 1]"
    return scores, None


def model_digest(model_path: Path) -> str:
    """Names the model by its config and its weight files' names and sizes (reading the weights would cost more than
    the file saves)."""
    digest = hashlib.sha256()
    for item in sorted(model_path.iterdir()):
        if item.name == "config.json":
            digest.update(item.read_bytes())
        elif item.suffix in (".safetensors", ".bin", ".gguf"):
            digest.update(f"{item.name}\0{item.stat().st_size}\0".encode())
    return digest.hexdigest()[:16]


def retrieval_scores(model_path: Path, samples: int = SAMPLES, prompt_tokens: int = PROMPT_TOKENS,
                     seed: int = SEED) -> torch.Tensor:
    """Each KV head's retrieval score in [0, 1], [layers, KV heads] (module doc)."""
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kept: dict[int, torch.Tensor] = {}

    def keep_last_rows(module, query, key, value, attention_mask, **kwargs):
        kept[module.layer_idx] = last_rows_attention(query, key, kwargs.get("scaling") or module.scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvserve_retrieval", keep_last_rows)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0]
        raise ValueError(f"measuring {model_path.name}'s retrieval heads needs its tokenizer ({reason}); use another "
                         "per-head policy, e.g. kv_eviction='perhead-span'") from exc
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                              attn_implementation="kvserve_retrieval").eval()
    config = model.config.get_text_config()
    length = min(prompt_tokens, config.max_position_embeddings - 64)
    hits = torch.zeros(config.num_hidden_layers, config.num_attention_heads)
    copied = 0
    for prompt, needle_at, needle, answer in needle_prompts(tokenizer, samples, length, seed):
        with torch.inference_mode():
            model(torch.tensor([prompt]))
        copied += add_hits(hits, kept, copied_tokens(prompt, needle_at, needle, answer))
    per_query_head = hits / max(copied, 1)
    kv_heads = config.num_key_value_heads
    return per_query_head.view(config.num_hidden_layers, kv_heads, -1).amax(-1)


def last_rows_attention(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """The causal attention of the last ROWS queries of one sequence, [heads, rows, keys], in float32 (query [1, heads,
    T, D], key [1, KV heads, T, D])."""
    T, rows = key.shape[2], min(ROWS, query.shape[2])
    q = query[0, :, -rows:].float()
    k = key[0].float().repeat_interleave(query.shape[1] // key.shape[1], 0)
    scores = (q @ k.transpose(-1, -2)) * scaling
    later = torch.arange(T)[None, :] > torch.arange(T - rows, T)[:, None]
    return scores.masked_fill(later, float("-inf")).softmax(-1)


def needle_prompts(tokenizer, samples: int, length: int, seed: int):
    """(token ids, where the needle starts, the needle's ids, the answer's ids) per sample: about `length` tokens of
    reference prose, the needle at a random depth, the question, then the answer (the prompt ends with it)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))[SKIP_CHARACTERS:]
    rng = random.Random(seed)
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    for _ in range(samples):
        word, code = rng.choice(WORDS), "".join(rng.choice("0123456789") for _ in range(7))
        start = rng.randrange(0, len(text) - 8 * length)
        filler = encode(text[start : start + 8 * length])[:length]
        needle = encode(f" The code of the {word} vault is {code}. ")
        at = rng.randrange(length // 10, length - length // 10)
        question = encode(f"\n\nWhat is the code of the {word} vault? The code of the {word} vault is")
        answer = encode(f" {code}")
        yield filler[:at] + needle + filler[at:] + question + answer, at, needle, answer


def add_hits(hits: torch.Tensor, kept: dict[int, torch.Tensor], copies) -> int:
    """Add to hits [layers, query heads] each head's hits over `copies` (copied_tokens'), its strongest attention
    in the kept rows (kept: layer -> [heads, rows, keys]) on a needle position holding the token; returns how many
    tokens were copied."""
    count = 0
    for _, row, sources in copies:
        count += 1
        for layer, attention in kept.items():
            hits[layer] += torch.isin(attention[:, row].argmax(-1), sources).float()
    return count


def copied_tokens(prompt: list[int], needle_at: int, needle: list[int], answer: list[int]):
    """(token, row of the kept attention that predicts it, the needle positions holding it) for each answer token
    the needle holds."""
    T = len(prompt)
    rows = min(ROWS, T)
    for j, token in enumerate(answer):
        row = (T - len(answer) + j - 1) - (T - rows)
        sources = [needle_at + i for i, t in enumerate(needle) if t == token]
        if row >= 0 and sources:
            yield token, row, torch.tensor(sources)
