"""Which decoder layers each pipeline stage builds: Megatron-LM's split, as a pure function.

The layers are cut into `pipeline_model_parallel_size` x `virtual_pipeline_model_parallel_size`
model chunks. Rank r's virtual stage v is chunk v * P + r in the model's order, so a microbatch
runs chunk 0 on every rank in turn, then chunk 1, and so on (Megatron-LM's interleaving). With
8 layers, P = 2 and V = 2::

    rank 0: layers [0, 1] (virtual stage 0), [4, 5] (virtual stage 1)
    rank 1: layers [2, 3],                   [6, 7]

Every rank holds the same number of layers (`num_layers / P`, split evenly over its V chunks),
except that `num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage` (the
`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers` flags) fix the
first and last rank's count and the others share the rest evenly. With
`account_for_embedding_in_pipeline_split` (`account_for_loss_in_pipeline_split`) the embedding
(the output layer and loss) counts as one layer of the first (last) chunk, which builds one
transformer layer fewer. Layer numbers stay global: a chunk's layers know their place in the
whole model (`TransformerLayer.layer_number`).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PipelineSplit:
    """How `num_layers` decoder layers are cut into pipeline chunks.

    Attributes:
        num_layers: decoder layers of the whole model.
        pipeline_model_parallel_size: pipeline ranks P.
        virtual_pipeline_model_parallel_size: chunks per rank V (None: one).
        num_layers_in_first_pipeline_stage: rank 0's layers (None: the even share).
        num_layers_in_last_pipeline_stage: rank P-1's layers (None: the even share).
        account_for_embedding_in_pipeline_split: the embedding takes a layer's place in the
            first chunk.
        account_for_loss_in_pipeline_split: the loss takes a layer's place in the last chunk.
    """

    num_layers: int
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    @property
    def num_chunks(self) -> int:
        """Chunks per rank (V, 1 without virtual stages)."""
        return self.virtual_pipeline_model_parallel_size or 1

    def check(self) -> None:
        """Raises `ValueError` naming the flags whose values do not split the layers."""
        chunk_counts(self)

    def layers(self, pp_rank: int, vp_stage: int | None = None) -> range:
        """The 0-based global indices of the layers rank `pp_rank`'s virtual stage `vp_stage`
        (None: 0) builds."""
        counts = chunk_counts(self)
        stage = vp_stage or 0
        pp_size = self.pipeline_model_parallel_size
        if not (0 <= pp_rank < pp_size and 0 <= stage < self.num_chunks):
            raise ValueError(
                f"pp_rank={pp_rank}, vp_stage={vp_stage} is outside the pipeline of {pp_size} "
                f"rank(s) x {self.num_chunks} virtual stage(s)."
            )
        start = sum(counts[r][v] for v in range(stage) for r in range(pp_size))
        start += sum(counts[r][stage] for r in range(pp_rank))
        return range(start, start + counts[pp_rank][stage])


def chunk_counts(split: PipelineSplit) -> list[list[int]]:
    """`counts[r][v]`: the transformer layers of rank r's virtual stage v.

    Raises:
        ValueError: the layers do not split as asked (the message names the flags).
    """
    pp_size, vp_size = split.pipeline_model_parallel_size, split.num_chunks
    first, last = split.num_layers_in_first_pipeline_stage, split.num_layers_in_last_pipeline_stage
    if pp_size < 1 or vp_size < 1:
        raise ValueError(
            f"--pipeline-model-parallel-size ({pp_size}) and the virtual stages per rank "
            f"({vp_size}) must be >= 1."
        )
    uneven = first is not None or last is not None
    accounted = split.account_for_embedding_in_pipeline_split or (
        split.account_for_loss_in_pipeline_split
    )
    if uneven and pp_size == 1:
        raise ValueError(
            "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers need "
            "--pipeline-model-parallel-size > 1; drop them."
        )
    if uneven and accounted:
        raise ValueError(
            "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers cannot be "
            "combined with --account-for-embedding-in-pipeline-split / "
            "--account-for-loss-in-pipeline-split (as Megatron-LM); choose one way to balance "
            "the stages."
        )
    if uneven:
        per_rank = _uneven_per_rank(split.num_layers, pp_size, first, last)
    else:
        slots = split.num_layers + split.account_for_embedding_in_pipeline_split
        slots += split.account_for_loss_in_pipeline_split
        if slots % pp_size:
            what = f" (+ the embedding and loss counted as layers = {slots})" if accounted else ""
            raise ValueError(
                f"--num-layers {split.num_layers}{what} is not divisible by "
                f"--pipeline-model-parallel-size {pp_size}; choose a divisor, or set "
                "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers."
            )
        per_rank = [slots // pp_size] * pp_size
    for rank, count in enumerate(per_rank):
        if count % vp_size:
            raise ValueError(
                f"pipeline rank {rank} holds {count} layer(s), not divisible by its {vp_size} "
                "virtual stages; change --num-layers-per-virtual-pipeline-stage / "
                "--num-virtual-stages-per-pipeline-rank or the split."
            )
    counts = [[count // vp_size] * vp_size for count in per_rank]
    if split.account_for_embedding_in_pipeline_split:
        counts[0][0] -= 1
    if split.account_for_loss_in_pipeline_split:
        counts[-1][-1] -= 1
    if any(count < 0 for row in counts for count in row):
        raise ValueError(
            "A pipeline chunk holds no layer to make room for the embedding or the loss; raise "
            "--num-layers or drop --account-for-embedding-in-pipeline-split / "
            "--account-for-loss-in-pipeline-split."
        )
    if sum(map(sum, counts)) != split.num_layers:  # an internal invariant of the arithmetic
        raise AssertionError(f"pipeline split {counts} does not hold {split.num_layers} layers")
    return counts


def _uneven_per_rank(
    num_layers: int, pp_size: int, first: int | None, last: int | None
) -> list[int]:
    for flag, value in (
        ("--decoder-first-pipeline-num-layers", first),
        ("--decoder-last-pipeline-num-layers", last),
    ):
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}.")
    rest = num_layers - (first or 0) - (last or 0)
    middle = pp_size - (first is not None) - (last is not None)
    if rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and rest % middle):
        raise ValueError(
            f"--num-layers {num_layers} minus --decoder-first-pipeline-num-layers ({first}) and "
            f"--decoder-last-pipeline-num-layers ({last}) leaves {rest} layer(s) for the other "
            f"{middle} pipeline rank(s), which must split them evenly; adjust the counts."
        )
    share = rest // middle if middle else 0
    per_rank = [share] * pp_size
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    return per_rank


def pipeline_split(config) -> PipelineSplit:
    """The split a `TransformerConfig` describes (its pipeline fields, Megatron-core's names)."""
    return PipelineSplit(
        num_layers=config.num_layers,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=config.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=config.num_layers_in_last_pipeline_stage,
        account_for_embedding_in_pipeline_split=config.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=config.account_for_loss_in_pipeline_split,
    )
