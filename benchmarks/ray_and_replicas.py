"""Ray executor against mp and uni (per-wave cost, digits throughput) and replica scaling
under a Poisson load; prints JSON.

Same as ``diffusion-runtime bench ray``. (Not named ``ray.py``: as a script it
would shadow the ``ray`` package.)
"""

import json

from diffusion_runtime.bench.ray import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
