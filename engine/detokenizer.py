"""Incremental detokenization with stop strings that may span token boundaries.

Text is produced from a sliding window of ids (a few prompt tokens for context, so sentencepiece
leading spaces come out right) and held back while it ends in an incomplete UTF-8 sequence. While a
request runs, the last (longest stop string - 1) characters are held back too, so a stream never
shows the start of a stop string that later turns out to end the request (unless the stop string is kept in
the output, `include_stop`: then the text is cut after it, and nothing needs holding back).
"""
from __future__ import annotations

_CONTEXT = 5


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.skip = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop
        self.search_back = max((len(s) for s in stop), default=1) - 1     # a stop string may start this far back
        self.holdback = 0 if include_stop else self.search_back
        self.text = ""              # decoded output text (cut at a stop string once found)
        self.emitted = 0            # characters of text already handed out

    def add(self, token_id: int, find_stop: bool = True) -> str | None:
        """Append one token; returns the stop string if the text now contains one. `find_stop` False (a request
        short of its min_tokens): its text is not searched, now or later (as vLLM: the search looks at the new
        text and the holdback before it)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None                                   # wait for the rest of a multi-byte char
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.search_back)
        self.text += delta
        return self._find_stop(start) if find_stop else None

    def flush(self) -> None:
        """At the end: whatever bytes are pending become text (possibly a replacement char)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix):
            self.text += full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)

    def take(self, finished: bool) -> str:
        """The next piece of text to show; while running, hold back a possible stop-string start."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        piece, self.emitted = self.text[self.emitted:end], end
        return piece

    def _find_stop(self, start: int) -> str | None:
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[:best[0] + (len(best[1]) if self.include_stop else 0)]
        return best[1]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)
