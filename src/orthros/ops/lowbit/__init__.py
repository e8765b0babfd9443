"""Low-bit (int4 / int2) K/V storage: the format (`format.py`: quantization, bit packing, the
dequantize-then-attend reference) and a decode step's write (`write.py`, its Triton kernel in
`write_kernel.py`). What reads it is the split-KV op's low-bit reader (`ops/splitkv/lowbit.py`)."""

from .format import (BITS, dense_kv, dequantize, dequantize_keys, dequantize_values, pack, quantize, quantize_keys,
                     quantize_values, rotate, rotation_matrix, unpack)
from .write import decode_write, write_kernel_applies

__all__ = ["BITS", "dense_kv", "dequantize", "dequantize_keys", "dequantize_values", "pack", "quantize",
           "quantize_keys", "quantize_values", "rotate", "rotation_matrix", "unpack", "decode_write",
           "write_kernel_applies"]
