"""The global batch size of each iteration: constant, or a step schedule over consumed samples.

Megatron-LM's `--step-batch-size-schedule "THRESHOLD:BS ..."` switches the global batch size to
BS once THRESHOLD samples have been consumed (thresholds in tokens when a sequence length is
given, as Megatron-LM's training loop always gives it: tokens // seq_length samples; suffixes
K, M, B, T). The older `--rampup-batch-size START INCR SAMPLES` grows the batch from START by
INCR in equal sample intervals to `--global-batch-size` over SAMPLES samples; it is one such step
schedule (`rampup_schedule`). Megatron-LM keeps one global calculator; here `BatchSizeSchedule` is
a value the training loop asks: `global_batch_size(consumed_samples)`.
"""

from __future__ import annotations

import dataclasses

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _parse_number(text: str) -> int:
    text = text.strip().upper()
    multiplier = _SUFFIXES.get(text[-1:], 1)
    if multiplier != 1:
        text = text[:-1]
    return int(float(text) * multiplier)


@dataclasses.dataclass(frozen=True)
class BatchSizeSchedule:
    """Global batch size by consumed samples.

    Attributes:
        steps: (first consumed sample, global batch size) pairs, thresholds strictly increasing
            from 0.
    """

    steps: tuple[tuple[int, int], ...]

    def __post_init__(self):
        if not self.steps or self.steps[0][0] != 0:
            raise ValueError(f"A batch-size schedule must start at threshold 0, got {self.steps}.")
        thresholds = [threshold for threshold, _ in self.steps]
        if thresholds != sorted(set(thresholds)):
            raise ValueError(f"Schedule thresholds must strictly increase, got {thresholds}.")
        if any(batch < 1 for _, batch in self.steps):
            raise ValueError(f"Schedule batch sizes must be >= 1, got {self.steps}.")

    @classmethod
    def constant(cls, global_batch_size: int) -> BatchSizeSchedule:
        """The same batch size throughout."""
        return cls(((0, global_batch_size),))

    @classmethod
    def parse(cls, schedule: str, seq_length: int | None) -> BatchSizeSchedule:
        """Parses `--step-batch-size-schedule` ("THRESHOLD:BS THRESHOLD:BS ...", commas allowed).

        Args:
            schedule: the flag's value.
            seq_length: thresholds are tokens, converted to samples (// seq_length); None:
                thresholds are samples.

        Raises:
            ValueError: an entry is not THRESHOLD:BS, or the schedule is inconsistent.
        """
        steps = []
        for entry in schedule.replace(",", " ").split():
            threshold, sep, batch = entry.partition(":")
            if not sep:
                raise ValueError(f"Schedule entry {entry!r} is not THRESHOLD:BATCH_SIZE.")
            samples = _parse_number(threshold)
            if seq_length is not None:
                samples //= seq_length
            steps.append((samples, _parse_number(batch)))
        return cls(tuple(sorted(steps)))

    @property
    def final_global_batch_size(self) -> int:
        """The batch size after the last threshold (Megatron-LM's `global_batch_size`)."""
        return self.steps[-1][1]

    def global_batch_size(self, consumed_samples: int) -> int:
        """The global batch size of the iteration that starts after `consumed_samples`."""
        batch = self.steps[0][1]
        for threshold, size in self.steps:
            if consumed_samples < threshold:
                break
            batch = size
        return batch

    def iterations_for(self, train_samples: int) -> int:
        """Iterations until `train_samples` are consumed (the last may pass it), as Megatron-LM
        counts them for sample-based training with a schedule."""
        if len(self.steps) == 1:
            return train_samples // self.steps[0][1]
        iterations = consumed = 0
        while consumed < train_samples:
            consumed += self.global_batch_size(consumed)
            iterations += 1
        return iterations

    def sizes_within(self, iterations: int) -> list[tuple[int, int]]:
        """The global batch sizes the first `iterations` iterations use, as (consumed samples
        when the size starts, size) pairs in order: one pass over the steps, not over the
        iterations."""
        used: list[tuple[int, int]] = []
        consumed = 0
        while iterations > 0:
            size = self.global_batch_size(consumed)
            if not used or used[-1][1] != size:
                used.append((consumed, size))
            later = [threshold for threshold, _ in self.steps if threshold > consumed]
            if not later:
                break
            # Iterations at this size until the next threshold is reached (or passed).
            run = min(iterations, -(-(later[0] - consumed) // size))
            consumed += run * size
            iterations -= run
        return used

    def samples_after(self, consumed_samples: int, iterations: int) -> int:
        """Consumed samples after `iterations` more iterations from `consumed_samples`."""
        if len(self.steps) == 1:
            return consumed_samples + iterations * self.steps[0][1]
        for _ in range(iterations):
            consumed_samples += self.global_batch_size(consumed_samples)
        return consumed_samples


def rampup_schedule(
    start_batch_size: int, batch_size_increment: int, rampup_samples: int, global_batch_size: int
) -> BatchSizeSchedule:
    """`--rampup-batch-size START INCR SAMPLES` as a step schedule (Megatron-LM's former
    `RampupBatchsizeNumMicroBatches`: the batch after `consumed` samples is
    START + INCR x floor(consumed / (SAMPLES / increments)), then `global_batch_size`).

    Raises:
        ValueError: START is not below `global_batch_size`, INCR does not divide the difference,
            or SAMPLES is negative.
    """
    difference = global_batch_size - start_batch_size
    if start_batch_size < 1 or batch_size_increment < 1 or rampup_samples < 0:
        raise ValueError(
            f"--rampup-batch-size {start_batch_size} {batch_size_increment} {rampup_samples}: "
            "the start batch size and the increment must be >= 1 and the samples >= 0."
        )
    if difference <= 0 or difference % batch_size_increment:
        raise ValueError(
            f"--rampup-batch-size {start_batch_size} {batch_size_increment} {rampup_samples}: "
            f"--global-batch-size {global_batch_size} minus the start batch size must be a "
            "positive multiple of the increment; change one of them."
        )
    increments = difference // batch_size_increment
    steps = [(0, start_batch_size)]
    for k in range(1, increments + 1):
        # Increment k starts at the first consumed count with consumed / (SAMPLES / increments)
        # >= k, in integers: ceil(k x SAMPLES / increments).
        threshold = -(-k * rampup_samples // increments)
        batch = start_batch_size + k * batch_size_increment
        if threshold <= steps[-1][0]:  # SAMPLES < increments: several steps at once
            steps[-1] = (steps[-1][0], batch)
        else:
            steps.append((threshold, batch))
    return BatchSizeSchedule(tuple(steps))
