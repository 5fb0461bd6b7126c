"""SLO attainment of every scheduling policy on a heterogeneous digits trace; prints JSON.

Same as ``diffusion-runtime bench slo``.
"""

import json

from diffusion_runtime.bench.slo import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
