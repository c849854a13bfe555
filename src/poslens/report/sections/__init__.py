"""The sections of `poslens reproduce`, one module each. Each module registers one section with
`@poslens.report.section.section`; `poslens.report.section.SECTIONS` lists them in report order (add a new module
there). This package imports nothing, so a section module importing a sibling (`figures`, `measures`) makes no
import cycle."""
