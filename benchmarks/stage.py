"""Stage process costs: round trip through a StageClient against the in-process engine
(digits pipeline), and encode/decode of one 512x512x3 float image output; prints JSON.
"""

import json

from diffusion_runtime.bench.stage import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
