"""Past the training length (issue 18): statistics and interventions for evaluating a model trained at length L at
L, 2L, 4L, 8L (docs/length.md).

Statistics (poslens.engine.stats.Statistic, grouped sums with jackknife intervals): `PositionLoss` (next-token loss
by position and bucket), `AttentionProfile` (attention entropy against log(i + 1), share on key 0); `LengthMaps`
(Capture's averaged maps and the leakage metrics at a length). Interventions (`parse`): none, logn, logn-all,
ntk[:F], yarn[:F], window[:W], sink-window[:W], freeze, each applied in `run_pass`. The passes of `poslens
length` as records (`LengthPass`, `plan_passes`) with their statistics by name (`LengthStatistics`). Contrasts:
`paired_difference`, `over_seeds`, `seed_summary`, `seed_paired`. Up-front checks: `check_eval_length`,
`check_eval_memory`, `length_notes`.
"""

from poslens.analyses.length.attention import AttentionProfile
from poslens.analyses.length.checks import (
    check_eval_length,
    check_eval_memory,
    length_notes,
    memory_estimate,
)
from poslens.analyses.length.compare import over_seeds, paired_difference, seed_paired, seed_summary
from poslens.analyses.length.interventions import Intervention, parse
from poslens.analyses.length.loss import PositionLoss, doubling_edges
from poslens.analyses.length.maps import LengthMaps
from poslens.analyses.length.passes import run_pass
from poslens.analyses.length.plan import LengthPass, LengthStatistics, plan_passes
from poslens.engine.models import position_table

__all__ = ["AttentionProfile", "Intervention", "LengthMaps", "LengthPass", "LengthStatistics", "PositionLoss",
           "check_eval_length", "check_eval_memory", "doubling_edges", "length_notes", "memory_estimate",
           "over_seeds", "paired_difference", "parse", "plan_passes", "position_table", "run_pass", "seed_paired",
           "seed_summary"]
