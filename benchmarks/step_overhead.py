"""The runtime's cost per request-step at B = 1, 8 and 32, step and request mode; prints JSON.

Same as ``diffusion-runtime bench step-overhead``.
"""

import json

from diffusion_runtime.bench.step_overhead import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
