"""The paged KV cache: the single-query op, and one mixed forward (decodes and prompt chunks
of several sequences, scattered blocks) against each sequence run alone."""

import pytest
import torch

from orthros.models.paged_cache import PagedKVPool, PagedStepCache, Segment
from orthros.ops.naive import naive_attention
from orthros.ops.paged import paged_attention_ref

from ..conftest import DEVICE, make_model, rel_err, run_triton_interpreted


def test_paged_reference_equals_naive_on_gathered_keys():
    torch.manual_seed(0)
    bs, nb, Hkv, H, D = 4, 16, 2, 4, 8
    kp, vp = torch.randn(nb * bs, Hkv, D), torch.randn(nb * bs, Hkv, D)
    blocks = [7, 2, 11, 5]
    q = torch.randn(1, H, D)
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(14)])
    for window, sinks in ((None, 0), (3, 0), (3, 2), (3, 11), (3, 14), (None, 2)):
        got = paged_attention_ref(q, kp, vp, torch.tensor([blocks]), torch.tensor([13]), bs, window, sinks=sinks)
        ref = naive_attention(q[:, None], kp[slots][None], vp[slots][None], torch.tensor([[13]]),
                              torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 14, dtype=torch.long), window,
                              sinks=sinks, return_probs=True)
        assert rel_err(got, ref[0][:, 0]) < 1e-6, (window, sinks)
        seen = int((ref[1] > 0).sum()) // H  # a case that can fail: the sinks change what is seen
        assert seen == (14 if window is None else 3 + min(sinks, 11)), (window, sinks, seen)


def test_paged_op_stores_into_a_given_output_and_checks_it():
    from orthros.ops.paged import paged_attention

    torch.manual_seed(0)
    kp, vp = torch.randn(64, 2, 8), torch.randn(64, 2, 8)
    table, pos, q = torch.tensor([[3, 1, 0], [2, 5, 4]]), torch.tensor([5, 9]), torch.randn(2, 4, 8)
    buf = torch.zeros(1, 4, 4, 8)
    res = paged_attention(q, kp, vp, table, pos, 4, out=buf[0, 2:])
    assert res.data_ptr() == buf[0, 2:].data_ptr() and torch.equal(buf[0, :2], torch.zeros(2, 4, 8))
    assert rel_err(buf[0, 2:], paged_attention_ref(q, kp, vp, table, pos, 4)) < 1e-6
    for bad in (torch.zeros(2, 4, 7), torch.zeros(2, 4, 8, dtype=torch.float64), torch.zeros(2, 8, 4).transpose(1, 2)):
        with pytest.raises(ValueError, match="out must be"):
            paged_attention(q, kp, vp, table, pos, 4, out=bad)


def test_paged_kernel_interpreted():
    r = run_triton_interpreted("-m", "tests.serve.paged_kernel_cases", timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.long
@pytest.mark.skipif(DEVICE.type != "cuda", reason="the kernel compiled for the GPU (the interpreter case above on CPU)")
def test_paged_kernel_on_the_gpu():
    from .paged_kernel_cases import main

    try:
        main()  # the same cases, compiled (sets CUDA as the default device while it runs)
    finally:
        torch.set_default_device(None)


def _forward(model, pool, segments):
    cache = PagedStepCache(pool, model.config, segments)
    h = model.model.forward_streams(model.model.embed_tokens(cache.input_ids), cache.layout, cache)
    return model.lm_head(h)[0]


@pytest.mark.parametrize("attention", ["orthros", "full", "swa"])
@torch.no_grad()
def test_mixed_step_equals_each_sequence_alone(attention):
    """Step 1 prefills A's first chunk (no output) and all of B; step 2 mixes B's decode, A's
    last chunk and C's one-token prompt. Every output row equals a plain forward of its
    sequence; blocks are scattered through the pool."""
    model = make_model(attention, window=5, initializer_range=0.3)
    pool = PagedKVPool(model.config, 40, 4, DEVICE, torch.float32)
    g = torch.Generator().manual_seed(0)
    A, B, C = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (23, 9, 1))
    ta, tb, tc = [3, 17, 8, 30, 1, 22, 12], [5, 39, 0], [26]
    logits1 = _forward(model, pool, [Segment(A[:14], 0, ta, False), Segment(B, 0, tb, True)])
    assert logits1.shape[0] == 1
    nb = int(logits1[0].argmax())
    logits2 = _forward(model, pool, [Segment([nb], 9, tb, True), Segment(A[14:], 14, ta, True),
                                     Segment(C, 0, tc, True)])

    def alone(ids):
        return model(torch.tensor([ids], device=DEVICE), logits_to_keep=1).logits[0, -1]

    assert rel_err(logits1[0], alone(B)) < 1e-5
    assert rel_err(logits2[0], alone(B + [nb])) < 1e-5
    assert rel_err(logits2[1], alone(A)) < 1e-5
    assert rel_err(logits2[2], alone(C)) < 1e-5


def test_segment_without_enough_blocks_is_an_error():
    model = make_model("orthros")
    pool = PagedKVPool(model.config, 4, 4, "cpu", torch.float32)
    with pytest.raises(ValueError, match="need 2 blocks"):
        PagedStepCache(pool, model.config, [Segment(list(range(5)), 0, [1], True)])
