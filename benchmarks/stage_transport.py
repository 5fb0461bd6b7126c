"""What CURVE-authenticated TCP costs against IPC: stage round trips (digits pipeline)
and one 3 MiB image through ZMQ socket pairs; prints JSON.
"""

import json

from diffusion_runtime.bench.stage_transport import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
