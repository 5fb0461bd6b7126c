"""Step time with preempted state offloaded to host memory, against none; prints JSON.

Same as ``diffusion-runtime bench offload``.
"""

import json

from diffusion_runtime.bench.offload import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
