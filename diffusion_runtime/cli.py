"""The ``diffusion-runtime`` command line: generate, eval, audit, hunt, bench, serve."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import attrs
import torch
from tqdm import tqdm

from diffusion_runtime.cli_checks import (
    CommandError,
    check_pipeline,
    parse_pipeline_args,
    prepare_output_dir,
    shipped_lora,
)
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.errors import DiffusionRuntimeError
from diffusion_runtime.fsm.events import TraceEvent
from diffusion_runtime.fsm.profile_merge import (
    ProfileMergeError,
    WorkerProfile,
    merged_trace,
    read_profiles,
)
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.sampling_params import SamplingParams

DEFAULT_PROMPTS = [str(d) for d in range(10)]


#: With streamed progress, a preview interval no request reaches: progress without previews.
NO_PREVIEWS = 10_000
#: EngineConfig's own preview interval, which ``serve --stream-progress`` keeps.
DEFAULT_PREVIEW_INTERVAL = cast(int, attrs.fields(EngineConfig).preview_interval.default)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except ``None`` defaults, which the help text explains."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipeline", default="digits", help="pipeline name or import path")
    parser.add_argument(
        "--pipeline-arg",
        action="append",
        metavar="NAME=VALUE",
        help="a keyword argument of the pipeline's factory (repeatable), e.g. path=DIR",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="largest wave or step batch")
    parser.add_argument(
        "--mode", choices=["request", "step"], default="request", help="execution mode"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes (>1 uses 'mp'; default: the product of the degrees below)",
    )
    for flag, what in (
        ("--cfg-parallel-size", "ranks that split guidance branches (1 or 2)"),
        ("--ulysses-degree", "ranks that split the sequence by attention heads"),
        ("--ring-degree", "ranks that split the sequence by ring attention"),
    ):
        parser.add_argument(flag, type=int, default=1, help=f"{what}; see docs/parallelism.md")


def _engine_config(args: argparse.Namespace, *, stream_progress: bool = False) -> EngineConfig:
    """The engine the options describe, after checking that its pipeline can be built.

    ``stream_progress`` in step mode asks for an output per denoising step.
    """
    pipeline_kwargs = parse_pipeline_args(args.pipeline_arg or [])
    check_pipeline(args.pipeline, pipeline_kwargs)
    return EngineConfig(
        pipeline=args.pipeline,
        pipeline_kwargs=pipeline_kwargs,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        execution_mode=args.mode,
        cfg_parallel_size=args.cfg_parallel_size,
        ulysses_degree=args.ulysses_degree,
        ring_degree=args.ring_degree,
        **({} if args.workers is None else {"num_workers": args.workers}),
        streaming_output=stream_progress and args.mode == "step",
        preview_interval=NO_PREVIEWS,
    )


async def run_with_progress(
    engine: DiffusionEngine, prompts: list[str], params: list[SamplingParams], bar: tqdm[Any]
) -> list[RequestOutput]:
    """Run one request per prompt and return their final outputs, moving ``bar``
    by denoising step where the engine streams progress, else by request.

    ``bar.total`` must be the sum of :func:`progress_units` over ``params``.
    """
    ids = [await engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    per_step = engine.config.streaming_output

    async def final(rid: str, units: int) -> RequestOutput:
        last: RequestOutput | None = None
        shown = 0
        async for out in engine.stream(rid):
            last = out
            reached = units if out.finished else min(out.step or 0, units)
            bar.update(reached - shown)
            shown = reached
        assert last is not None
        return last

    units = [progress_units(sp, per_step) for sp in params]
    return list(await asyncio.gather(*(final(r, u) for r, u in zip(ids, units, strict=True))))


def progress_units(params: SamplingParams, per_step: bool) -> int:
    """A request's share of the progress bar: its steps, or one request."""
    return params.num_inference_steps if per_step else 1


