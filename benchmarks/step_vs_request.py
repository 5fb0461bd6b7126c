"""Step mode vs request mode on one Poisson trace of short and long requests; prints JSON.

Same as ``diffusion-runtime bench step-vs-request``.
"""

import json

from diffusion_runtime.bench.step_vs_request import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
