"""Sequence parallelism for the DiT (Ulysses and Ring), docs/parallelism.md.

The split's arithmetic is checked first with the ranks as threads of this
process (their collectives trade tensors through shared slots at a barrier),
against the transformer's own forward; then over real mp worker processes in
a torch.distributed gloo group, against the engine with every degree at 1,
within float rounding (the largest difference is printed for the note).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from executor_helpers import drain

from diffusion_runtime import DiffusionEngine, EngineConfig, SamplingParams
from diffusion_runtime.core import EngineCore
from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.pipelines.diffusers import DiffusersPipeline
from diffusion_runtime.pipelines.diffusers.sequence_parallel import SequenceParallelDiT
from diffusion_runtime.pipelines.parallel import ParallelContext, ParallelLayout, SequenceContext
from diffusion_runtime.runner.parallel import check_parallel_degrees
from diffusion_runtime.stage import StageClient

#: The DiT's output for the same rows, split or whole, differs by float rounding only.
TOLERANCE = 1e-4


# -- the layout ------------------------------------------------------------------------


@pytest.mark.parametrize("cfg,ulysses,ring", list(itertools.product((1, 2), (1, 2, 3), (1, 2))))
def test_every_kind_of_group_partitions_the_world_by_position(
    cfg: int, ulysses: int, ring: int
) -> None:
    layout = ParallelLayout(cfg, ulysses, ring)
    world = list(range(layout.world_size))
    positions = [layout.position(rank) for rank in world]
    assert sorted(positions) == list(itertools.product(range(cfg), range(ring), range(ulysses)))
    kinds: dict[str, tuple[list[list[int]], Callable[[tuple[int, int, int]], object]]] = {
        # each group: the ranks that agree on everything but the split it runs
        "cfg": (layout.cfg_groups(), lambda p: p[1:]),
        "sequence": (layout.sequence_groups(), lambda p: p[0]),
        "ulysses": (layout.ulysses_groups(), lambda p: p[:2]),
        "ring": (layout.ring_groups(), lambda p: (p[0], p[2])),
    }
    for name, (groups, shared) in kinds.items():
        assert sorted(rank for group in groups for rank in group) == world, name
        for group in groups:
            assert len({shared(positions[rank]) for rank in group}) == 1, (name, group)
    for group in layout.sequence_groups():  # shard order: ring rank major, Ulysses minor
        shards = [positions[rank][1] * ulysses + positions[rank][2] for rank in group]
        assert shards == list(range(layout.sequence_size))
    for group in layout.ring_groups():
        assert [positions[rank][1] for rank in group] == list(range(ring))


# -- the arithmetic, ranks as threads --------------------------------------------------


class ThreadRanks:
    """Collectives for ``ulysses * ring`` ranks that are threads of this process:
    each posts its tensor in its slot, and all read once every rank has posted."""

    def __init__(self, ulysses: int, ring: int) -> None:
        self.layout = ParallelLayout(1, ulysses, ring)
        self.size = self.layout.world_size
        self.slots: list[torch.Tensor | None] = [None] * self.size
        self.barrier = threading.Barrier(self.size, timeout=60)

    def _trade(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        posted = [slot for slot in self.slots if slot is not None]
        self.barrier.wait()  # nobody posts the next one before all have read this one
        return posted

    def context(self, rank: int) -> SequenceContext:
        _, ring_rank, ulysses_rank = self.layout.position(rank)
        ulysses_group = next(g for g in self.layout.ulysses_groups() if rank in g)
        ring_group = next(g for g in self.layout.ring_groups() if rank in g)
        before = ring_group[(ring_group.index(rank) - 1) % len(ring_group)]

        def all_to_all(tensor: torch.Tensor) -> torch.Tensor:
            posted = self._trade(rank, tensor)
            mine = ulysses_group.index(rank)
            return torch.stack([posted[peer][mine] for peer in ulysses_group])

        def ring_shift(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
            received = self._trade(rank, tensor)[before]
            return lambda: received

        return SequenceContext(
            ulysses_rank=ulysses_rank,
            ulysses_size=self.layout.ulysses,
            ring_rank=ring_rank,
            ring_size=self.layout.ring,
            gather_tokens=lambda tensor: self._trade(rank, tensor),
            all_to_all=all_to_all,
            ring_shift=ring_shift,
        )

    def run(self, work: Callable[[int, SequenceContext], torch.Tensor]) -> list[torch.Tensor]:
        """``work(rank, context)`` on every rank at once; each rank's result."""
        results: list[torch.Tensor | None] = [None] * self.size
        errors: list[BaseException] = []

        def one(rank: int) -> None:
            try:
                results[rank] = work(rank, self.context(rank))
            except BaseException as exc:  # reported below, on the test's thread
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(rank,)) for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return [result for result in results if result is not None]


