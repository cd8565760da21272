"""`ftjax launch`: a fault-tolerant job on this machine (coordinator + replicas), supervised."""

from ftjax.launch.cli import main
from ftjax.launch.job import LocalJob

__all__ = ["LocalJob", "main"]
