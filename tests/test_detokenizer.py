"""Incremental detokenization with the default model's real tokenizer: exact text, UTF-8, stop strings.

Streaming is simulated as LLMEngine does it: add(token) per generated token, then take(finished=False)
while the request runs; at the end take(True) (after flush() unless a stop string ended it).
"""
from __future__ import annotations

import pytest

from engine.detokenizer import Detokenizer

PROMPT = "Write something:"


@pytest.fixture(scope="module")
def tok():
    from engine.loader import load_tokenizer, resolve_model
    t = load_tokenizer(resolve_model(None))
    assert t is not None
    return t


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok, text_or_ids, stop: list[str] = (), prompt: str = PROMPT, skip_special_tokens: bool = True,
           include_stop: bool = False):
    """Feed tokens one by one; returns (detokenizer, pieces, stop string or None, tokens consumed)."""
    ids = encode(tok, text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
    d = Detokenizer(tok, encode(tok, prompt), list(stop), skip_special_tokens, include_stop)
    pieces: list[str] = []
    shown = ""
    for k, t in enumerate(ids):
        found = d.add(t)
        assert "\ufffd" not in d.text, f"partial UTF-8 leaked into the text after token {k}: {d.text!r}"
        if found is not None:
            pieces.append(d.take(True))
            return d, pieces, found, k + 1
        pieces.append(d.take(False))
        shown += pieces[-1]
        assert d.text.startswith(shown)
    d.flush()
    pieces.append(d.take(True))
    return d, pieces, None, len(ids)


TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "héllo 🌍 世界",
    "naïve café — 😀👍🏽 done.",
    "日本語のテキストと emoji 🎉🎉 mixed in.",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "Ünïcödé ✓ ∑ ≠ ∞",
    "def f(x):\n    return x ** 2  # code",
]


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_reproduces_text_exactly(tok, text):
    ids = encode(tok, text)
    assert tok.decode(ids) == text, "precondition: the tokenizer round-trips this text"
    d, pieces, found, _ = stream(tok, ids)
    assert found is None
    assert d.text == text
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces), f"a streamed piece showed a replacement char: {pieces}"


def test_multibyte_characters_are_held_until_complete(tok):
    text = "héllo 🌍 世界"
    ids = encode(tok, text)
    d = Detokenizer(tok, encode(tok, PROMPT), [])
    partial_steps = 0
    for t in ids:
        d.add(t)
        piece = d.take(False)
        if piece == "":
            partial_steps += 1
        assert "\ufffd" not in piece
    assert partial_steps > 0, "the emoji and CJK characters span several byte tokens"
    assert d.text == text


def test_no_stop_strings_means_no_holdback(tok):
    text = "The quick brown fox jumps over the lazy dog"
    _, pieces, _, _ = stream(tok, text)
    assert pieces[:-1] == [tok.decode([t]) for t in encode(tok, text)], "each word should stream as it arrives"
    assert pieces[-1] == ""


def test_prompt_context_does_not_leak_into_the_output(tok):
    d, pieces, _, _ = stream(tok, " answer", prompt="The question and the")
    assert d.text == " answer" and "".join(pieces) == " answer"


def test_stop_string_spanning_two_tokens(tok):
    text = "The answer is 42. STOP here, then more text."
    ids = encode(tok, text)
    pieces_of_tokens = [tok.decode([t]) for t in ids]
    assert "STOP" not in pieces_of_tokens and " ST" in pieces_of_tokens and "OP" in pieces_of_tokens
    d, pieces, found, used = stream(tok, ids, stop=["STOP"])
    assert found == "STOP"
    assert d.text == "The answer is 42. "
    assert used == pieces_of_tokens.index("OP") + 1, "detected on the token that completes it"
    streamed = "".join(pieces)
    assert streamed == d.text
    for part in ("S", "ST", "STO", "STOP"):
        assert part not in streamed


@pytest.mark.parametrize("stop", ["42. S", "is 42", ". STOP h", "OP here"])
def test_stop_string_spanning_several_tokens_or_starting_mid_token(tok, stop):
    text = "The answer is 42. STOP here, then more text."
    d, pieces, found, _ = stream(tok, text, stop=[stop])
    assert found == stop
    expected = text[:text.index(stop)]
    assert d.text == expected
    assert "".join(pieces) == expected


