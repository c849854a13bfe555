"""Benchmark: the hook engine on each family added after Llama, every point read, against a plain forward (run by hand).

Per family, a random model of the family's tiny test config (tests/tiny_models.py) widened to `--hidden` with
`--layers` layers (heads of 64 dimensions; the same shape for Llama, the baseline family the engine was tuned on) and
the tiny configs' 256-token vocabulary, so that no LM head dilutes the ratio (`--vocab N`: a released model's, its LM
head in both forwards); the same token ids for every method. Methods, interleaved (the order rotates every repeat),
each timed in CPU seconds of this process (`time.process_time`: the machine is shared, wall time would measure the
neighbours):

* plain: `model(ids)` with SDPA and logits (the baseline of the ratio; BLOOM, GPT-Neo: their eager attention, the
         only one transformers has for them);
* read:  `HookedModel.run(ids, hooks=..., logits=True)` with a reader at every point, the LM head's two included (a
         hook that takes the value and keeps nothing, as a statistic that reduces it);
* read_default: the same without TransformerLens's optional points (the per-head inputs `hook_attn_in`,
         `hook_q_input`, ..., each a copy of the residual stream per head; `attn.hook_result`, each head's output
         after W_O; `hook_mlp_in`), the points TransformerLens's run_with_cache reads by default.

Reported: the minor page faults of each call (fresh pages the kernel zeroed; `HookedModel` asks glibc to keep freed
memory, `poslens.engine.allocator`, so after the warm-up both arms should fault few), the median of each over
`--repeats` after a warm-up, read / plain (issue #36's bar: at most 1.1), and the
geometric mean of the paired ratios (each repeat's read over the plain forward of the same round) with its 95%
t-interval over the repeats (`paired_read`, `paired_read_default`: [mean, low, high]); `--arms read` times only
the plain forward and every point read (more repeats in the same time). The
logits of both are checked first: which forward the read one equals bit for bit (a read pattern makes attention's
output pattern @ v, as eager attention computes it; read per-head results make W_O's output their sum, as
TransformerLens computes it), or, where it equals neither, that they are within 1e-5 of each other (`same_logits`).

Each family also gets a line on the noise of its rounds (the plain forward's least, median and most CPU seconds, and
read / plain at the two arms' lower quartiles beside the medians' ratio): on the shared 2-core machine the same
forward's CPU time moves by +-15% from round to round, and the ratio at the fastest quarter of the rounds has sat
below the medians' (BENCHMARKS.md). It describes the noise; the bar is judged on the paired interval. `--from JSON`
prints the lines of a saved result without measuring.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/families.py --repeats 7 \\
        --out benchmarks/results/cpu-hooks/families.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import MOE, build, heads_summed_twin, token_batch  # noqa: E402
from train import ratio_interval  # noqa: E402 (benchmarks/train.py)

from poslens.engine.hooks import OPTIONAL, HookedModel  # noqa: E402

FAMILIES = ("llama", "olmo2", "gpt2", "opt", "bloom", "gpt_neox", "gptj", "phi", "falcon", "falcon_rw", "gpt_neo",
            "olmo", "stablelm", "mpt", "gpt_bigcode", "starcoder2", "cohere2", "falcon_new", "mixtral", "olmoe")


def model_of(family: str, hidden: int, layers: int, vocab: int | None = None):
    """A random model of `family`'s tiny test config at `hidden` wide (heads of 64) with `layers` layers; `vocab`: a
    released model's vocabulary, its LM head in the forward (default: the tiny configs' 256 tokens)."""
    heads = hidden // 64
    size = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads}
    if vocab:
        size["vocab_size"] = vocab
    if family in ("gpt2", "gpt_bigcode"):  # no head_dim field; MLP 4 x hidden by default (GPT-BigCode: multi-query,
        # as StarCoder)
        return build(family, **size, max_position_embeddings=1024)
    if family in ("gpt_neox", "gptj"):  # no key/value groups, no head_dim field; GPT-J: a quarter of each head turns
        sizes = {"gptj": {"rotary_dim": 16}, "gpt_neox": {"intermediate_size": 4 * hidden}}[family]
        return build(family, **size, **sizes)
    if family in ("bloom", "mpt"):  # no key/value groups, no head_dim field; MLP 4 x hidden (MPT: mpt-7b's
        # max_seq_len of 2048)
        return build(family, **size, **({"max_seq_len": 2048} if family == "mpt" else {}))
    if family in ("falcon", "falcon_rw", "falcon_new"):  # falcon-7b's multi-query parallel form, falcon-rw's ALiBi,
        # falcon-40b's grouped key/value heads (2 groups); MLP 4 x hidden
        return build(family, **size, ffn_hidden_size=4 * hidden)
    if family == "gpt_neo":  # gpt-neo-125m's layers: global and local alternating, a window of 256; MLP 4 x hidden
        return build(family, hidden_size=hidden, num_layers=layers, num_heads=heads, window_size=256,
                     attention_types=[[["global", "local"], layers // 2], *([[["global"], 1]] if layers % 2 else [])],
                     max_position_embeddings=2048, **({"vocab_size": vocab} if vocab else {}))
    if family == "opt":  # no key/value groups, no head_dim field; fc1 of ffn_dim
        return build(family, **size, ffn_dim=4 * hidden, max_position_embeddings=1024)
    kv = {"olmo2": heads, "phi": heads, "olmo": heads}.get(family, max(1, heads // 2))
    extra = {}
    if family in ("starcoder2", "cohere2"):  # the released models' window of 4096 (wider than the tokens: no keys
        # hidden); Command-R7B's 3 sliding layers of every 4
        extra["sliding_window"] = 4096
    if family == "mixtral":  # Mixtral-8x7B's 8 experts, 2 chosen per token, each 4 x hidden wide here
        extra.update(num_local_experts=8, num_experts_per_tok=2)
    if family == "olmoe":  # OLMoE-1B-7B's 64 experts, 8 chosen per token, each half as wide as the model (1024 of
        # 2048), full multi-head attention
        extra.update(num_experts=64, num_experts_per_tok=8)
        return build(family, **size, intermediate_size=hidden // 2, num_key_value_heads=heads, head_dim=64, **extra)
    if family == "cohere2":
        extra["layer_types"] = ["full_attention" if (l + 1) % 4 == 0 else "sliding_attention" for l in range(layers)]
    return build(family, **size, intermediate_size=4 * hidden, num_key_value_heads=kv, head_dim=64, **extra)


def setup(family: str, args):
    """(model, its HookedModel, the token ids) of one family at the arguments' shape (a mixture of experts with
    transformers' default experts kernel, grouped_mm, as a user's model loads; the tiny test models run eager)."""
    model = model_of(family, args.hidden, args.layers, args.vocab)
    if family in MOE:
        model.set_experts_implementation("grouped_mm")
    return model, HookedModel(model), token_batch(args.batch, args.seq_len, seed=0)


def interleaved(methods: dict, repeats: int, faults: dict | None = None) -> dict[str, list[float]]:
    """CPU seconds of each method in each of `repeats` rounds (the order rotating every round), after a warm-up
    round; `faults`, if given, gets each call's minor page faults by method (fresh pages the kernel zeroed)."""
    times: dict[str, list[float]] = {m: [] for m in methods}
    names = list(methods)
    for r in range(repeats + 1):
        for name in names[r % len(names):] + names[: r % len(names)]:
            flt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.process_time()
            methods[name]()
            if r:  # the first round warms up
                times[name].append(time.process_time() - start)
                if faults is not None:
                    faults.setdefault(name, []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt)
    return times


