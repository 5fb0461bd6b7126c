"""Mixed-adapter step batches vs waves split by adapter, and an adapter's cost; prints JSON.

Same as ``diffusion-runtime bench lora``.
"""

import json

from diffusion_runtime.bench.lora import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
