"""What one call costs: stock Dynamo's guards against dynamo-once's dispatch (``models.overhead``).

Usage: ``python -m benchmarks.guard_overhead [--device cuda] [--layers 1,4,16,64] --out benchmarks/results``
(without ``--out`` the table is printed only); ``dynamo-once overhead`` is the same measurement.
"""

from __future__ import annotations

from models.overhead import HIDDEN, MECHANISMS, measure, run  # noqa: F401  (the benchmark's API)
from models.overhead import main as _main


def main(argv: list[str] | None = None) -> None:
    _main(argv, default_out=None)


if __name__ == "__main__":
    main()
