"""RL trajectories (``return_trajectory="full"``) against images only: time and bytes
per request, in process and through the stage, side by side; prints JSON.

Same as ``diffusion-runtime bench rl``.
"""

import json

from diffusion_runtime.bench.rl import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
