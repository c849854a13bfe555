"""`poslens card MODEL [MODEL ...]`: where a model's positional information can be seen, per layer, on one page.

`run.py` runs each analysis through its own run function into a sub-run directory of the card's --out and
`page.py` reads those run directories (nothing is measured in the card's own code) into card.md and card.html;
`probe.py` is the residual-stream probe of absolute position as a registered statistic (`poslens stat
position_probe`), so that panel has a command of its own too (docs/card.md).
"""
