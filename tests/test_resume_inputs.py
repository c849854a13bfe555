"""A resumed or reused run reads what the run it continues read: a checkpoint records the token ids' SHA-256 and its
inputs' files (`poslens.engine.pipeline.input_stamps`), so a rerun after the text or the model's weights changed is
refused in one line instead of mixing two inputs in one set of sums (it resumed silently before, and recorded the
new text's hash over sums partly from the old one); `force` starts it over; a card does not reuse a sub-run whose
inputs changed."""

from __future__ import annotations

import pytest
import torch
from helpers import interrupted_at
from test_pipeline import saved_tiny_llama, text_of
from tiny_models import build

import poslens
from poslens.analyses.scores import ScoresConfig, run_scores
from poslens.engine.pipeline import checkpoint_path
from poslens.errors import UsageError


@pytest.fixture
def model_dir(tmp_path):
    return saved_tiny_llama(tmp_path / "model")


def cfg(model_dir, **kw) -> ScoresConfig:
    return ScoresConfig(**{"model": str(model_dir), "data": text_of(model_dir), "seq_len": 32, "num_sequences": 8,
                           "batch_size": 2, "mode": "pack", "checkpoint_every": 1, "figures": False, **kw})


def interrupted(config: ScoresConfig, out, monkeypatch) -> None:
    """Run `config` into `out` and stop it (KeyboardInterrupt) at its third batch, its checkpoint left behind."""
    with interrupted_at(3):
        run_scores(config, out, progress=False)
    assert checkpoint_path(out).exists()


def test_a_changed_text_is_refused_on_resume_and_force_starts_over(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    interrupted(cfg(model_dir), out, monkeypatch)
    text = model_dir.parent / f"{model_dir.name}.txt"
    text.write_text("\n".join(reversed(text.read_text().splitlines())))  # other documents first
    with pytest.raises(UsageError, match="belongs to a different configuration .* pass --force to start over"):
        run_scores(cfg(model_dir), out, progress=False)
    assert not out.exists()
    forced = poslens.load(run_scores(cfg(model_dir), out, force=True, progress=False))
    fresh = poslens.load(run_scores(cfg(model_dir), tmp_path / "fresh", progress=False))
    assert forced.meta["resumed_from_unit"] == 0
    assert forced.meta["data"]["tokens_sha256"] == fresh.meta["data"]["tokens_sha256"]
    for key in ("scores", "scores_se"):
        torch.testing.assert_close(forced[key], fresh[key], rtol=0, atol=0, equal_nan=True)


def test_changed_weights_are_refused_on_resume(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    interrupted(cfg(model_dir), out, monkeypatch)
    build("llama", vocab_size=258, max_position_embeddings=128, seed=7).save_pretrained(model_dir)
    with pytest.raises(UsageError, match="belongs to a different configuration"):
        run_scores(cfg(model_dir), out, progress=False)


def test_the_same_inputs_still_resume(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    interrupted(cfg(model_dir), out, monkeypatch)
    assert poslens.load(run_scores(cfg(model_dir), out, progress=False)).meta["resumed_from_unit"] == 2


def test_force_replaces_a_checkpoint_of_other_options(model_dir, tmp_path, monkeypatch):
    """An interrupted run with 4 groups, rerun with 3 and force: started over (it was refused, 'delete it')."""
    out = tmp_path / "run"
    interrupted(cfg(model_dir, groups=4), out, monkeypatch)
    with pytest.raises(UsageError, match="different configuration"):
        run_scores(cfg(model_dir, groups=3), out, progress=False)
    run = poslens.load(run_scores(cfg(model_dir, groups=3), out, force=True, progress=False))
    assert run.meta["resumed_from_unit"] == 0 and run.meta["groups"]["used"] == 3


def test_a_card_does_not_reuse_a_sub_run_whose_text_changed(model_dir, tmp_path):
    from poslens.analyses.card.run import SubRun, same_config

    config = cfg(model_dir)
    path = run_scores(config, tmp_path / "scores", progress=False)
    sub = SubRun(str(model_dir), "m", "scores", path, config, "", run_scores)
    assert same_config(sub) is True
    assert set(poslens.load(path).meta["inputs"]) == {str(model_dir.resolve()), str(model_dir.parent.resolve()
                                                                                     / "model.txt")}
    text = model_dir.parent / f"{model_dir.name}.txt"
    text.write_text(text.read_text()[:-1] + "!")  # one character: the file's size is the same, its time is not
    assert same_config(sub) is False
