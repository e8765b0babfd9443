import torch

# The op tests compile FlexAttention for many odd shapes; let each keep its own kernel
# instead of falling back to the uncompiled reference after the default 8.
for _name in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, 64)
