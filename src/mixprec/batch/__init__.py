"""A whole model zoo in one call: :func:`batch` (engines: a local process pool, Ray)."""

from mixprec.batch.results import BatchResult
from mixprec.batch.run import batch

__all__ = ["BatchResult", "batch"]