@pytest.mark.parametrize("stop", ["42. S", "is 42", ". STOP h", "OP here"])
def test_a_stop_string_kept_in_the_output_ends_it_and_nothing_is_held_back(tok, stop):
    """include_stop_str_in_output: the text runs to the end of the stop string, and the stream shows each
    token's text at once (what it shows is always a prefix of the final text)."""
    text = "The answer is 42. STOP here, then more text."
    d, pieces, found, _ = stream(tok, text, stop=[stop], include_stop=True)
    assert found == stop
    expected = text[:text.index(stop) + len(stop)]
    assert d.text == expected and "".join(pieces) == expected
    assert d.holdback == 0 and all(pieces[:-1]), "with the stop string kept, no token's text waits"


def test_streamed_prefix_never_shows_a_stop_string_start(tok):
    """At every step, what was shown is a prefix of the final (cut) text."""
    text = "alpha beta gamma delta END epsilon"
    ids = encode(tok, text)
    d = Detokenizer(tok, encode(tok, PROMPT), ["END", "gamma delta E"])
    shown = ""
    for t in ids:
        found = d.add(t)
        shown += d.take(found is not None)
        if found is not None:
            break
    assert found == "gamma delta E"
    assert d.text == "alpha beta "
    assert shown == "alpha beta "


def test_stop_string_at_the_very_start(tok):
    d, pieces, found, used = stream(tok, "STOP and nothing else", stop=["STOP"])
    assert found == "STOP" and d.text == "" and "".join(pieces) == ""


def test_stop_string_in_the_prompt_is_ignored(tok):
    d, pieces, found, _ = stream(tok, " fine text", stop=["STOP"], prompt="Say STOP")
    assert found is None and d.text == " fine text" and "".join(pieces) == " fine text"


def test_stop_string_that_never_appears_is_released_at_the_end(tok):
    text = "nothing to see here"
    d, pieces, found, _ = stream(tok, text, stop=["xyzzy-long-stop"])
    assert found is None
    assert d.text == text and "".join(pieces) == text
    assert pieces[-1] != "", "the held-back tail must come out when the request finishes"


def test_stop_string_made_of_multibyte_characters(tok):
    text = "héllo 🌍 世界 again"
    d, pieces, found, _ = stream(tok, text, stop=["🌍"])
    assert found == "🌍" and d.text == "héllo " and "".join(pieces) == "héllo "
    d, pieces, found, _ = stream(tok, text, stop=["世界"])
    assert found == "世界" and d.text == "héllo 🌍 " and "".join(pieces) == "héllo 🌍 "


@pytest.mark.parametrize("stops", [["re", "he"], ["he", "re"]])
def test_earliest_stop_string_wins_within_one_token(tok, stops):
    text = "we go there now"
    assert " there" in [tok.decode([t]) for t in encode(tok, text)], "both stops complete in one token"
    d, pieces, found, _ = stream(tok, text, stop=stops)
    assert found == "he"
    assert d.text == "we go t" and "".join(pieces) == "we go t"


@pytest.mark.parametrize("stops", [["END", "42"], ["42", "END"], ["then", ". STOP", "is"]])
def test_earliest_stop_string_wins(tok, stops):
    text = "The answer is 42. STOP here, then END."
    d, pieces, found, _ = stream(tok, text, stop=stops)
    first = min(stops, key=lambda s: text.index(s))
    assert found == first
    assert d.text == text[:text.index(first)]
    assert "".join(pieces) == d.text


def test_special_tokens_skipped_or_kept(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tok, "Hi there") + [eos] + encode(tok, " after")
    d, pieces, _, _ = stream(tok, ids, skip_special_tokens=True)
    assert d.text == "Hi there after" and "".join(pieces) == d.text
    d, pieces, _, _ = stream(tok, ids, skip_special_tokens=False)
    assert d.text == "Hi there<|im_end|> after" and "".join(pieces) == d.text


def test_flush_releases_an_incomplete_character_at_the_end(tok):
    ids = encode(tok, "ok 🌍")
    d = Detokenizer(tok, encode(tok, PROMPT), [])
    shown = ""
    for t in ids[:-1]:                                  # the request ends mid-emoji (e.g. max_tokens)
        d.add(t)
        shown += d.take(False)
    assert shown == "ok"
    d.flush()
    tail = d.take(True)
    assert (shown + tail).startswith("ok ") and tail.endswith("\ufffd")
    assert d.take(True) == ""
