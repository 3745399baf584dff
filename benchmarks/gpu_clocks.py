"""The GPU's SM clock and power draw while a benchmark's kernels run, read through NVML.

Two configurations timed in turn can differ by a percent in kernels they both run (the fp8 8B's batch-128 step:
the same cuBLAS GEMMs and attention kernel ~1% slower in the custom-op graph), as a lower SM clock would make them:
a denser schedule can draw more power and lose clock under the board's power limit. A :class:`ClockSampler`
reads the clock and the power while the timed calls are in flight (after a launch, before its sync), so each row
of an interleaved run can say at what clock it ran. NVML reports each over its last sample period (1/6 s to 1 s,
by product), so a row's figures are the medians over its calls. Needs ``pynvml`` (the ``nvidia-ml-py`` package),
which ``torch.cuda.clock_rate`` and ``torch.cuda.power_draw`` use.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import torch

__all__ = ["ClockSampler", "nvml_available"]

logger = logging.getLogger(__name__)


def nvml_available() -> bool:
    """Whether NVML can be read here: a CUDA device and the ``pynvml`` module."""
    if not torch.cuda.is_available():
        return False
    try:
        import pynvml  # noqa: F401
    except ImportError:
        return False
    return True


def _read_nvml(device: torch.device) -> tuple[float, float]:
    return float(torch.cuda.clock_rate(device)), torch.cuda.power_draw(device) / 1e3  # MHz, W (NVML gives mW)


class ClockSampler:
    """Samples of (SM MHz, W), taken by :meth:`sample`; ``read`` is the reading (NVML's by default)."""

    def __init__(self, device: torch.device, read: Callable[[torch.device], tuple[float, float]] = _read_nvml):
        self.device = device
        self.read: Callable[[torch.device], tuple[float, float]] | None = read
        self.samples: list[tuple[float, float]] = []

    def sample(self) -> None:
        """One reading; after a failed one (NVML without that counter on this GPU) none more: the row then gives
        no figure rather than the run stopping over a diagnostic."""
        if self.read is None:
            return
        try:
            self.samples.append(self.read(self.device))
        except Exception as e:  # pynvml raises its own NVMLError_* classes
            logger.warning("GPU clock sampling stopped: %s", e)
            self.read = None

    def medians(self) -> dict[str, float]:
        """``sm_mhz`` and ``power_w``: the medians of the samples; empty without samples."""
        if not self.samples:
            return {}
        return dict(sm_mhz=round(statistics.median(s[0] for s in self.samples)),
                    power_w=round(statistics.median(s[1] for s in self.samples), 1))
