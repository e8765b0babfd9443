"""A tiny Orthros model directory with a BPE tokenizer and a chat template, and real servers
on localhost for the API tests (uvicorn in a background thread, a free port each)."""

import pytest
import torch

from orthros.convert.tiny import tiny_tokenizer
from orthros.serve.engine import Engine, EngineConfig, SamplingParams

from ..conftest import make_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-model")
    tok = tiny_tokenizer(vocab_size=300, corpus_bytes=30_000)
    model = make_model("orthros", window=8, initializer_range=0.3, vocab_size=len(tok),
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def with_chat_template(model_dir, to, template: str):
    """A copy of `model_dir` at `to` whose tokenizer carries `template` as its chat template."""
    import json
    import shutil

    shutil.copytree(model_dir, to)
    cfg = json.loads((to / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (to / "tokenizer_config.json").write_text(json.dumps(cfg))
    (to / "chat_template.jinja").unlink(missing_ok=True)
    return to


def start_server(model_dir, api_key=None, **engine):
    from orthros.serve.launch import build_app, load_model, serve_in_thread

    model, tok, name = load_model(str(model_dir), None, "cpu")
    cfg = dict(block_size=4, num_blocks=512, max_num_batched_tokens=32, max_num_seqs=16, max_model_len=256)
    app, eng = build_app(model, tok, name, EngineConfig(**{**cfg, **engine}), api_key=api_key)
    return serve_in_thread(app, eng), model, tok, name


@pytest.fixture(scope="module")
def server(model_dir):
    srv, model, tok, name = start_server(model_dir)
    yield srv, model, tok, name
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server[0].url, api_key="none", max_retries=0, timeout=60)


def reference(model, tok, prompt_ids, max_new):
    """Greedy tokens of the prompt alone (stopping after EOS, as the server does)."""
    from orthros.generate import generate

    with torch.no_grad():
        ids = generate(model, [prompt_ids], max_new_tokens=max_new, stop_tokens=tok.eos_token_id)
    return ids[0, len(prompt_ids):].tolist()


def decoding_engine(model, **engine):
    """An engine with three requests of different lengths all decoding, each with room for its next
    token, and that decode step's segments: (engine, segments)."""
    from orthros.models.paged_cache import Segment

    eng = Engine(model, EngineConfig(**{**dict(block_size=4, num_blocks=64, max_num_seqs=8, max_model_len=64),
                                        **engine}))
    for p in ([1, 2, 3, 4, 5, 6, 7], list(range(40, 61)), [9]):
        eng.submit(p, SamplingParams(max_tokens=30), lambda ev: None)
    for _ in range(4):
        eng.step()
    assert len(eng.running) == 3 and all(len(r.tokens) - r.computed == 1 for r in eng.running)  # all decoding
    for r in eng.running:
        assert eng.scheduler.grow(r, len(r.tokens))
    return eng, [Segment([r.tokens[-1]], r.computed, r.table.blocks, True) for r in eng.running]


def decode_graphs(eng):
    """`serve.graphs.DecodeGraphs` over an engine's model and pool, sized by its config."""
    from orthros.serve.graphs import DecodeGraphs

    return DecodeGraphs(eng.model, eng.pool, eng.scratch_block, eng.max_model_len, eng.cfg.max_num_seqs)
