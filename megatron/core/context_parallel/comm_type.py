"""`cp_comm_type`: how attention communicates across the context-parallel ranks (Megatron-LM's
values)."""

from __future__ import annotations

import enum


class CPCommType(enum.Enum):
    """The context-parallel attention a layer runs (`--cp-comm-type`).

    - `p2p`: ring attention, keys and values passed rank to rank, overlapped with attention
      (`ring_attention`).
    - `a2a`: all-to-all from the sequence split to a head split and back (`all_to_all_attention`;
      the heads per tensor-parallel rank must divide by the cp size).
    - `allgather`: keys and values all-gathered (`all_gather_attention`).

    Megatron-LM's `a2a+p2p` (hierarchical: a2a inside groups of
    `--hierarchical-context-parallel-sizes`, p2p across them) is not built.
    """

    p2p = "p2p"
    a2a = "a2a"
    allgather = "allgather"

    @classmethod
    def parse(cls, value: str | CPCommType) -> CPCommType:
        """The comm type named `value`.

        Raises:
            ValueError: an unknown name, or `a2a+p2p` (not built).
        """
        if isinstance(value, cls):
            return value
        if value == "a2a+p2p":
            raise ValueError(
                "cp_comm_type a2a+p2p (hierarchical context parallelism, with "
                "--hierarchical-context-parallel-sizes) is not built; use p2p, a2a or allgather."
            )
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"cp_comm_type must be one of {[t.value for t in cls]}, got {value!r}."
            ) from None
