"""The FP8 tests' fixtures."""

from tests.unit_tests.fp8.reference import scaled_mm_without_onednn

__all__ = ["scaled_mm_without_onednn"]
