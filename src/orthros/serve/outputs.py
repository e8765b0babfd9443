"""From generated token ids to response text: incremental detokenization and stop strings.

Decoding token by token breaks multi-byte characters and tokenizers that
merge spaces, so text is decoded over a sliding window of ids and only the
stable part is emitted (the method of Hugging Face's TextStreamer and vLLM's
incremental detokenizer). Stop strings are searched in the text as it grows;
while streaming, the last `max(len(stop)) - 1` characters are held back so a
stop string split across tokens is never sent.
"""

from __future__ import annotations

from ..data.tokenizer import ByteTokenizer


def decode(tokenizer, ids: list[int]) -> str:
    if tokenizer is None:
        return ""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.decode(ids)
    return tokenizer.decode(ids, skip_special_tokens=True)


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text already emitted
        self.read = 0

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes ('' while a character is partial)."""
        self.ids.append(token_id)
        before = decode(self.tokenizer, self.ids[self.prefix:self.read])
        after = decode(self.tokenizer, self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held (a trailing partial character, decoded with replacement)."""
        before = decode(self.tokenizer, self.ids[self.prefix:self.read])
        after = decode(self.tokenizer, self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


class ChoiceOutput:
    """The output of one choice: text (cut at a stop string), token ids, logprobs."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.detok = Detokenizer(tokenizer)
        self.stops = stops
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]] | None] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.sent_chars = 0
        self.sent_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, ev) -> bool:
        """Take one engine event; True when a stop string ended the choice here (the engine
        request must then be aborted)."""
        if self.finished:
            return False
        if ev.token_id is not None:
            self.token_ids.append(ev.token_id)
            if ev.logprob is not None:
                self.logprobs.append(ev.logprob)
                self.top_logprobs.append(ev.top_logprobs)
            piece = self.detok.add(ev.token_id)
            if ev.finish_reason is not None:
                piece += self.detok.flush()
            if self._append(piece):
                return True
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
            self.error = ev.error
        return False

    def _append(self, piece: str) -> bool:
        if not piece:
            return False
        start = max(0, len(self.text) - self.holdback)
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"
            return True
        return False

    def take_delta(self) -> tuple[str, int, int]:
        """(new text safe to send, first new token, end token) since the last call."""
        end = len(self.text) if self.finished else max(self.sent_chars, len(self.text) - self.holdback)
        text = self.text[self.sent_chars:end]
        self.sent_chars = end
        t0, self.sent_tokens = self.sent_tokens, len(self.token_ids)
        return text, t0, self.sent_tokens

    def token_text(self, i: int) -> str:
        return decode(self.tokenizer, [self.token_ids[i]])