def read(x, ctx) -> None:
    """A reader that takes the value and keeps nothing."""
    return None


def measure(family: str, args) -> dict:
    model, hm, ids = setup(family, args)
    hooks = {p: read for p in hm.points}
    # TransformerLens's default set: without its optional points (per-head inputs, attn.hook_result, hook_mlp_in)
    default = {p: read for p in hm.points if p.split(".", 2)[-1] not in OPTIONAL}

    def plain():
        return model(input_ids=ids, use_cache=False).logits

    def hooked():
        return hm.run(ids, hooks=hooks, logits=True).logits

    def hooked_default():
        return hm.run(ids, hooks=default, logits=True).logits

    methods = {"plain": plain, "read": hooked, "read_default": hooked_default}
    methods = {m: f for m, f in methods.items() if m == "plain" or m in args.arms}
    with torch.no_grad():
        identical = same_logits(model, ids, plain(), hooked())
        faults: dict[str, list[int]] = {}
        times = interleaved(methods, args.repeats, faults)
    median = {m: statistics.median(t) for m, t in times.items()}
    out = {"points": len(hm.points), "default_points": len(default), "cpu_seconds": median,
           "logits_identical_to": identical, "all": times, "minor_faults": faults,
           "median_minor_faults": {m: statistics.median(f) for m, f in faults.items()}}
    for arm in args.arms:
        out[f"ratio_{arm}_to_plain"] = median[arm] / median["plain"]
        out[f"paired_{arm}"] = paired(times[arm], times["plain"])
    return out