def dit_transformer(heads: int, latent: int) -> Any:
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    return DiTTransformer2DModel(
        num_attention_heads=heads,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        sample_size=latent,
        patch_size=2,
        norm_num_groups=4,
    ).eval()


@pytest.mark.parametrize(
    "heads,latent,ulysses,ring",
    [(2, 8, 2, 1), (4, 8, 4, 1), (2, 8, 1, 2), (2, 8, 1, 4), (4, 8, 2, 2), (2, 12, 2, 3)],
)
def test_every_rank_returns_the_whole_forward_within_rounding(
    heads: int, latent: int, ulysses: int, ring: int
) -> None:
    pytest.importorskip("diffusers")
    transformer = dit_transformer(heads, latent)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn((3, 4, latent, latent), generator=generator)
    t = torch.tensor([999, 500, 20])
    labels = torch.tensor([1, 7, 1000])
    with torch.no_grad():
        whole = transformer(x, timestep=t, class_labels=labels).sample
        copies = [copy.deepcopy(transformer) for _ in range(ulysses * ring)]

        def work(rank: int, context: SequenceContext) -> torch.Tensor:
            return SequenceParallelDiT(copies[rank], context).forward(x, t, labels)

        outputs = ThreadRanks(ulysses, ring).run(work)
    for output in outputs:
        assert output.shape == whole.shape
        assert (output - whole).abs().max().item() <= TOLERANCE
    assert all(torch.equal(output, outputs[0]) for output in outputs)  # ranks agree exactly


def test_the_transformer_called_whole_keeps_its_own_attention_bit_for_bit() -> None:
    """Outside the split forward (the first-block cache's calls) the swapped
    processors run the original one: the transformer gives the same bits."""
    pytest.importorskip("diffusers")
    transformer = dit_transformer(2, 8)
    x, t, labels = torch.randn((2, 4, 8, 8)), torch.tensor([10, 900]), torch.tensor([3, 1000])
    with torch.no_grad():
        before = transformer(x, timestep=t, class_labels=labels).sample
        SequenceParallelDiT(transformer, ThreadRanks(2, 1).context(0))
        after = transformer(x, timestep=t, class_labels=labels).sample
    assert torch.equal(before, after)


# -- refusals --------------------------------------------------------------------------


def _context(ulysses: int, ring: int) -> ParallelContext:
    sequence = ThreadRanks(ulysses, ring).context(0)
    return ParallelContext(0, 1, lambda tensor: [tensor], sequence)


@pytest.mark.parametrize(
    "ulysses,ring,field,rule",
    [
        (4, 1, "ulysses_degree", "must divide the DiT's 2 attention heads"),
        (1, 3, "ring_degree", "must divide the DiT's 16 image tokens"),
        (2, 3, "ring_degree", "must divide the DiT's 16 image tokens"),
    ],
)
def test_a_degree_the_dit_cannot_split_by_is_refused_by_field(
    models: Any, ulysses: int, ring: int, field: str, rule: str
) -> None:
    pipeline = DiffusersPipeline(models.dit_pipeline())
    with pytest.raises(InvalidFieldError) as refused:
        pipeline.enable_parallel(_context(ulysses, ring))
    assert refused.value.field == field and rule in str(refused.value)


def test_pipelines_without_a_sequence_split_refuse_the_degrees_by_field(
    models: Any, tmp_path: Any
) -> None:
    sd = DiffusersPipeline(models.stable_diffusion_pipeline(tmp_path))
    assert "cfg_parallel_size" in sd.parallel_degrees
    for field in ("ulysses_degree", "ring_degree"):
        config = EngineConfig(pipeline="digits", **{field: 2})
        with pytest.raises(InvalidFieldError) as refused:
            check_parallel_degrees(sd, config)
        assert refused.value.field == field and "the diffusers DiT family" in str(refused.value)


# -- real ranks ------------------------------------------------------------------------


class TokenProbe:
    """A worker extension: how many tokens this rank's DiT blocks have been given."""

    def __init__(self, worker: Any) -> None:
        self.tokens: set[int] = set()
        block = worker.pipeline.family.pipe.transformer.transformer_blocks[0]
        block.register_forward_pre_hook(lambda module, args: self.tokens.add(args[0].shape[1]))

    def take_tokens(self) -> list[int]:
        seen, self.tokens = sorted(self.tokens), set()
        return seen


