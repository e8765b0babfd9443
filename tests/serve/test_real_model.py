"""The real model converted with attention sinks (the demo's conversion: SmolLM2-135M-Instruct, 4 sinks)
served by the engine: two chats about one document, served together, give each one's greedy tokens
from `generate()` alone, the shared document's blocks reused."""

import torch
from transformers import AutoTokenizer

from orthros.generate import generate
from orthros.loading import load_model
from orthros.serve.engine import Engine, EngineConfig, SamplingParams

from ..conftest import smollm2_dir
from .test_engine import Collector


def test_converted_model_with_sinks_served_equals_generate():
    from orthros.demo.real import document

    tok = AutoTokenizer.from_pretrained(smollm2_dir("hf"))
    model = load_model(smollm2_dir("orthros", window=32, sinks=4)).eval()
    assert model.config.sink_tokens == 4
    doc = document(2400)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{doc}\n\nQuestion: {q}"}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
               for q in ("Which statement is used for exception handling?", "What does a for loop iterate over?")]
    assert min(len(p) for p in prompts) > 400  # far past the window and its sinks
    eng = Engine(model, EngineConfig(block_size=16, num_blocks=128, max_num_batched_tokens=256, max_num_seqs=4))
    out = Collector()
    for i, p in enumerate(prompts):
        eng.submit(p, SamplingParams(max_tokens=6), out.sink(i))
    eng.run_until_done()
    assert eng.blocks.hit_tokens > 0  # the second chat reused the document's blocks
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = generate(model, torch.tensor([p]), max_new_tokens=6, temperature=0.0)[0, len(p):].tolist()
        assert out.tokens(i) == ref, (i, out.tokens(i), ref)
