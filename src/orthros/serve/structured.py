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


class Guide:
    """One compiled grammar. The matcher built at compile time is never advanced: each request
    gets a copy (`deep_copy` is cheap; compiling a large schema may take tens of milliseconds)."""

    def __init__(self, matcher, what: str):
        self._proto, self.what = matcher, what

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
                try:
                    from llguidance.hf import from_tokenizer

                    eos = self.eos or None
                    self._lltok = from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=eos)
                except Exception as e:  # noqa: BLE001 - a slow, byte, or otherwise unusual tokenizer
                    raise ValueError(f"structured output cannot use this model's tokenizer "
                                     f"({type(self.tokenizer).__name__}): {e}") from None
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
                grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
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
        return Guide(m, _NAMES[kind])


_NAMES = {"json": "JSON schema", "regex": "regex", "lark": "grammar", "choice": "guided_choice"}
