"""A case module for tests/test_interpreted.py: what a case may do to the process it runs in."""

import os
import sys
import time

if __name__ == "__main__":
    what = sys.argv[1]
    if what == "env":  # a case's environment does not reach the next case
        print("seen" if "ORTHROS_PROBE" in os.environ else "unseen")
        os.environ["ORTHROS_PROBE"] = "1"
    elif what == "rng":  # every case starts from the same random state
        import torch

        print(torch.rand(1).item())
    elif what == "exit":
        print("before", flush=True)
        sys.exit(3)
    elif what == "raise":
        raise ValueError("a failed check")
    elif what == "die":
        os._exit(5)
    elif what == "fd":  # written past sys.stdout, as C code does
        os.write(1, b"stray\n")
        print("ok")
    elif what == "sleep":
        time.sleep(60)
    elif what == "pid":
        print(os.getpid())
