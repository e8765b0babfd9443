"""Whether torch.export is tracing: the one question the export-safe paths ask.

torch.export traces neither a Triton launch's arithmetic, a host sync nor a data-dependent branch,
so under it the layers take their reference paths. `torch.compiler.is_exporting()` is the public
question, but Dynamo in torch 2.11 and older folds it to True inside every trace it makes, torch.compile's
included: a compiled decode step then ran the reference attention over a whole low-bit cache (53x slower
at 64K on an H100). Dynamo folds a read of the flag behind it to the flag's value, on every release.
"""

from __future__ import annotations

import torch


def exporting() -> bool:
    """True under torch.export only (strict or not), False in eager code and under torch.compile."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    if flag is None:  # a release without the flag: its public question
        return bool(torch.compiler.is_exporting())
    return bool(flag)
