"""Run under TRITON_INTERPRET=1 (see test_engine.py): the decode graphs' forward with the fused
Triton elementwise kernels (what a CUDA capture runs) gives the eager step's logits, and
really runs those kernels."""

import torch

import orthros.layers.fused as fused
from orthros.ops import rowwise
from ..conftest import make_model
from .conftest import decode_graphs, decoding_engine


def main():
    for attention in ("orthros", "full"):
        model = make_model(attention, window=6, initializer_range=0.3)
        eng, segments = decoding_engine(model, max_num_seqs=4)
        with torch.inference_mode():
            eager = eng.runner.forward(segments)
            graphs = decode_graphs(eng)
            graphs.fuse = True
            graphs._fill(segments, 4)
            calls, heads = [], []
            real, real_heads = fused._rowwise, rowwise.heads
            fused._rowwise = lambda: calls.append(1) or real()
            rowwise.heads = lambda *a, **k: heads.append(a[0].shape) or real_heads(*a, **k)
            try:
                static = graphs._forward(graphs._cache(4))[:3]
            finally:
                fused._rowwise, rowwise.heads = real, real_heads
        L = model.config.num_hidden_layers
        assert len(calls) >= 4 * L, (attention, len(calls))  # norms, q/k heads, SwiGLU: every layer
        # queries (Orthros: both streams' rows, each with its own SO, in one call) and keys: every layer
        assert len(heads) == 2 * L, (attention, heads)
        err = ((static - eager).norm() / eager.norm()).item()
        assert err < 1e-5, (attention, err)
    print("ok")


if __name__ == "__main__":
    main()
