"""A tiny DiT through the engine in step mode vs diffusers' own pipe(); prints JSON.

Needs the ``diffusers`` extra (``pip install -e .[diffusers]``).
"""

import json

from diffusion_runtime.bench.dit import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
