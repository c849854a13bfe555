"""The passes of a `poslens length` run as data: each a record (which model, which intervention, at which length,
with which rotary factor) and the statistics it feeds, by name.

    for p in plan_passes(cfg):                     # cfg: a settled LengthConfig
        p.model, p.intervention, p.length, p.factor, p.per_length

* `none` at the longest length T, per model;
* `logn`, `logn-all`, `window[:W]`, `sink-window[:W]`, `freeze`, and `ntk:F` / `yarn:F` (a factor given) at T;
* `ntk` and `yarn` without a factor once per evaluation length T' > L (or at T only, `scaled_at="longest"`), on the
  first T' tokens, with factor T' / L (`per_length`: its effect is read at T' alone).

Every pass feeds a `PositionLoss`; `none` and the interventions that change the softmax's denominator or the keys
it sums over also an `AttentionProfile`; `none` also the maps (`LengthMaps`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from poslens.analyses.length.attention import AttentionProfile
from poslens.analyses.length.interventions import AlibiScaling, Freeze, Intervention, RopeScaling, parse
from poslens.analyses.length.loss import PositionLoss
from poslens.analyses.length.maps import LengthMaps
from poslens.engine.stats import Statistic

PROFILED = ("logn", "logn-all", "window", "sink-window")  # interventions whose passes also read the attention
# profile (besides none): they change the softmax's denominator or the keys it sums over; the others are measured
# by their loss


@dataclass(frozen=True)
class LengthPass:
    """One pass: model `model` (0: the evaluated one, k: the k-th seed model) under `intervention` (its spec as
    given, or "none") on the first `length` tokens of every sequence; `factor`: ntk's or yarn's factor; `per_length`:
    the factor is `length` / L, one pass per evaluation length."""

    model: int
    intervention: str
    length: int
    factor: float | None = None
    per_length: bool = False

    @property
    def plain(self) -> bool:
        """The model as it is (the pass every effect is paired against)."""
        return self.intervention == "none"

    def name(self, models: int) -> str:
        """The pass's name in progress bars and the checkpoint: `mK/` with several models, `@length` per length."""
        tag = f"m{self.model}/" if models > 1 else ""
        return f"{tag}{self.intervention}" + (f"@{self.length}" if self.per_length else "")

    def effect_lengths(self, lengths: list[int]) -> list[int]:
        """The evaluation lengths among `lengths` whose effect this pass measures: every one it covers, or its own
        alone when its factor follows the length."""
        return [t for t in lengths if t <= self.length and (not self.per_length or t == self.length)]

    def built(self, train_len: int, first_token: int) -> Intervention:
        """The intervention this pass applies: its factor fixed, freeze's reference token the run's first token
        (the same on every rank)."""
        iv = parse(self.intervention, train_len)
        if isinstance(iv, (RopeScaling, AlibiScaling)):
            return replace(iv, factor=self.factor)
        if isinstance(iv, Freeze):
            iv.token = first_token
        return iv


@dataclass
class LengthStatistics:
    """The statistics one pass feeds, by name."""

    loss: PositionLoss
    profile: AttentionProfile | None = None
    maps: LengthMaps | None = None

    def listed(self) -> list[Statistic]:
        """Those present, in the order the pass runs their readers."""
        return [s for s in (self.loss, self.profile, self.maps) if s is not None]


def edges_of(train_len: int, lens: list[int]) -> list[int]:
    """Bucket edges: [1, L), then [previous, T) for each evaluation length T above L."""
    return [1, train_len] + [t for t in lens if t > train_len]


def plan_passes(cfg) -> list[LengthPass]:
    """Every pass of a settled `LengthConfig` (interventions chosen, eval_lens and seq_len set), model-major."""
    L, lens, T = cfg.train_len, cfg.eval_lens, cfg.seq_len
    out: list[LengthPass] = []
    for k in range(1 + len(cfg.seed_models)):
        out.append(LengthPass(k, "none", T))
        for spec in cfg.interventions:
            iv = parse(spec, L)
            if not isinstance(iv, (RopeScaling, AlibiScaling)):
                out.append(LengthPass(k, spec, T))
            elif iv.factor is not None:
                out.append(LengthPass(k, spec, T, iv.factor))
            else:  # a factor of the length: T'/L (RoPE's frequencies), L/T' (ALiBi's slopes)
                each = [t for t in lens if t > L] if cfg.scaled_at == "each" else [T]
                out += [LengthPass(k, spec, t, t / L if isinstance(iv, RopeScaling) else L / t, per_length=True)
                        for t in each]
    return out


def statistics_for(p: LengthPass, cfg, model, groups: int) -> LengthStatistics:
    """The statistics pass `p` feeds (module docstring), in `groups` groups: the loss in the buckets up to its
    length, the attention profile, and, for none with `cfg.maps`, the maps of `model`."""
    lens = [t for t in cfg.eval_lens if t <= p.length] or [p.length]
    profiled = p.plain or (cfg.intervention_profiles and p.intervention.partition(":")[0] in PROFILED)
    return LengthStatistics(
        PositionLoss(edges_of(cfg.train_len, lens), groups),
        AttentionProfile(groups=groups, every=cfg.profile_every) if profiled else None,
        LengthMaps(model, cfg.map_layers, groups=groups, probs=False, lengths=lens) if p.plain and cfg.maps else None)
