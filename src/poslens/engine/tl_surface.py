"""The TransformerLens 3.9 surface of `HookedModel`: what a notebook calls on the model object.

    hm = HookedModel.from_pretrained("smollm2-135m")          # model and tokenizer; or HookedModel(model, tokenizer)
    tokens = hm.to_tokens("The causal mask encodes position.")  # BOS prepended by TransformerLens's rule
    loss = hm(tokens, return_type="loss")
    logits, cache = hm.run_with_cache(tokens)
    logits = hm.run_with_hooks(tokens, fwd_hooks=[("blocks.3.attn.hook_pattern", ablate)], bwd_hooks=[...])
    hm.add_hook("blocks.0.hook_resid_pre", fn); hm(tokens); hm.reset_hooks()
    with hm.hooks(fwd_hooks=[...]): hm(tokens)
    hm.generate("Once upon a time", max_new_tokens=10, do_sample=False)

These run as TransformerLens's do, and differ from `HookedModel.run` (poslens's own, the plain-forward guarantee)
in three ways: hooks added with `add_hook` act on them; with an `attention_mask`, each row's positions start at its
first real token (`position_ids` = cumsum(mask) - 1, clamped at 0: a left-padded row is rotated as if unpadded, as
TransformerLens does; `run` passes no position ids, as a plain Hugging Face forward); and `__call__` and
`run_with_hooks` follow torch's grad mode (as TransformerLens: wrap them in `torch.no_grad()` to save memory), so
backward hooks and gradients work. `run_with_cache` follows the grad mode too (its cached values detached), and
`incl_bwd=True` adds gradients.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from poslens.engine.activation_cache import ActivationCache, NoEquivalent, select_points, without_batch
from poslens.errors import UsageError

RETURN_TYPES = ("logits", "loss", "both", None)
# TransformerLens's weight-processing switches of from_pretrained: accepted, nothing processed (HookedModel)
PROCESSING = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases",
              "refactor_factored_attn_matrices")
# HookedTransformer's public names (TransformerLens 3.9's API reference) beside torch.nn.Module's: a missing one of
# these is TransformerLens's with no poslens equivalent (NoEquivalent); any other name is a plain AttributeError
TL_MODEL_NAMES = frozenset((
    "W_E", "W_E_pos", "W_pos", "W_U", "b_U", "W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "W_out",
    "W_gate", "b_in", "b_out", "QK", "OV", "accumulated_bias", "all_composition_scores", "all_head_labels", "blocks",
    "embed", "pos_embed", "unembed", "ln_final", "hook_embed", "hook_pos_embed", "hook_tokens", "cfg", "tokenizer",
    "center_unembed", "center_writing_weights", "fold_layer_norm", "fold_value_biases",
    "refactor_factored_attn_matrices", "process_weights_", "load_and_process_state_dict",
    "load_sample_training_dataset", "sample_datapoint", "generate", "generate_stream", "get_pos_offset",
    "get_residual", "get_token_position", "init_weights", "input_to_embed", "loss_fn", "move_model_modules_to_device",
    "set_tokenizer", "set_use_attn_result", "set_use_attn_in", "set_use_hook_mlp_in", "set_use_split_qkv_input",
    "set_ungroup_grouped_query_attention", "to_single_str_token", "to_single_token", "to_str_tokens", "to_string",
    "to_tokens", "tokens_to_residual_directions", "run_with_cache", "run_with_hooks", "hooks", "add_hook",
    "add_perma_hook", "reset_hooks", "remove_all_hook_fns", "clear_contexts", "hook_dict", "mod_dict",
    "hook_points", "get_caching_hooks", "cache_all", "cache_some", "check_hooks_to_add", "setup", "mps",
    "check_and_add_hook", "ungroup_grouped_query_attention", "tl_named_parameters", "tl_parameters",
))
# what to use instead of a HookedTransformer attribute poslens does not have (in the one-line NoEquivalent)
MODEL_HINTS = {
    "pos_embed": "the table is model.W_pos and its value in a forward is the hook point hook_pos_embed",
    "named_parameters": "model.model.named_parameters() gives the Hugging Face model's, by its names",
    "tl_named_parameters": "the weights by TransformerLens's names are attributes: model.W_Q, model.blocks[l].attn.W_Q",
    "tl_parameters": "the weights by TransformerLens's names are attributes: model.W_Q, model.blocks[l].attn.W_Q",
    "state_dict": "model.model.state_dict() gives the Hugging Face model's, by its names",
    "load_state_dict": "model.model.load_state_dict(...) takes the Hugging Face model's names",
    "mod_dict": "model.blocks[l] has each block's components, model.hook_dict each hook point",
    "modules": "model.model.modules() (the Hugging Face model's)",
    "named_modules": "model.model.named_modules() (the Hugging Face model's)",
    "fold_layer_norm": "poslens never processes weights; apply_ln_to_stack applies the norm's gain (docs/hooks.md, "
                       "'Weights')",
    "process_weights_": "poslens never processes weights; apply_ln_to_stack applies the norm's gain (docs/hooks.md, "
                        "'Weights')",
}
# what to use instead of a TransformerLens keyword poslens refuses (in the one-line NoEquivalent)
REFUSED_HINTS = {
    "start_at_layer": "run the whole forward with a hook at blocks.{l}.hook_resid_pre that returns your residual "
                      "stream (run_with_hooks)",
    "pos_slice": "slice the cached values instead (cache[name][:, pos])",
    "stop_at_layer": "with return_type=None the forward stops after the last cached point, and model(input, "
                     "stop_at_layer=l) returns the residual stream entering block l",
    "past_kv_cache": "generate(use_past_kv_cache=True) runs with a key/value cache",
    "shortformer_pos_embed": "add to hook_embed with a hook (run_with_hooks)",
}


class TLHook:
    """The `hook` argument of a TransformerLens hook function: its `name`, `layer()` and `ctx` (TransformerLens's
    HookPoint.ctx: a dict per point that lasts across calls until reset_hooks(clear_contexts=True))."""

    def __init__(self, name: str, layer: int | None, ctx: dict | None = None) -> None:
        self.name = name
        self._layer = layer
        self.ctx = {} if ctx is None else ctx

    def layer(self) -> int | None:
        return self._layer


def offset_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """TransformerLens's position ids of a padded batch: each row counts from its first real token (cumsum - 1),
    padding before it at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
            per_token: bool = False) -> torch.Tensor:
    """TransformerLens's next-token cross-entropy: -log p(token t+1 | ..t) averaged over the batch and the positions
    whose token and next token are both real (per_token: [B, T - 1], 0 where masked)."""
    logp = logits.float().log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    if attention_mask is None:
        return -logp if per_token else -logp.mean()
    keep = attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool()
    logp = logp * keep
    return -logp if per_token else -logp.sum() / keep.sum()


