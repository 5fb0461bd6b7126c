"""The ``diffusion-runtime`` command line: generate, eval, audit, bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.errors import DiffusionRuntimeError
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.sampling_params import SamplingParams

DEFAULT_PROMPTS = [str(d) for d in range(10)]


def _engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipeline", default="digits", help="pipeline name or import path")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="largest wave or step batch")
    parser.add_argument("--mode", choices=["request", "step"], default="request")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (>1 uses 'mp')")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        pipeline=args.pipeline,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        execution_mode=args.mode,
        num_workers=args.workers,
    )


class ProgressBar:
    """A one-line progress bar on stderr, redrawn in place."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total = total
        self.width = width
        self.done = 0

    def advance(self) -> None:
        self.done += 1
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} requests")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def _run_with_progress(
    engine: DiffusionEngine, prompts: list[str], params: list[SamplingParams]
) -> list[RequestOutput]:
    ids = [await engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    bar = ProgressBar(len(ids))

    async def final(rid: str) -> RequestOutput:
        last: RequestOutput | None = None
        async for out in engine.stream(rid):
            last = out
        assert last is not None
        bar.advance()
        return last

    return list(await asyncio.gather(*(final(rid) for rid in ids)))


def save_grid(outputs: list[RequestOutput], path: Path) -> None:
    """All images of all outputs in one PNG: one row per request, or rows of ten
    when every request has a single image."""
    from PIL import Image

    rows = [out.pil_images() for out in outputs if out.ok]
    if not rows:
        return
    if all(len(row) == 1 for row in rows):
        flat = [row[0] for row in rows]
        rows = [flat[i : i + 10] for i in range(0, len(flat), 10)]
    cell_w = max(img.width for row in rows for img in row)
    cell_h = max(img.height for row in rows for img in row)
    columns = max(len(row) for row in rows)
    grid = Image.new("RGB", (columns * cell_w, len(rows) * cell_h))
    for y, row in enumerate(rows):
        for x, img in enumerate(row):
            grid.paste(img.convert("RGB"), (x * cell_w, y * cell_h))
    grid.save(path)


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = args.prompts or DEFAULT_PROMPTS
    # The digits are 8x8 pixels: upscale them to something one can look at.
    size = args.size if args.size is not None else (64 if args.pipeline == "digits" else None)
    params = [
        SamplingParams(
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            seed=None if args.seed is None else args.seed + i,
            num_outputs_per_prompt=args.num_outputs,
            height=size,
            width=size,
        )
        for i in range(len(prompts))
    ]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with DiffusionEngine.make_engine(_engine_config(args)) as engine:
        start = time.perf_counter()
        outputs = asyncio.run(_run_with_progress(engine, prompts, params))
        wall = time.perf_counter() - start
    images = 0
    for index, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        if not out.ok:
            print(f"request for {prompt!r} {out.status.value}: {out.error}", file=sys.stderr)
            continue
        for i, img in enumerate(out.pil_images()):
            img.save(out_dir / f"{index:03d}-{_file_stem(prompt)}-{i}.png")
            images += 1
    save_grid(outputs, out_dir / "grid.png")
    failed = sum(not out.ok for out in outputs)
    print(
        f"{len(outputs)} requests, {images} images in {wall:.2f} s "
        f"({images / wall:.1f} images/s), {failed} failed -> {out_dir}/grid.png"
    )
    return 1 if failed else 0


def _file_stem(prompt: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in prompt)
    return safe[:40] or "prompt"


def cmd_eval(args: argparse.Namespace) -> int:
    from diffusion_runtime.pipelines.digits import recognition_rates

    params = [
        SamplingParams(
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            seed=args.seed + digit,
            num_outputs_per_prompt=args.samples,
        )
        for digit in range(10)
    ]
    with DiffusionEngine.make_engine(_engine_config(args)) as engine:
        outputs = engine.generate(DEFAULT_PROMPTS, params)
    failed = [out for out in outputs if not out.ok]
    if failed:
        print(f"{len(failed)} requests failed: {failed[0].error}", file=sys.stderr)
        return 1
    images = torch.cat([out.image_batch for out in outputs if out.image_batch is not None])
    labels = torch.arange(10).repeat_interleave(args.samples)
    overall, per_digit = recognition_rates(images, labels)
    report = {
        "samples_per_digit": args.samples,
        "num_inference_steps": args.steps,
        "recognised": round(overall, 4),
        "per_digit": {str(d): round(r, 4) for d, r in per_digit.items()},
    }
    print(json.dumps(report, indent=2))
    return 0 if overall >= args.min_rate else 1


def cmd_audit(args: argparse.Namespace) -> int:
    from diffusion_runtime.fsm.audit import audit_events
    from diffusion_runtime.fsm.trace import read_trace

    violations = audit_events(read_trace(args.trace))
    for violation in violations:
        print(violation.describe())
    by_invariant: dict[str, int] = {}
    for violation in violations:
        by_invariant[violation.invariant] = by_invariant.get(violation.invariant, 0) + 1
    summary = ", ".join(f"{inv}: {n}" for inv, n in sorted(by_invariant.items())) or "none"
    print(f"{len(violations)} violations ({summary}) in {args.trace}")
    return 1 if violations else 0


BENCHMARKS = {
    "control-plane": "diffusion_runtime.bench.control_plane:run",
    "step-vs-request": "diffusion_runtime.bench.step_vs_request:run",
    "dit": "diffusion_runtime.bench.dit:run",
    "digits": "diffusion_runtime.bench.digits:run",
    "stage": "diffusion_runtime.bench.stage:run",
    "ipc": "diffusion_runtime.bench.ipc:run",
    "ray": "diffusion_runtime.bench.ray:run",
}


def cmd_bench(args: argparse.Namespace) -> int:
    from diffusion_runtime.pipelines.registry import import_object

    result: dict[str, Any] = import_object(BENCHMARKS[args.name])()
    print(json.dumps(result, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffusion-runtime", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate images and write PNGs")
    generate.add_argument("prompts", nargs="*", help="prompts (default: the ten digits)")
    generate.add_argument("--steps", type=int, default=25)
    generate.add_argument("--guidance", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=0, help="seed of the first prompt")
    generate.add_argument("--num-outputs", type=int, default=1, help="images per prompt")
    generate.add_argument(
        "--size", type=int, default=None, help="output size in pixels (digits default: 64)"
    )
    generate.add_argument("--out", default="out", help="output directory")
    _engine_options(generate)
    generate.set_defaults(func=cmd_generate)

    evaluate = commands.add_parser("eval", help="score samples with a digit classifier")
    evaluate.add_argument("--samples", type=int, default=20, help="samples per digit")
    evaluate.add_argument("--steps", type=int, default=25)
    evaluate.add_argument("--guidance", type=float, default=1.0)
    evaluate.add_argument("--seed", type=int, default=0)
    evaluate.add_argument("--min-rate", type=float, default=0.9, help="exit 1 below this rate")
    _engine_options(evaluate)
    evaluate.set_defaults(func=cmd_eval)

    audit = commands.add_parser("audit", help="check a JSON-lines trace against the invariants")
    audit.add_argument("trace", help="a trace written with EngineConfig(trace_path=...)")
    audit.set_defaults(func=cmd_audit)

    bench = commands.add_parser("bench", help="run a benchmark and print JSON")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except (ValueError, DiffusionRuntimeError) as exc:  # bad input or start-up: say what, briefly
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
