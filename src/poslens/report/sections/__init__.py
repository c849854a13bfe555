"""The sections of `poslens reproduce`. Each module registers one section with `@poslens.report.section.section`;
importing this package registers them all, in the order of the imports below, which is the report's order (add a
new module here)."""
# ruff: noqa: I001  (the order of the imports is the order of the report)

from poslens.report.sections import closed_forms  # noqa: F401
from poslens.report.sections import nope  # noqa: F401
from poslens.report.sections import rope  # noqa: F401
from poslens.report.sections import convergence  # noqa: F401
from poslens.report.sections import real_model  # noqa: F401
from poslens.report.sections import trained  # noqa: F401
from poslens.report.sections import leakage  # noqa: F401
from poslens.report.sections import length  # noqa: F401
