"""Structured output: a request's grammar (JSON schema, regex, Lark, a list of choices), compiled
by llguidance into a matcher that gives the tokens allowed next.

    Grammars(tokenizer, vocab_size, eos)   per server: llguidance's view of the tokenizer (built
                                           once, on first use), compiling a request's option
    Guide                                  one compiled grammar; `matcher()` a fresh matcher
                                           (one per engine request: `n` choices get one each)

The matcher's masks are applied to the logits in the sampler (`sampling.GrammarMasks`), and
the engine advances it with every sampled token. llguidance is optional: without it a request
that asks for structured output is a 400 (ValueError here), and nothing else changes.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured output (response_format, guided_*) needs the llguidance package, which "
                         "this server does not have: pip install 'llguidance>=1.9'") from None
    return llguidance


# JSON as Python's json.dumps writes it (", " and ": ", no other whitespace): free whitespace lets a
# weak model spend its whole budget on spaces and newlines. A schema's "x-guidance" object overrides
# it (llguidance's JSON options, e.g. {"whitespace_flexible": true}).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Guide:
    """One compiled grammar. The matcher built at compile time is never advanced: each request
    gets a copy (`deep_copy` is cheap; compiling a large schema may take tens of milliseconds)."""

    def __init__(self, matcher):
        self._proto = matcher

    def matcher(self):
        return self._proto.deep_copy()


class Grammars:
    """Compiles requests' options for one tokenizer. `vocab_size`: the model's (its logits' width,
    which may exceed the tokenizer's); `eos`: the ids that end a request, allowed exactly where
    the grammar may end."""

    def __init__(self, tokenizer, vocab_size: int, eos=()):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, sorted(eos)
        self._lltok = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Guide] = OrderedDict()  # the last CACHED grammars compiled, by spec

    CACHED = 64

    def lltokenizer(self):
        """llguidance's tokenizer (about a second for a large vocabulary, once); ValueError where
        it cannot take this one."""
        _llguidance()
        with self._lock:
            if self._lltok is None:
                if self.tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer; this server has none")
                self._lltok = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos)
        return self._lltok

    def compile(self, kind: str, spec) -> Guide:
        """kind: "json" (a schema: dict or JSON text), "regex", "lark" (text) or "choice" (a list of
        strings). ValueError with llguidance's message for a grammar it rejects. A client that
        sends the same schema again gets the guide compiled the first time."""
        key = json.dumps([kind, spec], sort_keys=True)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        guide = self._compile(kind, spec)
        with self._lock:
            self._cache[key] = guide
            while len(self._cache) > self.CACHED:
                self._cache.popitem(last=False)
        return guide

    def _compile(self, kind: str, spec) -> Guide:
        llg = _llguidance()
        tok = self.lltokenizer()
        try:
            if kind == "json":
                schema = json.loads(spec) if isinstance(spec, str) else spec
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema is an object")
                grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_STYLE)
            elif kind == "choice":
                if not spec or not all(isinstance(s, str) and s for s in spec):
                    raise ValueError("guided_choice takes a non-empty list of non-empty strings")
                grammar = llg.grammar_from("choice", list(spec))
            elif kind in ("regex", "lark"):
                grammar = llg.grammar_from(kind, spec)
            else:
                raise ValueError(f"unknown grammar kind {kind!r}")
        except ValueError as e:
            raise ValueError(f"invalid {_NAMES[kind]}: {e}") from None
        err = llg.LLMatcher.validate_grammar(grammar, tok)
        if err:
            raise ValueError(f"invalid {_NAMES[kind]}: {err.strip()}")
        m = llg.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"invalid {_NAMES[kind]}: {m.get_error().strip()}")
        return Guide(m)


# text whose tokens cover spaces, newlines, tabs, quotes, brackets, digits and multi-byte characters:
# llguidance must read the tokenizer's tokens as the bytes transformers decodes them to
PROBE = 'x {"a": [1, 2.5e-3, "x y"],\n\t"b\\"": null}  \n\n¡olé! 中文 👍 <tag/>'


def ll_tokenizer(tokenizer, vocab_size: int, eos=()):
    """llguidance's `LLTokenizer` for a Hugging Face fast tokenizer, built as
    `llguidance.hf.from_tokenizer` builds it, and checked: PROBE's tokens must be the same bytes to
    llguidance as the text transformers decodes them to (ValueError if not).

    One repair: tokenizers converted from GGUF (transformers' converter, so `orthros download`) carry
    the decoder Sequence(ByteFallback, Fuse, Replace, ByteLevel), which llguidance takes for
    SentencePiece's byte fallback. It then reads a byte-level BPE's 'Ġ' (a space) and 'Ċ' (a
    newline) literally: a regex with a space could not be met, and a newline token could enter a
    JSON string. Behind a ByteLevel pre-tokenizer that decoder does what the plain ByteLevel one
    does, which replaces it here."""
    import llguidance

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"structured output needs a Hugging Face fast tokenizer; this model's is a "
                         f"{type(tokenizer).__name__}")
    try:
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        spec = json.loads(backend.to_str())
        eos = list(eos) or tokenizer.eos_token_id
        decoders = (spec.get("decoder") or {}).get("decoders") or []
        if _is_byte_level(spec.get("pre_tokenizer")) and any(d.get("type") == "ByteLevel" for d in decoders):
            spec["decoder"] = next(d for d in decoders if d.get("type") == "ByteLevel")
        lltok = llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=eos)
        ids = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        # (a SentencePiece tokenizer's first token has a space that transformers drops)
        got = lltok.decode_bytes(ids).lstrip(b" ")
        want = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False).encode()
    except Exception as e:  # noqa: BLE001 - whatever llguidance or the tokenizer raise on an unusual vocabulary
        raise ValueError(f"structured output cannot use this model's tokenizer ({type(tokenizer).__name__}): "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if got != want.lstrip(b" "):
        raise ValueError(f"structured output cannot use this model's tokenizer: llguidance reads its tokens as "
                         f"other bytes than they decode to ({got[:40]!r} for {want[:40]!r})")
    return lltok


def _is_byte_level(pre) -> bool:
    if not pre:
        return False
    return pre.get("type") == "ByteLevel" or any(_is_byte_level(p) for p in pre.get("pretokenizers") or ())


_NAMES = {"json": "JSON schema", "regex": "regex", "lark": "grammar", "choice": "guided_choice"}
