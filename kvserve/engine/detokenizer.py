"""Token ids -> text as they arrive, holding back what may still change (a partial UTF-8 character or the start
of a stop string) so streamed text is never taken back.

Each new token is decoded in a short window of the tokens before it (as vLLM and TGI do), so a step costs the
same at token 10 as at token 10,000; the window's earlier tokens give the decoder the context that decides, for
example, whether a SentencePiece word starts with a space."""
from __future__ import annotations

from dataclasses import dataclass, field

# A UTF-8 character spans at most 4 byte tokens; past this many undecodable tokens the bytes are invalid, not
# incomplete, and are let through as U+FFFD rather than growing the window forever.
MAX_PENDING_TOKENS = 8


@dataclass
class Detokenizer:
    tokenizer: object | None
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    text: str = ""  # everything decoded so far, stop string excluded once one is hit
    stop_hit: str | None = None
    _prefix_offset: int = 0  # the window's first token: decoded only for context
    _read_offset: int = 0  # tokens before this are in `text`

    def update(self, output_token_ids: list[int]) -> None:
        """Take the tokens of `output_token_ids` not seen yet; finds a stop string that they complete."""
        if self.tokenizer is None:
            return
        new_text = self._decode_new(output_token_ids)
        if not new_text:
            return
        # Only the new text and a stop string's length before it can hold a stop string not found already.
        searched_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += new_text
        hits = [(at, stop) for stop in self.stop if (at := self.text.find(stop, searched_from)) != -1]
        if hits:
            at, self.stop_hit = min(hits)
            self.text = self.text[:at]

    def _decode_new(self, token_ids: list[int]) -> str:
        window = token_ids[self._prefix_offset:]
        seen_len = self._read_offset - self._prefix_offset
        seen_text = self._decode(window[:seen_len])
        window_text = self._decode(window)
        pending = len(token_ids) - self._read_offset
        if window_text.endswith("\ufffd") and pending < MAX_PENDING_TOKENS:
            return ""  # a multi-byte character is only partly generated
        if len(window_text) <= len(seen_text) and pending < MAX_PENDING_TOKENS:
            return ""  # nothing visible yet (a skipped special token): keep the context
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        return window_text[len(seen_text):]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens) if token_ids else ""

    def stable_text(self, finished: bool) -> str:
        """Text that can be shown now: all of it once finished, else minus a possible stop-string prefix."""
        if finished or not self.stop:
            return self.text
        hold = max(len(s) for s in self.stop) - 1
        return self.text[: max(0, len(self.text) - hold)]
