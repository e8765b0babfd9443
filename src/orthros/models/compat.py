"""The transformers releases Orthros runs on differ in a few names; they are settled here.

transformers 5.17 (the GPU image) calls the KV cache `past_key_values`
everywhere; later releases (5.24) call it `cache`: in the keyword arguments
`generate()` passes to `forward()`, in the key it keeps in its model kwargs,
and in the field of `CausalLMOutputWithPast` (the old name survives there as
a deprecated alias). Orthros accepts both names in `forward()` and answers
to both on its output, so user code written for either release runs on both.
"""

from __future__ import annotations

import inspect

from transformers import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

# The key under which transformers' generate() keeps the cache and passes it to forward().
GENERATE_CACHE_KEY = ("cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
                      else "past_key_values")
# The name of the cache field of transformers' model outputs.
OUTPUT_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def set_checkpointing(model, enable: bool) -> None:
    """Activation checkpointing on or off: `activation_checkpointing_enable` on releases that
    have it (5.24; the old name warns there), `gradient_checkpointing_enable` before."""
    if enable:
        fn = getattr(model, "activation_checkpointing_enable", None)
        if fn is not None:
            fn(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        fn = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        fn()