def paired(arm: list[float], plain: list[float], level: float = 0.95) -> list[float]:
    """[geometric mean, low, high] of the ratios arm / plain of each round, with a t-interval over the rounds on the
    log scale (benchmarks/train.py's `ratio_interval`)."""
    return list(ratio_interval([a / b for a, b in zip(arm, plain)], level))


def same_logits(model, ids, plain: torch.Tensor, read: torch.Tensor) -> str:
    """Check the read forward's logits before timing; says which forward they equal bit for bit: "plain" (the model's
    own kernels ran), "eager, heads summed" (the same weights under eager attention, W_O's output the heads' sum:
    tests/tiny_models.py's `heads_summed_twin`) or, where neither is equal, "neither", then only if they are within 1e-5
    of the plain forward's largest |logit| (Falcon's ALiBi form: transformers' eager Falcon adds the bias twice, no
    reference). An output equal to the eager twin's needs no tolerance: against SDPA's kernel it differs by float32
    rounding that grows with depth (1.13e-5 at OLMo-2's 12 layers of 768, 2026-11-30)."""
    if torch.equal(read, plain):
        return "plain"
    if not getattr(model.config, "alibi", False) and \
            torch.equal(read, heads_summed_twin(model)(input_ids=ids, use_cache=False).logits):
        return "eager, heads summed"
    err = float((read - plain).abs().max() / plain.abs().max())
    assert err <= 1e-5, f"the hooked logits differ from the plain forward's by {err:.2e} (relative)"
    return "neither"


def add_model_args(p: argparse.ArgumentParser, hidden: int = 512, layers: int = 4) -> None:
    """The model's and the tokens' shape, as `setup` reads them (shared with profile_ops.py)."""
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size (default: the tiny configs' 256, so that no LM head dilutes the ratio)")


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The models' and the tokens' shape, the repeats, the families and --out (shared with hook_costs.py)."""
    add_model_args(p)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--out", default=None)


def _interval(g: list[float]) -> str:
    return f"{g[0]:.3f} [{g[1]:.3f}, {g[2]:.3f}]"


def spread(r: dict, arm: str = "read") -> str:
    """How much the machine moved the timings of one family's rounds: the plain forward's CPU seconds (least, median,
    most) and read / plain at the fastest quarter of each arm's rounds (its lower quartiles) beside the medians' ratio.
    A description of the noise, not the bar's statistic (the bar is judged on the paired interval)."""
    def lower_quartile(x: list[float]) -> float:
        return statistics.quantiles(x, n=4)[0] if len(x) > 1 else x[0]

    plain, other = r["all"]["plain"], r["all"][arm]
    return (f"plain forward {min(plain):.2f} / {statistics.median(plain):.2f} / {max(plain):.2f} s (least / median / "
            f"most of {len(plain)} rounds); {arm} / plain at the lower quartiles "
            f"{lower_quartile(other) / lower_quartile(plain):.3f}, at the medians "
            f"{statistics.median(other) / statistics.median(plain):.3f}")


def report(family: str, r: dict, arms: list[str]) -> None:
    """Print one family's lines (the measurement's, and the spread of its rounds)."""
    line = f"{family}: plain {r['cpu_seconds']['plain']:.3f} s"
    for arm, what in (("read", f"every point read ({r['points']} points)"),
                      ("read_default", f"without TransformerLens's optional points ({r['default_points']})")):
        if arm in arms:
            line += (f"; {what} {r['cpu_seconds'][arm]:.3f} s: {r[f'ratio_{arm}_to_plain']:.3f}x (paired "
                     f"{_interval(r[f'paired_{arm}'])})")
    flt = ", ".join(f"{m} {n:g}" for m, n in r["median_minor_faults"].items())
    print(line + f" (logits bit-identical to: {r['logits_identical_to']}; page faults per call, "
          f"median: {flt})", flush=True)
    print(f"  spread: {spread(r, arms[0])}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--arms", nargs="+", choices=("read", "read_default"), default=["read", "read_default"],
                   help="the hooked forwards timed beside the plain one (read: every point; read_default: "
                        "TransformerLens's default points); fewer arms, more repeats in the same time")
    p.add_argument("--from", dest="saved", default=None, metavar="JSON",
                   help="print the lines of a saved result (an --out file) instead of measuring")
    args = p.parse_args()
    if args.saved:
        if not Path(args.saved).is_file():
            p.error(f"--from {args.saved}: no such file (give a JSON file written by --out)")
        saved = json.loads(Path(args.saved).read_text())
        for family, r in saved["families"].items():
            report(family, r, saved["config"]["arms"])
        return
    torch.set_num_threads(args.threads)
    out = {"config": vars(args), "torch": torch.__version__, "families": {}}
    for family in args.families:
        r = out["families"][family] = measure(family, args)
        report(family, r, args.arms)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
