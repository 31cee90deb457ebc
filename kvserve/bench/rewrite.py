"""The lookup-friendly workload of `kvserve bench throughput --workloads rewrite`: documents to correct and give back
in full, where the answer repeats the prompt (what prompt lookup and suffix decoding speculate on).

Eight documents of 300-800 tokens, cut at paragraph ends from the English prose CPython ships (`pydoc_data`, the
default text of `kvserve eval`), each with a few deterministic typos (two letters swapped in every 25th word of
five letters or more), followed by an instruction to rewrite the text correcting them, through the model's chat
template. The outputs are the model's own (greedy); EOS is ignored as in the other workloads, so every
engine produces the same number of tokens."""
from __future__ import annotations

from dataclasses import dataclass

# after the text: SmolLM2-135M answers an instruction placed first with loops of its own ("The corrected text
# is: ..."); placed after the text, it rewrites the text, quoting its spans
INSTRUCTION = "\n\nRewrite the text above, correcting its spelling mistakes."
TYPO_EVERY = 25  # words


@dataclass(frozen=True)
class RewriteWorkload:
    num_requests: int = 8
    min_prompt_len: int = 300  # of each document, in tokens (the instruction and template come on top)
    max_prompt_len: int = 800
    output_len: int = 256
    name: str = "rewrite"

    def documents(self, tokenizer) -> list[str]:
        """`num_requests` documents whose lengths spread evenly over [min, max] tokens, from the corpus in order."""
        from kvserve.eval.corpus import load_corpus

        paragraphs = [p.strip() for p in load_corpus(None).text.split("\n\n") if len(p.strip()) > 200]
        lengths = [self.min_prompt_len + (self.max_prompt_len - self.min_prompt_len) * i // max(1, self.num_requests - 1)
                   for i in range(self.num_requests)]
        documents, start = [], 0
        for target in lengths:
            pieces, num_tokens = [], 0
            while num_tokens < target and start < len(paragraphs):
                pieces.append(paragraphs[start])
                num_tokens += len(tokenizer(paragraphs[start], add_special_tokens=False).input_ids)
                start += 1
            documents.append(_with_typos("\n\n".join(pieces)))
        return documents

    def prompts(self, vocab_size: int, tokenizer=None) -> list[list[int]]:
        if tokenizer is None:
            raise ValueError("the rewrite workload needs the model's tokenizer (and chat template)")
        prompts = []
        for document in self.documents(tokenizer):
            messages = [{"role": "user", "content": document + INSTRUCTION}]
            if getattr(tokenizer, "chat_template", None):
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
            else:
                prompts.append(tokenizer(document + INSTRUCTION).input_ids)
        return prompts

    @property
    def max_len(self) -> int:
        return self.max_prompt_len * 2 + 200 + self.output_len  # paragraphs overshoot the target; the template

    def describe(self, prompts: list[list[int]]) -> str:
        return (f"{self.name}: {len(prompts)} documents to correct and give back in full, prompts "
                f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens ({sum(map(len, prompts)):,} in all), "
                f"{self.output_len} output tokens each (the model's greedy answer)")


def _with_typos(text: str) -> str:
    words = text.split(" ")
    long_words = [i for i, w in enumerate(words) if len(w) >= 5 and w.isalpha()]
    for i in long_words[TYPO_EVERY - 1 :: TYPO_EVERY]:
        w = words[i]
        words[i] = w[0] + w[2] + w[1] + w[3:]
    return " ".join(words)