def save_grid(outputs: list[RequestOutput], path: Path) -> bool:
    """All images of all outputs in one PNG: one row per request, or rows of ten
    when every request has a single image. False when there was no image to save."""
    from PIL import Image

    rows = [out.pil_images() for out in outputs if out.ok]
    if not rows:
        return False
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
    return True


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = args.prompts or DEFAULT_PROMPTS
    # The digits are 8x8 pixels: upscale them to something one can look at.
    size = args.size if args.size is not None else (64 if args.pipeline == "digits" else None)
    lora = None if args.lora is None else shipped_lora(args.lora, args.pipeline)
    params = [
        SamplingParams(
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            seed=None if args.seed is None else args.seed + i,
            num_outputs_per_prompt=args.num_outputs,
            height=size,
            width=size,
            lora=lora,
        )
        for i in range(len(prompts))
    ]
    out_dir = Path(args.out)
    config = attrs.evolve(
        _engine_config(args, stream_progress=True),
        profile_dir=args.profile,
        max_loras=0 if lora is None else 1,
    )
    prepare_output_dir(out_dir)
    with DiffusionEngine.make_engine(config) as engine:
        total = sum(progress_units(sp, config.streaming_output) for sp in params)
        unit = "step" if config.streaming_output else "request"
        if args.profile is not None:
            engine.start_profile("generate")
        start = time.perf_counter()
        with tqdm(total=total, unit=unit, file=sys.stderr, disable=None) as bar:
            outputs = asyncio.run(run_with_progress(engine, prompts, params, bar))
        wall = time.perf_counter() - start
        if args.profile is not None:
            for path in engine.stop_profile():
                print(f"profile: {path}", file=sys.stderr)
    images = 0
    for index, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        if not out.ok:
            print(f"request for {prompt!r} {out.status.value}: {out.error}", file=sys.stderr)
            continue
        for i, img in enumerate(out.pil_images()):
            img.save(out_dir / f"{index:03d}-{_file_stem(prompt)}-{i}.png")
            images += 1
    grid = out_dir / "grid.png"
    wrote_grid = save_grid(outputs, grid)
    failed = sum(not out.ok for out in outputs)
    print(
        f"{len(outputs)} requests, {images} images in {wall:.2f} s "
        f"({images / wall:.1f} images/s), {failed} failed"
        + (f" -> {grid}" if wrote_grid else "; no image, so no grid written")
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
    if images.shape[1] != 1:
        raise CommandError(
            f"eval scores one-channel digit images; pipeline {args.pipeline!r} made images "
            f"of shape {tuple(images.shape[1:])}"
        )
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
    if (args.trace is None) == (args.replay is None):
        raise CommandError("audit takes a TRACE to check or --replay FILE to rerun (one of them)")
    if args.replay is not None:
        if args.profile is not None:
            raise CommandError("--profile DIR goes with a TRACE, not with --replay")
        return _audit_replay(args)
    if args.trace_out is not None:
        raise CommandError("--trace OUT.jsonl goes with --replay FILE")
    from diffusion_runtime.fsm.trace import read_trace

    try:
        events = list(read_trace(args.trace))
    except OSError as exc:
        raise CommandError(f"cannot read the trace {args.trace!r}: {exc.strerror}") from None
    profiles = _read_profiles(args.profile, args.perfetto)
    return 1 if _report_audit(events, args.perfetto, f"in {args.trace}", profiles) else 0


def _read_profiles(profile_dir: str | None, perfetto: str | None) -> list[WorkerProfile] | None:
    """The worker profiles to merge into ``--perfetto`` (``None``: no ``--profile``)."""
    if profile_dir is None:
        return None
    if perfetto is None:
        raise CommandError("--profile DIR goes with --perfetto OUT.json (it merges into it)")
    try:
        return read_profiles(profile_dir)
    except ProfileMergeError as exc:
        raise CommandError(str(exc)) from None


def _audit_replay(args: argparse.Namespace) -> int:
    """Rerun a failing harness example; 1 when it fails again, 0 when it does not."""
    from diffusion_runtime.fsm.trace import read_trace

    try:
        from diffusion_runtime.testing.replay import rerun
        from diffusion_runtime.testing.replay_file import ReplayFile
    except ImportError as exc:
        raise CommandError(f"--replay needs the test extra (hypothesis): {exc}") from None
    replay = ReplayFile.read(Path(args.replay))
    with tempfile.TemporaryDirectory(prefix="diffusion-runtime-replay-") as scratch:
        trace = Path(args.trace_out or Path(scratch) / "replay.jsonl")
        try:
            trace.touch()
        except OSError as exc:
            raise CommandError(f"--trace {str(trace)!r} is not writable: {exc.strerror}") from None
        outcome = rerun(replay, trace)
        events = list(read_trace(trace))
    for line in outcome.steps:
        print(line)
    if outcome.reproduced:
        print(f"failure: {outcome.message}")
        if outcome.message != replay.failure:
            print(f"first reported: {replay.failure}")
    else:
        print(f"did not reproduce: {outcome.message}")
        print(
            "A replay reruns the recorded choices against the code as it is now: a fix, or a "
            "change to the pipeline, the harness or its options, can make them pass or mean "
            "another example."
        )
        print(f"first reported: {replay.failure}")
    where = f"in the replayed trace{f' {args.trace_out}' if args.trace_out else ''}"
    _report_audit(events, args.perfetto, where)
    return 1 if outcome.reproduced else 0


def cmd_hunt(args: argparse.Namespace) -> int:
    """Hunt a catalogue mutation on its own harness target (no name: list them);
    0 when caught, 1 when missed."""
    try:
        from diffusion_runtime.testing.mutations import CATALOGUE, hunt, named
    except ImportError as exc:
        raise CommandError(f"hunt needs the test extra (hypothesis): {exc}") from None
    if args.name is None:
        for listed in CATALOGUE:
            print(f"{listed.name} ({listed.target}, {listed.mode}): {listed.bug}")
        return 0
    try:
        mutation = named(args.name)
    except KeyError as exc:
        raise CommandError(f"{exc.args[0]} (diffusion-runtime hunt lists them)") from None
    replay = Path(args.replay_dir) / f"{mutation.name}.replay.json"
    replay.unlink(missing_ok=True)
    caught = hunt(mutation, None, args.examples, args.steps, Path(args.replay_dir))
    if caught is None:
        print(f"{mutation.name}: missed in {args.examples} examples ({mutation.bug})")
        return 1
    print(f"{mutation.name}: caught after {caught} example(s) ({mutation.bug})")
    if replay.exists():
        print(f"rerun it with: diffusion-runtime audit --replay {replay}")
    return 0


def _report_audit(
    events: list[TraceEvent],
    perfetto: str | None,
    where: str,
    profiles: list[WorkerProfile] | None = None,
) -> int:
    """Print each violation with its events and a summary (and write ``perfetto``,
    merged with the worker ``profiles`` when given); return the number of violations."""
    from diffusion_runtime.fsm.audit import audit_events

    violations = audit_events(events)
    if perfetto is not None:
        from diffusion_runtime.fsm.perfetto import chrome_trace

        document = (
            chrome_trace(events, violations)
            if profiles is None
            else merged_trace(events, violations, profiles)
        )
        try:
            with open(perfetto, "w", encoding="utf-8") as out:
                json.dump(document, out)
        except OSError as exc:
            raise CommandError(f"cannot write {perfetto!r}: {exc.strerror}") from None
    for violation in violations:
        print(violation.describe())
    by_invariant: dict[str, int] = {}
    for violation in violations:
        by_invariant[violation.invariant] = by_invariant.get(violation.invariant, 0) + 1
    summary = ", ".join(f"{inv}: {n}" for inv, n in sorted(by_invariant.items())) or "none"
    print(f"{len(violations)} violations ({summary}) {where}")
    return len(violations)


BENCHMARKS = {
    "audit": "diffusion_runtime.bench.audit:run",
    "cache": "diffusion_runtime.bench.cache:run",
    "control-plane": "diffusion_runtime.bench.control_plane:run",
    "step-vs-request": "diffusion_runtime.bench.step_vs_request:run",
    "dit": "diffusion_runtime.bench.dit:run",
    "step-overhead": "diffusion_runtime.bench.step_overhead:run",
    "gpu": "diffusion_runtime.bench.gpu:run",
    "digits": "diffusion_runtime.bench.digits:run",
    "stage": "diffusion_runtime.bench.stage:run",
    "stage-transport": "diffusion_runtime.bench.stage_transport:run",
    "ipc": "diffusion_runtime.bench.ipc:run",
    "http": "diffusion_runtime.bench.http:run",
    "ray": "diffusion_runtime.bench.ray:run",
    "slo": "diffusion_runtime.bench.slo:run",
    "offload": "diffusion_runtime.bench.offload:run",
    "lora": "diffusion_runtime.bench.lora:run",
    "sleep": "diffusion_runtime.bench.sleep:run",
    "rl": "diffusion_runtime.bench.rl:run",
    "parallel": "diffusion_runtime.bench.parallel:run",
}

#: ``bench slo --family``: every policy on a family of generated traces.
SLO_FAMILY = "diffusion_runtime.bench.slo_family:run"
#: ``bench`` options, passed to the benchmarks whose ``run`` takes them.
BENCH_OPTIONS = ("requests", "steps", "traces", "real_traces", "rounds")


def cmd_bench(args: argparse.Namespace) -> int:
    from diffusion_runtime.pipelines.registry import import_object

    if args.family and args.name != "slo":
        raise CommandError("--family is an option of bench slo only")
    run = import_object(SLO_FAMILY if args.family else BENCHMARKS[args.name])
    options = {name: getattr(args, name) for name in BENCH_OPTIONS}
    options = {name: value for name, value in options.items() if value is not None}
    accepted = inspect.signature(run).parameters
    for name in options:
        if name not in accepted:
            what = f"bench {args.name}{' --family' if args.family else ''}"
            raise CommandError(f"{what} takes no --{name.replace('_', '-')}")
    result: dict[str, Any] = run(**options)
    print(json.dumps(result, indent=2))
    return 0


#: ``serve --enable-lora-updates``: adapters active at once when the engine has none set.
SERVE_MAX_LORAS = 4


def cmd_serve(args: argparse.Namespace) -> int:
    from diffusion_runtime.serving import ServerConfig, serve

    engine_config = attrs.evolve(
        _engine_config(args),
        max_waiting_requests=args.max_queue_len,
        streaming_output=args.stream_progress,
        # --stream-progress streams previews too, at EngineConfig's own interval.
        preview_interval=DEFAULT_PREVIEW_INTERVAL,
        intra_op_threads=args.intra_op_threads,
        request_batch_max_wait_ms=args.batch_wait_ms,
    )
    if args.enable_lora_updates and not engine_config.max_loras:
        engine_config = attrs.evolve(engine_config, max_loras=SERVE_MAX_LORAS)
    server_config = ServerConfig(
        model_name=args.model_name,
        per_client_limit=args.per_client_limit,
        admin_routes=args.admin_routes,
        lora_updates=args.enable_lora_updates,
    )
    serve(engine_config, server_config, host=args.host, port=args.port, access_log=args.access_log)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffusion-runtime", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help_text, formatter_class=HelpFormatter)

    generate = command("generate", "generate images and write PNGs")
    generate.add_argument("prompts", nargs="*", help="prompts (default: the ten digits)")
    _sampling_options(generate)
    generate.add_argument(
        "--seed", type=int, default=0, help="seed of the first prompt; prompt i gets seed + i"
    )
    generate.add_argument("--num-outputs", type=int, default=1, help="images per prompt")
    generate.add_argument(
        "--size",
        type=int,
        default=None,
        help="output size in pixels (default: 64 for digits, else the pipeline's own)",
    )
    generate.add_argument("--out", default="out", help="output directory")
    generate.add_argument(
        "--lora", metavar="NAME", default=None, help="a shipped digits adapter: bold or inverted"
    )
    generate.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="write a torch.profiler trace of the run per worker into DIR",
    )
    _engine_options(generate)
    generate.set_defaults(func=cmd_generate)

    evaluate = command("eval", "score samples with a digit classifier")
    evaluate.add_argument("--samples", type=int, default=20, help="samples per digit")
    _sampling_options(evaluate)
    evaluate.add_argument("--seed", type=int, default=0, help="seed of digit 0; digit d gets +d")
    evaluate.add_argument("--min-rate", type=float, default=0.9, help="exit 1 below this rate")
    _engine_options(evaluate)
    evaluate.set_defaults(func=cmd_eval)

    audit = command(
        "audit", "check a JSON-lines trace against the invariants, or rerun a failing example"
    )
    audit.add_argument("trace", nargs="?", help="a trace written with EngineConfig(trace_path=...)")
    audit.add_argument(
        "--replay",
        metavar="FILE",
        help="rerun the failing harness example of this replay file (the pytest plugin, "
        "lifecycle_test_case and hunt write one); exit 1 when it fails again",
    )
    audit.add_argument(
        "--trace",
        dest="trace_out",
        metavar="OUT.jsonl",
        help="with --replay: write the rerun's trace here",
    )
    audit.add_argument(
        "--perfetto",
        metavar="OUT.json",
        help="also write the trace as Chrome trace-event JSON (open it in ui.perfetto.dev)",
    )
    audit.add_argument(
        "--profile",
        metavar="DIR",
        help="with --perfetto: merge the workers' torch.profiler traces in DIR "
        "(start_profile/stop_profile) into it, on the trace's clock",
    )
    audit.set_defaults(func=cmd_audit)

    hunt = command("hunt", "run the harness against a catalogue mutation; it must fail")
    hunt.add_argument("name", nargs="?", help="the mutation (none: list the catalogue)")
    hunt.add_argument("--examples", type=int, default=500, help="examples at most")
    hunt.add_argument("--steps", type=int, default=20, help="rules per example")
    hunt.add_argument(
        "--replay-dir", default=".", help="where the failing example's replay file goes"
    )
    hunt.set_defaults(func=cmd_hunt)

    bench = command("bench", "run a benchmark and print JSON")
    bench.add_argument("name", choices=sorted(BENCHMARKS), help="the benchmark")
    bench.add_argument(
        "--requests", type=int, default=None, help="requests per round (benchmarks that take it)"
    )
    bench.add_argument(
        "--steps", type=int, default=None, help="denoising steps (benchmarks that take it)"
    )
    bench.add_argument(
        "--family",
        action="store_true",
        help="slo: every policy on a family of generated traces (virtual clock and real engine)",
    )
    bench.add_argument("--traces", type=int, default=None, help="--family: traces generated")
    bench.add_argument(
        "--real-traces", type=int, default=None, help="--family: traces served on the real engine"
    )
    bench.add_argument("--rounds", type=int, default=None, help="--family: real-engine rounds")
    bench.set_defaults(func=cmd_bench)

    serve = command("serve", "serve the OpenAI images API over HTTP")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free)")
    serve.add_argument("--model-name", default=None, help="model name (default: the pipeline)")
    serve.add_argument(
        "--admin-routes",
        action="store_true",
        help="add the operator's /admin routes: sleep, wake_up, profile (docs/operations.md)",
    )
    serve.add_argument(
        "--enable-lora-updates",
        action="store_true",
        help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter (docs/lora.md); "
        f"turns adapters on with {SERVE_MAX_LORAS} device slots",
    )
    serve.add_argument("--max-queue-len", type=int, default=256, help="waiting requests (429)")
    serve.add_argument(
        "--per-client-limit",
        type=int,
        default=None,
        help="in flight per client (default: no limit)",
    )
    serve.add_argument(
        "--stream-progress", action="store_true", help="step mode with progress for stream=true"
    )
    serve.add_argument(
        "--intra-op-threads", type=int, default=None, help="torch threads (default: torch's own)"
    )
    serve.add_argument(
        "--batch-wait-ms", type=float, default=0.0, help="wait this long for a fuller wave"
    )
    serve.add_argument("--access-log", action="store_true", help="log a line per request")
    _engine_options(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def _sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=25, help="denoising steps per image")
    parser.add_argument(
        "--guidance", type=float, default=1.0, help="classifier-free guidance scale (1: none)"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except (CommandError, ValueError, DiffusionRuntimeError) as exc:
        # Bad input or a failed start: one line, no traceback.
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
