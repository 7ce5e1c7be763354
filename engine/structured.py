"""Structured output: a grammar constrains which tokens a request may sample. A JSON schema, any JSON
object, a regex, a choice among strings, an EBNF grammar or a structural tag (vLLM's `structured_outputs` kinds)
is compiled once per distinct spec with xgrammar (what vLLM and SGLang use: docs/architecture.md says why) into a
token-level automaton; each sequence holds a matcher over it, fed every token the sequence gets (sampled,
imported from a prefill replica, or replayed after a move), so its state is rebuilt from tokens, never shipped.
Before each sampling step the engine fills a bitmask row per constrained sequence and the sampler sets the
logits of every token the grammar forbids to -inf.

With speculative decoding, a constrained request's drafts are cut at the first token its grammar refuses,
and each verify row is masked by the grammar's state after the drafts before it (mask_verify_rows), so the
output has the distribution of constrained decoding without speculation.

A JSON schema is compiled only if the grammar can hold the output to all of it. xgrammar compiles some keywords
without enforcing them: it lets through outputs that break `not`, `if` (with its `then` and `else`), `allOf` of
several schemas, `contains`, `uniqueItems`, `dependentRequired` and `dependentSchemas` (UNENFORCED, which
tests/test_structured_schemas.py holds to xgrammar's own behaviour). A schema with one of them is refused naming
the keyword and where it is, as OpenAI's strict mode refuses keywords it does not support, rather than served
with a constraint silently dropped. A
one-schema `allOf` (older pydantic's way to put a description beside a $ref) is merged into its parent first.
`oneOf` is compiled as `anyOf`, as every grammar engine does: an output may match more than one branch.

A structural tag (xgrammar's, as vLLM serves it) constrains parts of an output: free text until a trigger, then
a tag (`<function=get_weather>`, JSON of a schema, `</function>`), as a model writes tool calls in its own
format. Two forms: xgrammar's `{"type": "structural_tag", "format": {...}}` as it is, and vLLM's older
`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`, rewritten into the first as its
`triggered_tags` (the same language; xgrammar's call for the old form is deprecated). Every JSON schema inside
either passes the same checks as a request's own schema.

Compilation is bounded: a spec over `max_bytes` is refused, and one whose compilation outlasts `timeout_s`
is refused while the compile finishes in the background (a pathological schema cannot stall a replica).

A reasoning model thinks before it answers (router/reasoning.py). With `after_thinking` the grammar constrains the
answer only: the thinking goes free until the sequence's </think>, as vLLM runs structured outputs under a
reasoning parser. The gate opens on the </think> token; a prompt whose last <think> is already closed (Qwen3's
template with thinking turned off writes `<think>\n\n</think>`) has it open from the first token. Like vLLM's
parsers it needs both tags as single tokens of the tokenizer, and refuses a tokenizer that splits them. gpt-oss
(harmony) has no </think>: its gate is the token sequence that opens the final channel, `<|channel|>final<|message|>`
(harmony_gate), and a prompt that ends with it has the gate open.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import InvalidRequestError

_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# JSON Schema keywords that xgrammar compiles without enforcing: refused (see the module's docstring)
UNENFORCED = ("not", "if", "allOf", "contains", "uniqueItems", "dependentRequired", "dependentSchemas")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")          # maps of names to subschemas
_DATA = ("enum", "const", "default", "examples", "required", "title", "description", "pattern", "format", "$ref")
THINK_START, THINK_END = "<think>", "</think>"   # a reasoning model's thinking (router/reasoning.py splits it out)
MAX_GRAMMAR_BYTES = 64 << 10           # defaults of EngineConfig and of the cluster's limits section
GRAMMAR_COMPILE_TIMEOUT_S = 10.0


@dataclass(slots=True)
class StructuredOutput:
    """One of: json (a JSON schema, as a mapping or its text), json_object (any JSON object), regex,
    choice (the output is one of these strings), grammar (EBNF, xgrammar's GBNF dialect), structural_tag (as
    a mapping or its text; see the module's docstring). `after_thinking`: the grammar waits for the model's
    </think> (a reasoning model's answer follows its thinking)."""
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    after_thinking: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidRequestError(f"structured output takes exactly one of {', '.join(_KINDS)}; got "
                                      f"{', '.join(set_) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError("a JSON schema must be an object (or its text)")
        if self.structural_tag is not None:
            if not isinstance(self.structural_tag, (dict, str)):
                raise InvalidRequestError("a structural tag must be an object (or its text)")
            xgrammar_structural_tag(self.structural_tag)          # its shape, before it reaches a replica
        for name in ("json_object", "after_thinking"):
            if getattr(self, name) is not False and getattr(self, name) is not True:
                raise InvalidRequestError(f"{name} must be true or false")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidRequestError(f"{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def source(self) -> str:
        """The spec as text: what is compiled, size-checked and hashed."""
        for v in (self.json, self.structural_tag):
            if v is not None:
                return v if isinstance(v, str) else json.dumps(v)          # a schema's property order matters
        if self.choice is not None:
            return json.dumps(self.choice)
        return self.regex or self.grammar or ""

    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.source()}".encode()).hexdigest()


class GrammarCompiler:
    """Compiles specs for one tokenizer, each distinct spec once (an LRU of `capacity` compiled grammars keyed
    by the spec's hash). Thread-safe: the engine's callers compile before a request enters the step loop."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_bytes: int = MAX_GRAMMAR_BYTES,
                 timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S, capacity: int = 256):
        import xgrammar as xgr
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.think = think_ids(tokenizer)
        self.harmony = harmony_gate(tokenizer) if self.think is None else None
        self.vocab_size, self.max_bytes, self.timeout_s, self.capacity = vocab_size, max_bytes, timeout_s, capacity
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self.num_compiled = 0

    def compile(self, spec: StructuredOutput):
        """The spec's compiled grammar; InvalidRequestError if it is too large, malformed or too slow, or waits for
        a thinking this tokenizer cannot mark."""
        if spec.after_thinking and self.think is None and self.harmony is None:
            raise InvalidRequestError(f"structured output after the thinking needs {THINK_START} and {THINK_END} as "
                                      f"single tokens of the tokenizer, as vLLM's reasoning parsers do (or harmony's "
                                      f"{HARMONY_FINAL}); this model's tokenizer splits them")
        try:
            src = spec.source()
        except RecursionError:
            raise InvalidRequestError(f"the {spec.kind} spec is nested too deeply") from None
        if len(src.encode()) > self.max_bytes:
            raise InvalidRequestError(f"the {spec.kind} spec is {len(src.encode())} bytes, over the limit of "
                                      f"{self.max_bytes}")
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            future = self._pending.get(key)
            if future is None:
                future = self._pending[key] = self._pool.submit(self._compile, spec)
        try:
            compiled = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise InvalidRequestError(f"the {spec.kind} spec did not compile within {self.timeout_s:g} s") from None
        except InvalidRequestError:
            with self._lock:
                self._pending.pop(key, None)
            raise
        with self._lock:
            self._pending.pop(key, None)
            if key not in self._cache:
                self._cache[key] = compiled
                self.num_compiled += 1
                while len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput):
        c = self._compiler
        if spec.json is not None:
            schema = _enforceable(spec.json)
        if spec.structural_tag is not None:
            tag = xgrammar_structural_tag(spec.structural_tag)
        try:
            if spec.json is not None:
                return c.compile_json_schema(json.dumps(schema) if schema is not None else spec.source(),
                                             any_whitespace=False)
            if spec.json_object:
                return c.compile_builtin_json_grammar()
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))
            if spec.structural_tag is not None:
                return c.compile_structural_tag(tag)
            return c.compile_grammar(spec.grammar)
        except Exception as e:                       # xgrammar reports bad input as RuntimeError/ValueError
            msg = str(e).strip().splitlines()
            detail = next((line for line in msg if "error" in line.lower() or "failed" in line.lower()),
                          msg[0] if msg else type(e).__name__)
            raise InvalidRequestError(f"invalid {spec.kind} for structured output: {detail[:300]}") from None

    def matcher(self, spec: StructuredOutput, prompt: list[int] = ()) -> "Guide":
        """A sequence's guide; under `after_thinking` gated on </think>, open already if `prompt` closed its last
        <think>."""
        m = self._xgr.GrammarMatcher(self.compile(spec))
        if not spec.after_thinking:
            return Guide(m)
        if self.think is None:                        # harmony: open where the prompt opened the final channel
            gate = self.harmony
            return Guide(m, gate, opened=tuple(prompt[len(prompt) - len(gate):]) == gate)
        start, end = self.think
        last = {t: i for i, t in enumerate(prompt) if t in (start, end)}
        return Guide(m, end, opened=last.get(end, -1) > last.get(start, -1))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def xgrammar_structural_tag(tag: dict | str) -> dict:
    """A structural tag in xgrammar's form, its schemas checked (_enforceable); InvalidRequestError naming what is
    malformed. vLLM's older form (structures and triggers) becomes a `triggered_tags` format."""
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as e:
            raise InvalidRequestError(f"the structural tag is not JSON: {e}") from None
    if not isinstance(tag, dict):
        raise InvalidRequestError("a structural tag must be a JSON object")
    if "structures" in tag:
        structures, triggers = tag["structures"], tag.get("triggers")
        if not isinstance(structures, list) or not structures:
            raise InvalidRequestError("structural_tag.structures must be a non-empty list")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise InvalidRequestError("structural_tag.triggers must be a non-empty list of non-empty strings")
        tags = []
        for i, s in enumerate(structures):
            if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")) \
                    or not s["begin"] or not isinstance(s.get("schema"), dict):
                raise InvalidRequestError(f"structural_tag.structures[{i}] needs begin and end strings and a "
                                          f"schema object")
            tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                         "content": {"type": "json_schema", "json_schema": s["schema"]}})
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
    elif not isinstance(tag.get("format"), dict):
        raise InvalidRequestError("a structural tag needs a format object (or vLLM's structures and triggers)")

    def checked(node: Any) -> Any:
        if isinstance(node, list):
            return [checked(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: checked(v) for k, v in node.items() if k != "json_schema"}
        if "json_schema" in node:
            schema = node["json_schema"]
            out["json_schema"] = (_enforceable(schema) or schema) if node.get("type") == "json_schema" \
                and isinstance(schema, (dict, str)) else checked(schema)
        return out
    return {"type": "structural_tag", "format": checked(tag["format"])}


def _enforceable(schema: dict | str) -> dict | None:
    """The schema with one-schema allOfs merged, or InvalidRequestError naming a keyword the grammar would not
    enforce (UNENFORCED) and where. None: the text is not JSON (the grammar engine's own error says so)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return None

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        node = dict(node)
        one = node.get("allOf")
        if isinstance(one, list) and len(one) == 1 and isinstance(one[0], dict) \
                and not set(one[0]) & (set(node) - {"allOf"}):       # its keys are new to the parent: merged
            del node["allOf"]
            node.update(one[0])
        bad = [k for k in UNENFORCED if k in node]
        if bad:
            raise InvalidRequestError(f"the JSON schema's {bad[0]!r} (at {path}) is not supported: the grammar engine "
                                      f"(xgrammar) would not hold the output to it; remove it, or check it yourself")
        out = {}
        for k, v in node.items():
            if k in _NAMED and isinstance(v, dict):
                out[k] = {name: walk(sub, f"{path}.{k}.{name}") for name, sub in v.items()}
            elif k in _DATA:
                out[k] = v
            else:
                out[k] = walk(v, f"{path}.{k}")
        return out
    try:
        return walk(schema, "$")
    except RecursionError:
        raise InvalidRequestError("the JSON schema is nested too deeply") from None


HARMONY_FINAL = "<|channel|>final<|message|>"


def harmony_gate(tokenizer) -> tuple[int, ...] | None:
    """The token ids of harmony's `<|channel|>final<|message|>` (gpt-oss), where <|channel|> and <|message|> are each
    one token of the tokenizer; else None."""
    marks = [tokenizer.encode(t, add_special_tokens=False) for t in ("<|channel|>", "<|message|>")]
    if not all(len(m) == 1 for m in marks):
        return None
    return (marks[0][0], *tokenizer.encode("final", add_special_tokens=False), marks[1][0])


def think_ids(tokenizer) -> tuple[int, int] | None:
    """The token ids of <think> and </think>, or None unless the tokenizer has each as one token."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (THINK_START, THINK_END)]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


class Guide:
    """One sequence's position in its grammar. With a gate (`end`: the </think> token id, or harmony's sequence of
    ids) the grammar waits: until the gate opens every token is allowed and none reaches the grammar; the token
    `end` (the sequence's last, after the rest) opens it."""

    def __init__(self, matcher, end: int | tuple[int, ...] | None = None, opened: bool = True):
        self._m = matcher
        self._end = (end,) if isinstance(end, int) else None if end is None else tuple(end)
        self._count = 0                                   # tokens accepted
        self._opened_at = 0 if end is None or opened else None   # tokens accepted when the gate opened
        self._before: list[int] = []                      # the tokens accepted while it was closed

    def accept(self, token: int) -> bool:
        """Advance over `token`; False (state unchanged) if the grammar forbids it."""
        if self._opened_at is None:
            self._count += 1
            self._before.append(token)
            if tuple(self._before[-len(self._end):]) == self._end:
                self._opened_at = self._count
            return True
        if not self._m.accept_token(token):
            return False
        self._count += 1
        return True

    @property
    def terminated(self) -> bool:
        return self._opened_at is not None and bool(self._m.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self._opened_at is None:
            bitmask[row] = -1                             # the thinking: every bit set, every token allowed
        else:
            self._m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted (the gate closes again if its </think> is among them)."""
        if not num_tokens:
            return
        count = self._count - num_tokens
        if self._opened_at is not None:
            grammar = self._count - max(self._opened_at, count)
            if grammar:
                self._m.rollback(grammar)
            if count < self._opened_at:
                self._opened_at = None
        self._count = count
        del self._before[count:]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (drafts) the grammar accepts in a row from here; the state is left as it was."""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        self.rollback(n)
        return n


def cut_drafts(guide: Guide, tokens: list[int], probs: torch.Tensor | None) -> tuple[list[int], torch.Tensor | None]:
    """A constrained sequence's drafts (and their q rows), cut where its grammar refuses one.

    Prompt-lookup drafts (one-hot, probs None) end before the refused token: verifying it could only reject
    it, and the residual of a one-hot q on a token the masked target gives 0 is the masked target itself,
    which the plain step samples. Drafts sampled from a model keep the refused token as their last: it is
    rejected (the masked target gives it 0) and the correction is drawn from the residual max(0, p' - q),
    which is what keeps the output exactly the masked target p'. Cutting it instead would draw from p' after
    a refused draft and skew the output toward the allowed tokens q favours (the statistical test in
    tests/test_spec_components.py sees total variation 0.17 that way)."""
    n = guide.valid_prefix(tokens)
    if probs is not None and n < len(tokens):
        n += 1
    return tokens[:n], (probs[:n] if probs is not None and n else None)


def mask_verify_rows(logits: torch.Tensor, seqs: list, row_seq: list[int], row_offset: list[int]) -> torch.Tensor:
    """A verify step's target logits [rows, V] masked row by row: the row at draft offset o of a constrained
    sequence by its grammar's state after the drafts before it, so rejection sampling draws from the masked
    target distribution, as constrained decoding without speculation does. Grammar states end as they began."""
    import xgrammar as xgr
    if all(s.guide is None for s in seqs):
        return logits
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    filled, walked = [], {}                       # sequence index -> drafts accepted into its grammar so far
    for r, (i, o) in enumerate(zip(row_seq, row_offset)):
        guide = seqs[i].guide
        if guide is None or walked.get(i, 0) != o or (o and guide.terminated):
            continue                                 # a draft before this row broke or ended the grammar
        guide.fill(bitmask, r)
        filled.append(r)
        drafts = seqs[i].spec_tokens
        if o < len(drafts) and guide.accept(drafts[o]):
            walked[i] = o + 1
    for i, n in walked.items():
        seqs[i].guide.rollback(n)
    return apply_bitmask(logits, bitmask, filled)


class StepMasks:
    """The grammar bitmask rows of one step's constrained sequences, filled on a thread while the model runs
    (xgrammar fills in C++ without the GIL), so sampling only applies them. The engine uses it where the
    model runs on a GPU and the host waits; on CPU the forward already keeps every core busy and a fill
    thread only slows it (measured: 10% fewer tokens/s at batch 32), so the sampler fills inline there. Speculating sequences are left
    to mask_verify_rows. Grammar states do not move between start() and apply(): the engine feeds tokens
    only after sampling."""
    _pool: concurrent.futures.ThreadPoolExecutor | None = None

    def __init__(self, seqs: list, vocab_size: int):
        import xgrammar as xgr
        self._xgr, self.vocab_size = xgr, vocab_size
        self._rows = {id(s): r for r, s in enumerate(seqs)}
        if StepMasks._pool is None:
            StepMasks._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._future = StepMasks._pool.submit(self._fill, [s.guide for s in seqs])

    @classmethod
    def start(cls, seqs: list, vocab_size: int) -> "StepMasks | None":
        constrained = [s for s in seqs if s.guide is not None and not s.spec_tokens]
        return cls(constrained, vocab_size) if constrained else None

    def _fill(self, guides: list[Guide]) -> torch.Tensor:
        bitmask = self._xgr.allocate_token_bitmask(len(guides), self.vocab_size)
        for r, g in enumerate(guides):
            g.fill(bitmask, r)
        return bitmask

    def apply(self, logits: torch.Tensor, seqs: list) -> torch.Tensor:
        """logits [len(seqs), V] with each constrained row masked (a copy; rows without a guide untouched)."""
        filled = self._future.result()
        rows = [i for i, s in enumerate(seqs) if s.guide is not None]
        if not rows:
            return logits
        if any(id(seqs[i]) not in self._rows for i in rows):       # not started for this row: fill it now
            return mask_logits(logits, [s.guide for s in seqs])
        bitmask = self._xgr.allocate_token_bitmask(len(seqs), self.vocab_size)
        bitmask[rows] = filled[[self._rows[id(seqs[i])] for i in rows]]
        return apply_bitmask(logits, bitmask, rows)


def mask_logits(logits: torch.Tensor, guides: list[Guide | None]) -> torch.Tensor:
    """logits [R, V] with, in each row that has a guide, every token its grammar forbids at -inf (in place
    on a float copy's rows; rows without a guide are untouched)."""
    import xgrammar as xgr
    rows = [i for i, g in enumerate(guides) if g is not None]
    if not rows:
        return logits
    bitmask = xgr.allocate_token_bitmask(len(guides), logits.shape[-1])
    for i in rows:
        guides[i].fill(bitmask, i)
    return apply_bitmask(logits, bitmask, rows)


_BYTE_BITS = None          # [256, 8] float: 0 where a byte's bit is set (allowed), -inf where not


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of logits [R, V] with, in `rows`, every token whose bit in bitmask [R, ceil(V / 32)] is 0 at -inf.
    On CUDA xgrammar's kernel. On CPU the C++ kernel beside the attention one (engine/cpu_attention.cpp),
    which writes only the forbidden tokens; without a compiler an additive mask looked up per byte of the
    bitmask. At batch 32 over SmolLM2's 49k vocabulary: xgrammar's CPU path 5.4 ms, the byte lookup 1.2-2.1
    ms, the C++ kernel 0.15 ms."""
    if logits.device.type != "cpu":
        import xgrammar as xgr
        out = logits.clone()
        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), indices=rows)
        return out
    from engine import cpu_attention
    if logits.dtype == torch.float32 and cpu_attention.available():
        out = logits.contiguous().clone()
        cpu_attention.apply_token_bitmask(out, bitmask.contiguous(), torch.as_tensor(rows, dtype=torch.long))
        return out
    return _apply_by_bytes(logits, bitmask, rows)


def _apply_by_bytes(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    global _BYTE_BITS
    if _BYTE_BITS is None:
        bits = (torch.arange(256, dtype=torch.int32).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1
        _BYTE_BITS = torch.where(bits.bool(), 0.0, float("-inf"))
    vocab = logits.shape[-1]
    idx = torch.as_tensor(rows, dtype=torch.long)
    # the int32 words' bytes in memory order (little-endian): byte b of word w holds tokens 32w + 8b .. + 7
    add = _BYTE_BITS[bitmask[idx].contiguous().view(torch.uint8).long()].view(len(rows), -1)[:, :vocab]
    out = logits.clone()
    out[idx] += add.to(out.dtype)
    return out
