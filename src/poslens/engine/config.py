"""The model and the text of every analysis of a real model: one config that the analyses' configs compose.

    @dataclass
    class FooConfig(ModelData):                          # model, data, seq_len, ... each defined once, here
        seq_len: int = option_of(ModelData, "seq_len", 64)   # a default of its own; help and bounds stay
        layer: int = option(0, lo=0, help="the layer to read")

Each field has one default, one bound and one help (its command-line option comes from them, `poslens.options`).
`validate()` checks every bound and choice, the device, and the groups rule below, before anything is loaded.

Groups rule (every interval poslens reports): the sums are kept for G groups of sequences, batch b of the run in
group b mod G, so a group is one batch or more. An interval needs 2 groups at least (`groups` >= 2). When the run
has fewer batches than G, the groups are lowered to the number of batches, and the run says so (stdout and
run.json "groups"); when it has fewer than 2 batches it is refused before any work.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from poslens.engine.data import BOS_POLICIES, MODES
from poslens.engine.families import PE_CHOICES
from poslens.errors import UsageError
from poslens.options import check_options, option

DEFAULT_SEQUENCES = 1000  # the paper's count (Sections 4.2 and 5.2)
SEQUENCES_HELP = "sequences to average over, exactly this many or an error"  # commands with their own default

DTYPES = ("auto", "float32", "bfloat16", "float16")
RUN_ONLY = ("device", "checkpoint_every", "level", "figures")  # change how a run goes, not what it computes


@dataclass
class ModelData:
    """What every analysis of a real model runs on: the model, the text, how it is cut and batched, the groups of
    sequences behind the intervals, and where it runs."""

    model: str = option(help="hub id, local directory, .gguf file, the alias smollm2-135m, or random:<config.json> "
                        "for a randomly initialised model", positional=True, metavar="MODEL")
    data: str | None = option(None, help="text file, directory of text files, .jsonl, .parquet, a datasets "
                              "save_to_disk directory, or a `poslens tokenize` directory (its held-out documents); "
                              "default: the embedded corpus")
    text_field: str = option("text", help="field or column holding the text (.jsonl, .parquet, saved datasets)")
    seq_len: int = option(1024, lo=2, help="tokens per sequence, BOS included")
    num_sequences: int | None = option(None, lo=1, help=f"{SEQUENCES_HELP} (default: as many as the text gives, up "
                                       f"to {DEFAULT_SEQUENCES})")
    batch_size: int = option(20, lo=1, help="sequences per forward pass")
    groups: int = option(20, lo=2, help="groups of sequences for the confidence intervals (batch b goes to group "
                         "b mod G; at least 2; lowered to the number of batches when there are fewer)")
    level: float = option(0.95, lo=0, hi=1, open=True, help="confidence level of the intervals")
    mode: str = option("first", choices=MODES, help="first: the first seq-len tokens of each long-enough document "
                       "(the paper); pack: concatenate documents and cut blocks")
    bos: str = option("auto", choices=BOS_POLICIES, help="BOS token at position 0: auto (as the tokenizer does), "
                      "always, never")
    pe: str = option("auto", choices=PE_CHOICES, help="positional encoding of the loaded model: auto (as the "
                     "checkpoint says; known NoPE checkpoints load without RoPE), none (a checkpoint trained without "
                     "RoPE), rope")
    dtype: str = option("auto", choices=DTYPES, help="auto (float32 on CPU, the checkpoint's dtype on GPU), float32, "
                        "bfloat16, float16")
    device: str = option("cpu", help="cpu, cuda or cuda:N (under torchrun: cuda, one GPU per process)")
    tokenizer: str | None = option(None, help="tokenizer to use (same forms as MODEL); needed for random: configs "
                                   "without tokenizer files")
    seed: int = option(0, lo=0, help="seed of a random: model's weights and of every random choice the analysis makes")
    checkpoint_every: int | None = option(None, lo=1, help="save the partial sums every N units of work (one batch "
                                          "through one pass; default: by time, at least 10 s apart and at most a "
                                          "tenth of the run); rerunning the same command resumes from them")
    figures: bool = option(True, help="write tensors and run.json only (no figures)")

    def validate(self) -> None:
        """Every bound and choice, the device, and the groups rule where the number of sequences is known; a
        one-line UsageError naming the first parameter out of range. Nothing is loaded."""
        from poslens.engine.models import check_device

        check_options(self)
        check_device(self.device)
        if self.num_sequences is not None:
            groups_used(self, self.num_sequences, -(-self.num_sequences // self.batch_size))

    def more_models(self) -> list[str]:
        """Models the run reads besides `model` (an analysis of several seeds of one variant): inputs that --out may
        not be."""
        return []

    def fingerprint_fields(self) -> dict:
        """The fields that decide the numbers (a checkpoint resumes only under the same ones)."""
        return {k: v for k, v in asdict(self).items() if k not in RUN_ONLY}


def groups_used(cfg: ModelData, sequences: int, batches: int) -> int:
    """The groups a run of `sequences` sequences in `batches` batches keeps (the rule in the module docstring)."""
    if sequences < 2:
        raise UsageError(f"num_sequences must be >= 2 for an interval (two groups of sequences), got {sequences}",
                         param="num_sequences")
    if batches < 2:
        raise UsageError(f"batch_size {cfg.batch_size} puts all {sequences} sequences in one batch, and an interval "
                         f"needs 2 groups of sequences (a group is one batch or more); lower batch_size to "
                         f"{sequences // 2} or raise num_sequences", param="batch_size")
    return min(cfg.groups, batches)
