"""Benchmarks behind ``rlnb bench``: each compares against a floor measured in the same run."""

from rlnb.bench._common import BenchResult, Target

__all__ = ["BenchResult", "Target"]
