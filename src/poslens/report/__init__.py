"""Figures and reports: one plotting module, report rendering, and `poslens reproduce`."""