@pytest.fixture(scope="module")
def dit_path(models: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("sequence-dit") / "dit"
    models.dit_pipeline().save_pretrained(path)
    return str(path)


def cores(dit_path: str, **degrees: Any) -> Iterator[tuple[EngineCore, EngineCore]]:
    """An mp core with ``degrees`` over the saved DiT, and its degree-1 reference."""
    base: dict[str, Any] = {
        "pipeline": "diffusers",
        "pipeline_kwargs": {"path": dit_path, "rows_per_call": 2},
        "device": "cpu",
        "warmup": False,
        "audit": "raise",
        "intra_op_threads": 1,
        "max_num_seqs": 4,
    }
    reference = EngineCore(EngineConfig(**base))
    try:
        split = EngineCore(
            EngineConfig(**base, **degrees, worker_start_timeout_s=120.0,
                         worker_extensions=(TokenProbe,))
        )  # fmt: skip
    except BaseException:
        reference.shutdown()
        raise
    try:
        yield split, reference
    finally:
        split.shutdown()
        reference.shutdown()


REQUESTS = {
    "guided": (1, SamplingParams(num_inference_steps=3, guidance_scale=3.0)),
    "plain-pair": (7, SamplingParams(num_inference_steps=4, num_outputs_per_prompt=2)),
    "guided-short": (3, SamplingParams(num_inference_steps=2, guidance_scale=1.5)),
}


def largest_difference(pair: tuple[EngineCore, EngineCore]) -> float:
    """Run :data:`REQUESTS` on both cores; the largest difference of any pixel."""
    outputs = []
    for core in pair:
        for seed, (rid, (prompt, params)) in enumerate(REQUESTS.items()):
            core.add_request(rid, prompt, params, seed=seed)
        finals = drain(core)
        outputs.append([finals[rid] for rid in REQUESTS])
        assert core.auditor is not None and core.auditor.violations == []
    largest = 0.0
    for have, want in zip(*outputs, strict=True):
        assert have.ok and want.ok, (have.error, want.error)
        assert have.image_batch is not None and want.image_batch is not None
        largest = max(largest, (have.image_batch - want.image_batch).abs().max().item())
    return largest


@pytest.mark.parametrize(
    "degrees,shard",
    [
        ({"ulysses_degree": 2, "execution_mode": "step"}, 8),
        # 4 ranks: two guidance branches, each split round a ring of two
        ({"cfg_parallel_size": 2, "ring_degree": 2, "execution_mode": "request"}, 8),
    ],
    ids=["ulysses-step", "cfg2-ring2-request"],
)
def test_split_ranks_serve_what_one_rank_does_within_rounding(
    dit_path: str, degrees: dict[str, Any], shard: int
) -> None:
    for pair in cores(dit_path, **degrees):
        largest = largest_difference(pair)
        print(f"{degrees}: largest difference from degree 1: {largest:.3g}")
        assert largest <= TOLERANCE
        seen = pair[0].executor.collective_rpc("take_tokens")
        assert seen == [[shard]] * len(seen) and len(seen) == pair[0].config.world_size


def test_the_stage_serves_ring_split_images_within_rounding(dit_path: str) -> None:
    """A stage process whose engine runs two ranks that pass keys and values round
    a ring, in step mode: its images are within rounding of one rank's."""
    config = EngineConfig(
        pipeline="diffusers", pipeline_kwargs={"path": dit_path}, device="cpu",
        warmup=False, execution_mode="step", intra_op_threads=1,
    )  # fmt: skip
    prompts = [3, 8]
    params = [SamplingParams(num_inference_steps=3, guidance_scale=2.0, seed=i) for i in (1, 2)]

    async def on_the_stage() -> list[RequestOutput]:
        staged = attrs.evolve(config, ring_degree=2, num_workers=2, worker_start_timeout_s=120.0)
        async with StageClient(staged) as client:
            return await client.generate(prompts, params)

    outputs = asyncio.run(on_the_stage())
    with DiffusionEngine.make_engine(config) as one:
        expected = one.generate(prompts, params)
    for got, want in zip(outputs, expected, strict=True):
        assert got.ok and want.ok, (got.error, want.error)
        assert (got.image_batch - want.image_batch).abs().max().item() <= TOLERANCE
