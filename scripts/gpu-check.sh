#!/usr/bin/env bash
# The GPU check: the suite on CUDA, then the GPU, sleep and parallel benchmarks, in under 10 minutes.
#
# For a machine with CUDA torch (Python 3.12) and no package registry. Prepare
# the wheelhouse first, on a machine with a registry (see docs/gpu.md):
#
#   scripts/gpu-wheels.sh .whl
#
# then, on the GPU machine, from the repository root:
#
#   OUT=/some/dir scripts/gpu-check.sh
#
# Phases, each with its own time limit: install the carried wheels and the
# project into $SITE; (a) the suite with --device cuda (CI hypothesis profile)
# and the stateful harness again with the thorough profile; (b) the GPU
# benchmark (`diffusion-runtime bench gpu`); (c) the sleep benchmark on CUDA
# (`bench sleep`: device memory before the engine, loaded and asleep, at both
# levels); (d) the parallel benchmark (`bench parallel`: one rank against
# CFG-parallel ranks, skipped with its reason under two devices); (e) a summary. Under $OUT: gpu-check.log (everything printed),
# summary.json (each phase's exit status and seconds, the benchmark's headline
# ratios, the sleep memory figures, the parallel table), bench-gpu.json,
# bench-sleep.json, bench-parallel.json, suite.xml
# and stateful.xml (JUnit), nvidia-smi.txt. The exit status is 0 only if every
# phase passed and a level-2 sleep left the device within 5% of the weights above
# the pre-load baseline.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check-out}
wheels=${WHEELS:-.whl}
site=${SITE:-/tmp/diffusion-runtime-site}
python=${PYTHON:-python3}
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
export PYTHONUNBUFFERED=1
started=$(date +%s)
phases=()

# phase NAME LIMIT_S COMMAND...: run COMMAND under a time limit and record how it went.
phase() {
    local name=$1 limit=$2
    shift 2
    local t0 status
    t0=$(date +%s)
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@"
    status=$?
    phases+=("$name $status $(($(date +%s) - t0))")
    echo "=== $name: exit $status after $(($(date +%s) - t0))s"
    return "$status"
}

# The carried wheels, then the project itself (for its entry points), into $site.
install_wheels() {
    if ! compgen -G "$wheels/*.whl" >/dev/null; then
        echo "no wheels in $wheels: run scripts/gpu-wheels.sh $wheels where a registry is reachable"
        return 1
    fi
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheels"/*.whl || return
    "$python" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
        --no-cache-dir --upgrade --target "$site" . || return
    PYTHONPATH="$site" "$python" -c 'import torch, diffusers, diffusion_runtime
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))'
}

bench_to_json() {
    "$python" -m diffusion_runtime.cli bench gpu >"$out/bench-gpu.json"
}

sleep_to_json() {
    "$python" -c 'import json; from diffusion_runtime.bench.sleep import run
print(json.dumps(run(rounds=3, device="cuda"), indent=2))' >"$out/bench-sleep.json"
}

parallel_to_json() {
    "$python" -m diffusion_runtime.cli bench parallel --rounds 2 >"$out/bench-parallel.json"
}

export python site wheels out
export -f install_wheels bench_to_json sleep_to_json parallel_to_json

nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed (see nvidia-smi.txt)"
if phase install 60 bash -c install_wheels; then
    export PYTHONPATH="$site"
    phase suite 210 "$python" -m pytest -q -p no:cacheprovider --device cuda -rs \
        --junitxml="$out/suite.xml" tests --ignore=tests/test_engine_stateful.py
    phase stateful-thorough 100 env HYPOTHESIS_PROFILE=thorough "$python" -m pytest -q \
        -p no:cacheprovider --device cuda --junitxml="$out/stateful.xml" \
        tests/test_engine_stateful.py
    phase bench 110 bash -c bench_to_json
    phase sleep 60 bash -c sleep_to_json
    phase parallel 60 bash -c parallel_to_json
fi

printf '%s\n' "${phases[@]}" | "$python" -c '
import json, sys
out, started, now = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
phases = {}
for line in sys.stdin.read().split("\n"):
    if line:
        name, status, seconds = line.split()
        phases[name] = {"exit": int(status), "seconds": int(seconds),
                        "timed_out": status in ("124", "137")}
summary = {"phases": phases, "total_seconds": now - started,
           "passed": len(phases) == 6 and all(p["exit"] == 0 for p in phases.values())}
try:
    bench = json.load(open(f"{out}/bench-gpu.json"))
    summary["device"] = bench["device"]
    summary["dit"] = {n: {k: v for k, v in row.items() if k != "images_per_s"}
                      for n, row in bench["dit"].items()}
    summary["digits_engine_over_direct"] = {
        b: row["engine_over_direct"] for b, row in bench["digits"].items()}
except (OSError, ValueError, KeyError) as exc:
    summary["bench_error"] = repr(exc)
try:
    sleep = json.load(open(f"{out}/bench-sleep.json"))
    summary["sleep"] = {level: {k: sleep[level][k] for k in (
        "sleep_ms", "wake_ms", "first_after_wake_over_warm", "device_bytes",
        "asleep_within_5pct_of_baseline")} for level in ("level_1", "level_2")}
    summary["passed"] = summary["passed"] and sleep["level_2"]["asleep_within_5pct_of_baseline"]
except (OSError, ValueError, KeyError) as exc:
    summary["sleep_error"] = repr(exc)
    summary["passed"] = False
try:
    parallel = json.load(open(f"{out}/bench-parallel.json"))
    summary["parallel"] = parallel.get("skipped") or {
        name: {k: v for k, v in row.items() if "_2_over_" in k and not k.startswith("cpu")}
        for name, row in parallel["workloads"].items()}
except (OSError, ValueError, KeyError) as exc:
    summary["parallel_error"] = repr(exc)
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
sys.exit(0 if summary["passed"] else 1)
' "$out" "$started" "$(date +%s)"
