"""Benchmark: the report's Section 4.2 (trained NoPE and RoPE models), this tree against an earlier one, side by side.

Before issue 35 the section ran `poslens intermediates` on each seed's NoPE model and then ran the `Intermediates`
statistic a second time over the same batches, by hand, for four panel statistics the run did not write; now the
run's summary holds them and the section only reads the run directories. Both trees build the section
(`poslens.report.sections.trained`: the intermediates runs, the held-out losses, the probes, the rows) in a child
process each, on the same sweep models read from one model cache (trained first if missing, not timed), into a
fresh parts directory (nothing reused), the order alternating over repeats (`length_section.side_by_side`).
Reported per build: wall and CPU seconds of the child; the rows both trees have must give the same verdicts and key
numbers.

The default setting is small: the tests' tiny sweep shape (2 layers, L = 32) trained 6 steps, 3 seeds, Figure 3 on
200 held-out sequences of 30 tokens per seed (the quick run: 200 of 50), 64 blocks for the held-out losses, 32 + 32
for the probe.

    POSLENS_CACHE=/tmp/bench-cache .venv/bin/python benchmarks/trained_section.py --release a58c6d4 \
        --json benchmarks/results/trained_section.json
"""

from __future__ import annotations

from length_section import main

SIZES = {"sweep_train": "steps=6+warmup=2+layers=2+seq_len=32+eval_every=3+save_every=0", "sweep_seeds": [0, 1, 2],
         "fig3": [200, 30], "loss": 64, "probe": [32, 32]}

if __name__ == "__main__":
    main("trained", SIZES, "a58c6d4", __doc__)
