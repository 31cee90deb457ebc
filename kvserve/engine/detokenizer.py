"""Token ids -> text as they arrive, holding back what may still change (a partial UTF-8 character or the start
of a stop string) so streamed text is never taken back."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Detokenizer:
    tokenizer: object | None
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    text: str = ""  # everything decoded so far, stop string excluded once one is hit
    stop_hit: str | None = None

    def update(self, output_token_ids: list[int]) -> None:
        if self.tokenizer is None:
            return
        text = self.tokenizer.decode(output_token_ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd"):  # a multi-byte character is only partly generated
            return
        searched_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        hits = [(at, stop) for stop in self.stop if (at := text.find(stop, searched_from)) != -1]
        if hits:
            at, self.stop_hit = min(hits)
            text = text[:at]
        self.text = text

    def stable_text(self, finished: bool) -> str:
        """Text that can be shown now: all of it once finished, else minus a possible stop-string prefix."""
        if finished or not self.stop:
            return self.text
        hold = max(len(s) for s in self.stop) - 1
        return self.text[: max(0, len(self.text) - hold)]