class TransformerLensSurface:
    """TransformerLens's `HookedTransformer` methods on a HookedModel (mixed in; see the module docstring)."""

    tokenizer: Any
    model: Any
    points: list[str]
    tl_points: list[str]

    # ---- tokens and strings -------------------------------------------------------------------------------

    def _tok(self, what: str):
        if self.tokenizer is None:
            raise UsageError(f"{what} needs a tokenizer, and this model has none (a random config or a directory "
                             "without tokenizer files): HookedModel(model, tokenizer), or "
                             "HookedModel.from_pretrained(spec, tokenizer=SPEC) with a model or tokenizer spec whose "
                             "tokenizer to use (e.g. smollm2-135m)")
        return self.tokenizer

    def to_tokens(self, input: str | list[str], prepend_bos: bool | None = None, padding_side: str | None = None,
                  move_to_device: bool = True, truncate: bool = True) -> torch.Tensor:
        """Text -> token ids [batch, pos], as TransformerLens: the BOS is prepended by default (`prepend_bos=False`
        for a fragment of a prompt; `cfg.default_prepend_bos`), a list of texts is padded with the pad (else EOS) id,
        on the tokenizer's padding_side by default (right when it sets none)."""
        return self._tokens_and_mask(input, prepend_bos, padding_side, truncate)[0].to(
            self.model.device if move_to_device else "cpu")

    def _tokens_and_mask(self, input, prepend_bos, padding_side, truncate=True):
        tok = self._tok("to_tokens")
        texts = [input] if isinstance(input, str) else input
        if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) for t in texts):
            raise UsageError("to_tokens: input must be a text or a non-empty list of texts")
        side = self._side(padding_side, "to_tokens")
        bos = self.cfg.default_prepend_bos if prepend_bos is None else bool(prepend_bos)
        prepends = self.cfg.tokenizer_prepends_bos
        if bos and not prepends:
            if tok.bos_token is None:
                raise UsageError("to_tokens: this tokenizer has no BOS token; pass prepend_bos=False")
            texts = [tok.bos_token + t for t in texts]
        rows = [tok(t)["input_ids"] for t in texts]
        if not bos and prepends:
            rows = [r[1:] if r and r[0] == tok.bos_token_id else r for r in rows]
        if truncate:
            rows = [r[: self.cfg.n_ctx] for r in rows]
        width = max(len(r) for r in rows)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        tokens = torch.full((len(rows), width), 0 if pad is None else pad, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            at = slice(width - len(r), width) if side == "left" else slice(0, len(r))
            tokens[i, at] = torch.tensor(r, dtype=torch.long)
            mask[i, at] = 1
        return tokens, (mask if side == "left" and bool((mask == 0).any()) else None)

    def _side(self, padding_side, method: str) -> str:
        """The padding side: the one given, else the tokenizer's (TransformerLens's default), else right."""
        side = padding_side or getattr(self.tokenizer, "padding_side", None) or "right"
        if side not in ("left", "right"):
            raise UsageError(f"{method}: padding_side must be 'left' or 'right', got {side!r}")
        return side

    def _leading_pads_mask(self, tokens: torch.Tensor, prepend_bos) -> torch.Tensor | None:
        """TransformerLens's mask of left-padded token ids (its utils.get_attention_mask): the leading pad tokens of
        each row are hidden, but when the BOS is prepended and its id is the pad id, the last of them is the row's BOS
        and stays seen. None when no row has a hidden token (the plain forward)."""
        tok = self.tokenizer
        pad = None if tok is None else tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if pad is None:
            return None
        leading = (tokens != pad).long().cumsum(-1) == 0
        bos = self.cfg.default_prepend_bos if prepend_bos is None else bool(prepend_bos)
        if bos and tok.bos_token_id == pad:
            rows = torch.arange(tokens.shape[0], device=tokens.device)
            leading[rows, (leading.sum(-1) - 1).clamp(min=0)] = False
        return (~leading).long() if bool(leading.any()) else None

    def to_string(self, tokens) -> str | list[str]:
        """Token ids -> text: one string for a 1-D input (or a list of ints), a list for [batch, pos]."""
        tok = self._tok("to_string")
        t = torch.as_tensor(tokens)
        if t.dim() > 2:
            raise UsageError(f"to_string: tokens must be 1-D or [batch, pos], got {t.dim()}-D")
        if t.dim() == 2:
            return [tok.decode(row, clean_up_tokenization_spaces=False) for row in t.tolist()]
        return tok.decode(t.reshape(-1).tolist(), clean_up_tokenization_spaces=False)

    def to_str_tokens(self, input, prepend_bos: bool | None = None, padding_side: str | None = None) -> list:
        """Each token as its text: of a text (tokenized by to_tokens' rule), of ids [pos] or [1, pos]; a list of
        texts or ids [batch, pos] gives a list per row."""
        tok = self._tok("to_str_tokens")
        if isinstance(input, list) and input and all(isinstance(s, str) for s in input):
            return [self.to_str_tokens(s, prepend_bos, padding_side) for s in input]
        if isinstance(input, str):
            ids = self.to_tokens(input, prepend_bos, padding_side)[0]
        else:
            ids = torch.as_tensor(input)
            if ids.dim() == 2 and ids.shape[0] > 1:
                return [self.to_str_tokens(row) for row in ids]
            ids = ids.reshape(-1)
        return [tok.decode([i], clean_up_tokenization_spaces=False) for i in ids.tolist()]

    def to_single_token(self, string: str) -> int:
        """The id of a text that is one token (no BOS); a one-line error otherwise."""
        ids = self.to_tokens(string, prepend_bos=False)[0]
        if ids.numel() != 1:
            raise UsageError(f"to_single_token: {string!r} is {ids.numel()} tokens, not one")
        return int(ids[0])

    def tokens_to_residual_directions(self, tokens) -> torch.Tensor:
        """W_U's column of each token ([d_model], or [..., d_model] for a tensor of ids); a text must be one token.
        The unembedding as the model has it: it reads the final norm's output (gain included)."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        ids = torch.as_tensor(tokens, device=self.model.device)
        return self.W_U.T[ids]

    # ---- hooks added to the model ------------------------------------------------------------------------

    def add_hook(self, name, hook: Callable, dir: str = "fwd", is_permanent: bool = False, level=None,
                 prepend: bool = False) -> tuple:
        """Add a TransformerLens hook function fn(value, hook) at a name (or at every name a function of a name
        accepts); it acts on every later call of the TransformerLens surface until reset_hooks(). It is called as
        TransformerLens calls it, fn(value, hook=point), when it takes a `hook` keyword (or **kwargs), else
        fn(value, point)."""
        if dir not in ("fwd", "bwd"):
            raise UsageError(f"add_hook: dir must be 'fwd' or 'bwd', got {dir!r}")
        if not callable(hook):
            raise UsageError(f"add_hook: the hook at {name!r} is not callable")
        self._points_of(name, "add_hook")
        entry = (name, hook, dir, is_permanent)
        if prepend:
            self._added.insert(0, entry)
        else:
            self._added.append(entry)
        return entry

    # ---- torch.nn.Module's everyday calls, on the Hugging Face model underneath -----------------------------

    def to(self, *args, **kwargs) -> TransformerLensSurface:
        """Move or cast the model (torch.nn.Module.to's arguments); returns the HookedModel, as TransformerLens."""
        self.model.to(*args, **kwargs)
        before, self._cfg = self._cfg, None  # its device and dtype fields read again; a default_prepend_bos kept
        if before is not None:
            self.cfg.default_prepend_bos = before.default_prepend_bos
        return self

    def cuda(self, device=None) -> TransformerLensSurface:
        return self.to("cuda" if device is None else torch.device("cuda", device) if isinstance(device, int)
                       else device)

    def cpu(self) -> TransformerLensSurface:
        return self.to("cpu")

    def eval(self) -> TransformerLensSurface:
        self.model.eval()
        return self

    def train(self, mode: bool = True) -> TransformerLensSurface:
        self.model.train(mode)
        return self

    def parameters(self, recurse: bool = True):
        """The Hugging Face model's parameters (an optimizer's argument)."""
        return self.model.parameters(recurse)

    @property
    def hook_dict(self) -> dict:
        """Point name -> its HookPoint (add_hook, remove_hooks), every point of this model in forward order."""
        from poslens.engine.tl_blocks import HookPoint

        return {name: HookPoint(self, name) for name in self.points}

    def hook_points(self) -> list:
        """Every HookPoint, in forward order (TransformerLens's hook_dict.values())."""
        return list(self.hook_dict.values())

    def set_tokenizer(self, tokenizer, default_padding_side: str | None = None) -> None:
        """Use `tokenizer` (and its BOS facts in cfg) from now on."""
        if default_padding_side is not None:
            if default_padding_side not in ("left", "right"):
                raise UsageError(f"set_tokenizer: default_padding_side must be 'left' or 'right', got "
                                 f"{default_padding_side!r}")
            tokenizer.padding_side = default_padding_side
        self.tokenizer = tokenizer
        self._cfg = None

    def to_single_str_token(self, int_token: int) -> str:
        """The text of one token id."""
        if not isinstance(int_token, int):
            raise UsageError(f"to_single_str_token: give one token id (an int), got {type(int_token).__name__}")
        return self.to_string(torch.tensor([int_token]))

    def reset_hooks(self, clear_contexts: bool = True, including_permanent: bool = False, level=None) -> None:
        """Remove the hooks added with add_hook (the permanent ones too with including_permanent=True), and the
        hooks' ctx dicts unless clear_contexts=False."""
        self._added[:] = [h for h in self._added if h[3] and not including_permanent]
        if clear_contexts:
            self._contexts.clear()

    @contextmanager
    def hooks(self, fwd_hooks=(), bwd_hooks=(), reset_hooks_end: bool = True, clear_contexts: bool = False
              ) -> Iterator[TransformerLensSurface]:
        """A context in which `fwd_hooks` and `bwd_hooks` (lists of (name, fn)) act on every call; they are removed
        after it (unless reset_hooks_end=False), and hooks added with add_hook inside it stay, as TransformerLens's."""
        mine = self._add_pairs(fwd_hooks, bwd_hooks, "hooks")
        try:
            yield self
        finally:
            if reset_hooks_end:
                self._added[:] = [h for h in self._added if not any(h is m for m in mine)]
            if clear_contexts:
                self._contexts.clear()

    def _add_pairs(self, fwd_hooks, bwd_hooks, method: str) -> list[tuple]:
        """Add (name, fn) pairs as add_hook does; the entries added."""
        pairs = self._directed(fwd_hooks, bwd_hooks, method)
        for name, _, _ in pairs:
            self._points_of(name, method)  # every name checked before any is added
        return [self.add_hook(name, fn, dir=direction) for name, fn, direction in pairs]

    def _directed(self, fwd_hooks, bwd_hooks, method: str) -> list[tuple]:
        """(name, fn, "fwd" or "bwd") for the checked pairs of both lists."""
        return [(n, f, d) for hooks, d in ((fwd_hooks, "fwd"), (bwd_hooks, "bwd"))
                for n, f in self._pairs(hooks, method)]

    def _pairs(self, pairs, method: str) -> list[tuple]:
        """A list of (name or function of a name, hook function), checked."""
        if not isinstance(pairs, (list, tuple)):
            raise UsageError(f"{method}: hooks must be a list of (name, function) pairs, got {type(pairs).__name__}")
        for pair in pairs:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise UsageError(f"{method}: each hook must be a (name, function) pair, got {pair!r}")
            if not callable(pair[1]):
                raise UsageError(f"{method}: the hook at {pair[0]!r} is not callable")
        return [tuple(p) for p in pairs]

    def _points_of(self, names_filter, method: str) -> list[str]:
        if names_filter is None or not (isinstance(names_filter, (str, list, tuple, set)) or callable(names_filter)):
            raise UsageError(f"{method}: a hook's name must be a hook name, a list of names or a function of a name; "
                             f"got {names_filter!r}")
        return select_points(names_filter, self.points, self.tl_points, self._check_name)

    def _hook_table(self, fwd, bwd, method: str) -> tuple[dict[str, list], bool]:
        """Point -> poslens hooks for the added hooks then `fwd` and `bwd` (TransformerLens functions), and whether
        any backward hook is set."""
        table: dict[str, list] = {}
        entries = [(n, f, d) for n, f, d, _ in self._added] + self._directed(fwd, bwd, method)
        backward = False
        for names_filter, fn, direction in entries:
            call = _forward_call(fn, self._contexts) if direction == "fwd" else _backward_call(fn, self._contexts)
            for name in self._points_of(names_filter, method):
                table.setdefault(name, []).append(call)
                backward |= direction == "bwd"
        return table, backward

    # ---- running ------------------------------------------------------------------------------------------

    def _input(self, input, attention_mask, prepend_bos, padding_side, method: str):
        """(token ids [B, T], attention mask or None) of a text, a list of texts or token ids; token ids on the left
        padding side without a mask get TransformerLens's mask of their leading pads (`_leading_pads_mask`)."""
        if isinstance(input, str) or (isinstance(input, list) and input and isinstance(input[0], str)):
            tokens, mask = self._tokens_and_mask(input, prepend_bos, padding_side)
            return tokens.to(self.model.device), (mask if attention_mask is None else attention_mask)
        tokens = self._check_ids(input, method)
        if attention_mask is None and self._side(padding_side, method) == "left":
            attention_mask = self._leading_pads_mask(tokens, prepend_bos)
        return tokens, attention_mask

    def _tl_forward(self, input, table: dict, return_type, attention_mask, grad: bool, loss_per_token=False,
                    prepend_bos=None, padding_side=None, method="forward"):
        if return_type not in RETURN_TYPES:
            raise UsageError(f"{method}: return_type must be one of 'logits', 'loss', 'both' or None, got "
                             f"{return_type!r}")
        tokens, mask = self._input(input, attention_mask, prepend_bos, padding_side, method)
        mask = self._check_mask(tokens, mask)
        per_token = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None  # not a 4-D or dict mask
        positions = None if per_token is None else offset_positions(per_token)
        if return_type is None:  # TransformerLens runs no LM head then: its unembed points never fire
            table = {name: fns for name, fns in table.items() if not name.startswith("unembed.")}
        out = self._forward(tokens, mask, table, logits=return_type is not None, position_ids=positions, grad=grad)
        if out is None:
            return None
        logits = out.logits
        if return_type == "logits":
            return logits
        loss = lm_loss(logits, tokens, per_token, loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

    def __call__(self, input, return_type: str | None = "logits", loss_per_token: bool = False,
                 prepend_bos: bool | None = None, padding_side: str | None = None,
                 attention_mask: torch.Tensor | None = None, stop_at_layer: int | None = None, **unsupported):
        """TransformerLens's forward: a text, a list of texts or token ids -> logits [B, T, V], the mean next-token
        loss, (logits, loss) or None, with the hooks added by add_hook; under torch's grad mode. stop_at_layer=l:
        the forward stops before block l (negative: counted from the end) and returns the residual stream entering
        it [B, T, d] (l = n_layers: the stream entering the final norm), as TransformerLens's."""
        self._refuse("forward", unsupported)
        table, _ = self._hook_table((), (), "forward")
        if stop_at_layer is None:
            return self._tl_forward(input, table, return_type, attention_mask, torch.is_grad_enabled(),
                                    loss_per_token, prepend_bos, padding_side)
        n = self.n_layers
        if not isinstance(stop_at_layer, int) or not -n <= stop_at_layer <= n:
            raise UsageError(f"forward: stop_at_layer must be an int in {-n}..{n}, got {stop_at_layer!r}")
        layer = stop_at_layer % n if stop_at_layer < 0 else stop_at_layer
        point = f"blocks.{layer}.hook_resid_pre" if layer < n else f"blocks.{n - 1}.hook_resid_post"
        kept: list[torch.Tensor] = []
        table = {name: fns for name, fns in table.items() if self.points.index(name) <= self.points.index(point)}
        table.setdefault(point, []).append(lambda x, ctx: kept.append(x))
        self._tl_forward(input, table, None, attention_mask, torch.is_grad_enabled(), False, prepend_bos,
                         padding_side)
        return kept[0]

    def run_with_hooks(self, input, fwd_hooks=(), bwd_hooks=(), reset_hooks_end: bool = True,
                       clear_contexts: bool = False, *, return_type: str | None = "logits",
                       attention_mask: torch.Tensor | None = None, loss_per_token: bool = False,
                       prepend_bos: bool | None = None, padding_side: str | None = None, **unsupported):
        """TransformerLens's `run_with_hooks`: the forward with `fwd_hooks` (fn(value, hook) returning None or a
        replacement) and `bwd_hooks` (fn(grad, hook), called by a later .backward()) added for this call (with
        reset_hooks_end=False they stay on the model until reset_hooks(), as TransformerLens's)."""
        self._refuse("run_with_hooks", unsupported)
        if not reset_hooks_end:
            self._add_pairs(fwd_hooks, bwd_hooks, "run_with_hooks")
            fwd_hooks = bwd_hooks = ()
        table, backward = self._hook_table(fwd_hooks, bwd_hooks, "run_with_hooks")
        grad = torch.is_grad_enabled()
        if backward and not grad:
            raise UsageError("run_with_hooks: bwd_hooks need gradients; call it outside torch.no_grad()")
        if backward and return_type is None:
            raise UsageError("run_with_hooks: bwd_hooks need an output to differentiate; return_type=None has none")
        out = self._tl_forward(input, table, return_type, attention_mask, grad, loss_per_token, prepend_bos,
                               padding_side, "run_with_hooks")
        if clear_contexts:
            self._contexts.clear()
        return out

    def run_with_cache(self, input, names_filter=None, *, attention_mask: torch.Tensor | None = None,
                       return_type: str | None = "logits", device: str | torch.device | None = None,
                       remove_batch_dim: bool = False, return_cache_object: bool = True, incl_bwd: bool = False,
                       loss_per_token: bool = False, prepend_bos: bool | None = None,
                       padding_side: str | None = None, **unsupported):
        """(output, cache) as TransformerLens's `run_with_cache`: the output of `return_type` (None: no output, and the
        forward stops after the last cached point) and the mapping name -> value of every point `names_filter`
        selects (None: every TransformerLens point; a name; a list of names; a function of a name), in forward order;
        with `incl_bwd=True` also name + "_grad" -> the gradient of the output (a scalar: the loss, or the logits
        summed) at each point. An ActivationCache unless `return_cache_object=False` (a dict)."""
        self._refuse("run_with_cache", unsupported)
        if incl_bwd and return_type is None:
            raise UsageError("run_with_cache: incl_bwd=True needs an output to differentiate; return_type=None has "
                             "none")
        names = select_points(names_filter, self.points, self.tl_points, self._check_name)
        cache: dict[str, torch.Tensor] = {}

        def put(key: str, x: torch.Tensor) -> None:
            cache[key] = x.detach() if device is None else x.detach().to(device)

        table, _ = self._hook_table((), (), "run_with_cache")
        for n in names:
            table.setdefault(n, []).append(lambda x, ctx: put(ctx.name, x))
            if incl_bwd:
                table[n].append(_backward_call(lambda g, hook: put(hook.name + "_grad", g)))
        grad = incl_bwd or torch.is_grad_enabled()  # as TransformerLens: the output keeps its graph in grad mode
        with torch.set_grad_enabled(grad):
            out = self._tl_forward(input, table, return_type, attention_mask, grad, loss_per_token, prepend_bos,
                                   padding_side, "run_with_cache")
            if incl_bwd:
                value = out[1] if return_type == "both" else out
                value.sum().backward()
        ordered = {k: cache[k] for n in names for k in (n, n + "_grad") if k in cache}
        if remove_batch_dim:
            ordered = without_batch(ordered, "run_with_cache")
        result = ActivationCache(ordered, self.n_layers, has_batch_dim=not remove_batch_dim, model=self)
        return out, (result if return_cache_object else ordered)

    @torch.no_grad()
    def generate(self, input: str | list[str] | torch.Tensor = "", max_new_tokens: int = 10, stop_at_eos: bool = True,
                 eos_token_id: int | None = None, do_sample: bool = True, top_k: int | None = None,
                 top_p: float | None = None, temperature: float = 1.0, freq_penalty: float = 0.0,
                 use_past_kv_cache: bool = True, prepend_bos: bool | None = None, padding_side: str | None = None,
                 return_type: str = "input", verbose: bool = True, **unsupported):
        """TransformerLens's `generate`: extend a text, a list of texts (left-padded, as TransformerLens pads a batch
        to generate) or token ids by up to `max_new_tokens` tokens (sampled, or the most likely with
        do_sample=False), with the hooks added by add_hook. With `use_past_kv_cache` (the default, as
        TransformerLens) the first step runs the prompt and each later step only the new token against the cached
        keys and values (hooks see that token's positions; the attention points all keys, those a sliding-window
        layer's cache no longer holds hidden, as its mask hides them); without it every step runs the whole
        sequence. A row that produced the EOS gets EOS after it (`stop_at_eos`). Returns the text
        (special tokens such as the BOS left out, as TransformerLens) when the input was text
        (return_type="input"), else the token ids; "str" or "tokens" choose."""
        self._refuse("generate", unsupported)
        if return_type not in ("input", "str", "tokens"):
            raise UsageError(f"generate: return_type must be 'input', 'str' or 'tokens', got {return_type!r}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise UsageError(f"generate: max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        text = isinstance(input, (str, list))
        if isinstance(input, list) and len(input) > 1:
            padding_side = "left"  # TransformerLens: a batch is generated flush right
        tokens, mask = self._input(input, None, prepend_bos, padding_side, "generate")
        eos = eos_token_id if eos_token_id is not None else getattr(self.tokenizer, "eos_token_id", None)
        if stop_at_eos and eos is None:
            raise UsageError("generate: stop_at_eos needs an EOS id: pass eos_token_id= or stop_at_eos=False")
        table, _ = self._hook_table((), (), "generate")
        done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        past = None
        step = tokens
        for _ in range(max_new_tokens):
            self.check_positions(tokens.shape[1], "generate", "tokens, the prompt's and the new ones together")
            positions = None if mask is None else offset_positions(mask)[:, -step.shape[1]:]
            kv = {"use_cache": True, _cache_argument(self.model): past} if use_past_kv_cache else {}
            out = self._forward(step, mask, table, logits=True, position_ids=positions, grad=False,
                                keys=tokens.shape[1] if use_past_kv_cache else None, **kv)
            past = _returned_cache(out) if use_past_kv_cache else None
            nxt = _choose(out.logits[:, -1].float(), tokens, do_sample, top_k, top_p, temperature, freq_penalty)
            if stop_at_eos:
                nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
                done |= nxt == eos
            tokens = torch.cat([tokens, nxt[:, None]], 1)
            step = nxt[:, None] if use_past_kv_cache else tokens
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            if stop_at_eos and bool(done.all()):
                break
        if return_type == "str" or (return_type == "input" and text):  # TransformerLens: without special tokens
            strings = [self.tokenizer.decode(row, skip_special_tokens=True) for row in tokens.tolist()]
            return strings[0] if len(strings) == 1 else strings
        return tokens

    def loss_fn(self, logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                per_token: bool = False) -> torch.Tensor:
        """TransformerLens's `loss_fn`: the next-token cross-entropy of logits [B, T, V] on tokens [B, T] (per_token:
        [B, T - 1])."""
        return lm_loss(logits, tokens, attention_mask, per_token)

    def get_token_position(self, single_token: str | int, input: str | torch.Tensor, mode: str = "first",
                           prepend_bos: bool | None = None, padding_side: str | None = None) -> int:
        """The position of a token (a one-token text or an id) in a text (tokenized by to_tokens' rule) or in token
        ids [pos] / [1, pos]: its first or last occurrence (`mode`); a one-line error when it does not occur."""
        if mode not in ("first", "last"):
            raise UsageError(f"get_token_position: mode must be 'first' or 'last', got {mode!r}")
        token = self.to_single_token(single_token) if isinstance(single_token, str) else int(single_token)
        ids = self.to_tokens(input, prepend_bos, padding_side) if isinstance(input, str) else torch.as_tensor(input)
        if ids.dim() == 2 and ids.shape[0] != 1:
            raise UsageError(f"get_token_position: input must be one sequence, got a batch of {ids.shape[0]}")
        where = (ids.reshape(-1) == token).nonzero()[:, 0]
        if where.numel() == 0:
            raise UsageError(f"get_token_position: token {token} does not occur in the input")
        return int(where[0] if mode == "first" else where[-1])

    def _refuse(self, method: str, unsupported: dict) -> None:
        if unsupported:
            name = sorted(unsupported)[0]
            hint = REFUSED_HINTS.get(name, "see docs/hooks.md, 'Coming from TransformerLens'")
            raise NoEquivalent(f"{method}: TransformerLens's {name}= has no poslens equivalent; {hint}")


def _cache_argument(model) -> str:
    """The name of the key/value cache argument of the model's forward: `cache` (transformers 5.x) or
    `past_key_values` (before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _returned_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _by_keyword(fn: Callable) -> bool:
    """Whether to call a hook function fn(value, hook=point), as TransformerLens does: it has a `hook` parameter
    or takes **kwargs with no second positional parameter; else it is called fn(value, point) (any names)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    if any(p.name == "hook" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    return any(p.kind == p.VAR_KEYWORD for p in params) and len(positional) <= 1


def _caller(fn: Callable) -> Callable:
    """fn as a function of (value, TLHook) that calls it the way it takes its hook."""
    if _by_keyword(fn):
        return lambda x, hook: fn(x, hook=hook)
    return fn


def _forward_call(fn: Callable, contexts: dict | None = None) -> Callable:
    """A TransformerLens forward hook fn(value, hook) as a poslens hook fn(x, ctx); `contexts`: point name -> the
    dict a hook sees as hook.ctx."""
    call = _caller(fn)
    contexts = {} if contexts is None else contexts
    return lambda x, ctx: call(x, TLHook(ctx.name, ctx.layer, contexts.setdefault(ctx.name, {})))


def _backward_call(fn: Callable, contexts: dict | None = None) -> Callable:
    """A TransformerLens backward hook fn(grad, hook) as a poslens forward hook: it passes the value on as a fresh
    view that autograd tracks, and registers fn on it (a returned tensor replaces the gradient flowing back)."""
    call = _caller(fn)
    contexts = {} if contexts is None else contexts

    def register(x, ctx):
        if not x.requires_grad:
            return None
        y = x.view_as(x)
        hook = TLHook(ctx.name, ctx.layer, contexts.setdefault(ctx.name, {}))
        y.register_hook(lambda g: call(g, hook))
        return y

    return register


def _choose(logits, tokens, do_sample: bool, top_k, top_p, temperature: float, freq_penalty: float) -> torch.Tensor:
    """The next token of each row: the most likely (do_sample=False or temperature 0), or sampled from the tempered
    (top-k, top-p) distribution."""
    if not do_sample or temperature == 0:  # TransformerLens: temperature 0 is greedy
        return logits.argmax(-1)
    if temperature < 0:
        raise UsageError(f"generate: temperature must be >= 0 (0: the most likely token), got {temperature}")
    logits = logits / temperature
    if freq_penalty:
        counts = torch.zeros_like(logits).scatter_add_(1, tokens, torch.ones_like(tokens, dtype=logits.dtype))
        logits = logits - freq_penalty * counts
    if top_k is not None:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p is not None:
        order = logits.sort(-1, descending=True)
        cum = order.values.softmax(-1).cumsum(-1)
        drop = cum - order.values.softmax(-1) > top_p  # keep the smallest set whose mass reaches top_p
        logits = logits.scatter(1, order.indices, order.values.masked_fill(drop, -torch.inf))
    return torch.multinomial(logits.softmax(-1), 1)[:, 0]
