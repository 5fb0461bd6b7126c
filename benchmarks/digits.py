"""Digits images/s alone and in batches of 8 and 64, engine vs direct; prints JSON.

Same as ``diffusion-runtime bench digits``.
"""

import json

from diffusion_runtime.bench.digits import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
