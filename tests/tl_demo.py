"""The idioms of TransformerLens's own Main Demo and Exploratory Analysis Demo notebooks, written once and run on
either library: `main_demo(model, utils)` and `exploratory_demo(model, utils)` take the model a notebook's loading
line makes (TransformerLens 3.9's HookedTransformer or poslens's HookedModel) and that library's `utils`, and return
what the notebooks print or plot, as plain numbers, strings and shapes.

Facts carry over from the notebooks (GPT-2 there), their code does not; what the embedded SmolLM2-135M forces:
its own single-token names and prompts; head loops over hook_v run over its key/value heads (cfg.n_key_value_heads:
grouped-query attention, hook_v is [batch, pos, K, d_head] on both libraries); patching loops run over LAYERS, not
all 30, and position loops over POSITIONS (the names and the last token), to keep a test short; the Main Demo's
"hook_in" shortcut (TransformerLens 4's bridge name) is hook_resid_pre.
The idioms a library lacks are not here but in NO_EQUIVALENT, each tested for its one-line error.
"""

from __future__ import annotations

import torch

LAYERS = (0, 29)  # the layers the patching loops visit (first and last of SmolLM2-135M's 30)
POSITIONS = (2, 4, 10, -1)  # the positions they visit: the two names, the repeated name, the last token

IOI_CLEAN = "After John and Mary went to the store, Mary gave a bottle of milk to"
IOI_CORRUPTED = "After John and Mary went to the store, John gave a bottle of milk to"
PROMPT_FORMATS = ["When John and Mary went to the shops,{} gave the bag to",
                  "When Tom and James went to the park,{} gave the ball to",
                  "When Dan and Sid went to the shops,{} gave an apple to",
                  "After Martin and Amy went to the park,{} gave a drink to"]
NAMES = [(" Mary", " John"), (" Tom", " James"), (" Dan", " Sid"), (" Martin", " Amy")]

# the notebooks' idioms with no poslens equivalent: (what, code run with `model` and `utils` defined)
NO_EQUIVALENT = [
    ("run_with_cache(stop_at_layer=)", "model.run_with_cache('Hello', stop_at_layer=1)"),
    ("model.blocks[l].attn.rotary_sin", "model.blocks[0].attn.rotary_sin"),
    ("model.blocks[l](x)", "model.blocks[0](model.W_E[:1])"),
    ("model.tl_named_parameters()", "model.tl_named_parameters"),
    ("utils.test_prompt", "utils.test_prompt"),
]


def _floats(t) -> list[float]:
    return [float(v) for v in torch.as_tensor(t).double().reshape(-1)]


def repeated_random_tokens(batch: int, half: int, seed: int = 0) -> torch.Tensor:
    """[batch, 2 * half] random ids in [100, 20000) repeated once (the demos' induction input), from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(100, 20000, (batch, half), generator=g)
    return torch.cat([first, first], 1)


def main_demo(model, utils) -> dict:
    """The Main Demo's idioms (loss, cache, head ablation, residual patching, induction scores, hook names and
    shapes, tokenization, generation)."""
    out: dict = {}
    with torch.no_grad():
        text = "To try the model out, let's find the loss on this text about loading and running models!"
        out["loss"] = float(model(text, return_type="loss"))

        tokens = model.to_tokens(IOI_CLEAN)
        logits, cache = model.run_with_cache(tokens, remove_batch_dim=True)
        pattern = cache["pattern", 0, "attn"]
        out["pattern_shape"] = list(pattern.shape)
        out["pattern_last_row_head0"] = _floats(pattern[0, -1])
        name = "blocks.0.attn.hook_pattern"
        _, small = model.run_with_cache(tokens, remove_batch_dim=True, names_filter=[name])
        out["filtered_cache_keys"] = list(small.keys())
        out["filtered_equals_full"] = bool(torch.allclose(small[name], pattern))

        # head ablation at hook_v (edited in place, returned)
        head = 1

        def ablate_v(value, hook):
            value[:, :, head, :] = 0.0
            return value

        out["original_loss"] = float(model(tokens, return_type="loss"))
        out["ablated_loss"] = float(model.run_with_hooks(tokens, return_type="loss",
                                                         fwd_hooks=[(utils.get_act_name("v", 0), ablate_v)]))

        # activation patching of the residual stream, position by position (edited in place, returned)
        clean, corrupted = model.to_tokens(IOI_CLEAN), model.to_tokens(IOI_CORRUPTED)
        mary, john = model.to_single_token(" Mary"), model.to_single_token(" John")

        def logit_diff(lg) -> float:
            return float(lg[0, -1, john] - lg[0, -1, mary])

        clean_logits, clean_cache = model.run_with_cache(clean)
        clean_diff, corrupted_diff = logit_diff(clean_logits), logit_diff(model(corrupted))
        out["ioi_logit_diffs"] = [clean_diff, corrupted_diff]
        recovered = torch.zeros(len(LAYERS), len(POSITIONS))
        for i, layer in enumerate(LAYERS):
            for j, position in enumerate(p % clean.shape[1] for p in POSITIONS):
                def patch(resid, hook, position=position):
                    resid[:, position, :] = clean_cache[hook.name][:, position, :]
                    return resid

                patched = model.run_with_hooks(corrupted, fwd_hooks=[(utils.get_act_name("resid_pre", layer), patch)])
                recovered[i, j] = (logit_diff(patched) - corrupted_diff) / (clean_diff - corrupted_diff)
        out["ioi_patching"] = _floats(recovered)

        # induction: loss by position on repeated random tokens, induction scores by a names_filter function
        half = 20
        repeated = repeated_random_tokens(4, half)
        per_token = model.loss_fn(model(repeated), repeated, per_token=True)
        out["loss_by_position"] = _floats(per_token.mean(0))
        scores = torch.zeros(model.cfg.n_layers, model.cfg.n_heads)

        def induction_score(pattern, hook):
            stripe = pattern.diagonal(dim1=-2, dim2=-1, offset=1 - half)
            scores[hook.layer()] = stripe.mean((0, -1)).cpu()

        model.run_with_hooks(repeated, return_type=None,
                             fwd_hooks=[(lambda name: name.endswith("pattern"), induction_score)])
        out["induction_scores"] = _floats(scores)

        # every point of block 0 and outside the blocks, with its shape
        seen = []
        model.run_with_hooks("The quick brown fox jumped over the lazy dog", return_type=None,
                             fwd_hooks=[(lambda name: name.startswith("blocks.0.") or not name.startswith("blocks"),
                                         lambda act, hook: seen.append([hook.name, list(act.shape)]))])
        out["hook_names_and_shapes"] = seen
        out["b_U_shape"] = list(model.unembed.b_U.shape)

        # tokenization
        example = "The first thing you need to figure out is *how* things are tokenized."
        out["str_tokens"] = model.to_str_tokens(example)
        out["tokens"] = model.to_tokens(example).tolist()
        out["multi_tokens"] = model.to_tokens(["The cat sat on the mat.", "The cat sat on the mat really hard."]
                                              ).tolist()
        probs = model("The cat sat on the mat.").softmax(dim=-1)
        out["probs_shape"] = list(probs.shape)
        out["prob_the"] = float(probs[0, -1, model.to_single_token(" The")])
        out["to_string_256"] = model.to_string(256)
        out["to_string_squeeze"] = model.to_string(model.to_tokens("The cat sat on the mat.").squeeze())
        out["token_position"] = [model.get_token_position(" cat", "The cat sat on the mat"),
                                 model.get_token_position(" cat", "The cat sat on the mat", prepend_bos=False),
                                 model.get_token_position(" cat", "The cat sat on the mat. The mat sat on the cat.",
                                                          mode="first"),
                                 model.get_token_position(" cat", "The cat sat on the mat. The mat sat on the cat.",
                                                          mode="last")]
        out["arithmetic_str_tokens"] = [model.to_str_tokens("2342+2017=21445"),
                                        model.to_str_tokens("1000+1000000=999999")]
        out["hello_shapes"] = [list(model("Hello World").shape), list(model("Hello World", prepend_bos=True).shape),
                               list(model("Hello World", prepend_bos=False).shape)]
        claire = model.to_single_token(" Claire")
        prompt = "Claire and Mary went to the shops, then Mary gave a bottle of milk to"
        out["bos_logit_diffs"] = [float(lg[0, -1, claire] - lg[0, -1, mary]) for lg in
                                  (model(prompt, prepend_bos=True), model(prompt, prepend_bos=False))]
        out["claire_str_tokens"] = [model.to_str_tokens(" Claire", prepend_bos=False),
                                    model.to_str_tokens("Claire", prepend_bos=False)]

        # generation, greedy (the demo samples; sampling draws differ between libraries), with and without the cache
        out["generate"] = [model.generate("The causal mask encodes position because", max_new_tokens=12,
                                          do_sample=False, verbose=False, use_past_kv_cache=kv) for kv in (True, False)]
        out["generate_tokens"] = model.generate(model.to_tokens("Once upon a time"), max_new_tokens=8,
                                                do_sample=False, verbose=False).tolist()
    return out


def exploratory_demo(model, utils) -> dict:
    """The Exploratory Analysis Demo's idioms (indirect object identification on a batch: logit differences, the
    logit lens, direct logit attribution by layer and head, attention patterns, activation patching of the residual
    stream, attention and MLP outputs, head outputs, values and patterns, head-type scores, a head ablation)."""
    out: dict = {}
    model.set_use_attn_result(True)
    with torch.no_grad():
        prompts, answers = [], []
        for fmt, pair in zip(PROMPT_FORMATS, NAMES):
            for j in range(2):
                answers.append((pair[j], pair[1 - j]))
                prompts.append(fmt.format(pair[1 - j]))
        answer_tokens = torch.tensor([[model.to_single_token(a), model.to_single_token(b)] for a, b in answers])
        out["prompt_lengths"] = [len(model.to_str_tokens(p)) for p in prompts]
        tokens = model.to_tokens(prompts, prepend_bos=True)
        logits, cache = model.run_with_cache(tokens)

        def logit_diffs(lg, per_prompt=False):
            final = lg[:, -1, :].gather(-1, answer_tokens)
            diff = final[:, 0] - final[:, 1]
            return diff if per_prompt else diff.mean()

        out["per_prompt_logit_diff"] = _floats(logit_diffs(logits, per_prompt=True))
        clean_diff = float(logit_diffs(logits))

        directions = model.unembed.W_U[:, answer_tokens]  # [d_model, batch, 2]
        directions = directions[:, :, 0] - directions[:, :, 1]  # [d_model, batch]
        final = cache["resid_post", -1][:, -1, :]
        scaled = cache.apply_ln_to_stack(final, layer=-1, pos_slice=-1)
        out["calculated_logit_diff"] = float((scaled * directions.T).sum() / len(prompts))

        def stack_to_logit_diff(stack, c):
            return (c.apply_ln_to_stack(stack, layer=-1, pos_slice=-1) * directions.T).sum(-1).sum(-1) / len(prompts)

        accumulated, labels = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, return_labels=True)
        out["logit_lens"], out["logit_lens_labels"] = _floats(stack_to_logit_diff(accumulated, cache)), labels
        per_layer, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
        out["per_layer"], out["per_layer_labels"] = _floats(stack_to_logit_diff(per_layer, cache)), labels
        per_head, labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
        per_head = stack_to_logit_diff(per_head, cache).reshape(model.cfg.n_layers, model.cfg.n_heads)
        out["per_head"], out["per_head_labels"] = _floats(per_head), labels[:3] + labels[-3:]
        top = torch.topk(per_head.flatten(), k=3).indices
        out["top_heads"] = [int(h) for h in top]
        out["top_head_patterns"] = [_floats(cache["attn", int(h) // model.cfg.n_heads][0, int(h) % model.cfg.n_heads,
                                                                                        -1]) for h in top]

        corrupted_prompts = [prompts[i + 1 - 2 * (i % 2)] for i in range(len(prompts))]  # each pair swapped
        corrupted = model.to_tokens(corrupted_prompts, prepend_bos=True)
        corrupted_logits, corrupted_cache = model.run_with_cache(corrupted, return_type="logits")
        corrupted_diff = float(logit_diffs(corrupted_logits))
        out["logit_diffs"] = [clean_diff, corrupted_diff]
        out["corrupted_strings"] = model.to_string(corrupted)

        def normalized(lg) -> float:
            return (float(logit_diffs(lg)) - corrupted_diff) / (clean_diff - corrupted_diff)

        def patch_position(act, hook, pos):  # on a clone, returned
            act = act.clone()
            act[:, pos : pos + 1, :] = cache[hook.name][:, pos, :].clone().unsqueeze(1)
            return act

        for kind in ("resid_pre", "attn_out", "mlp_out"):
            grid = torch.zeros(len(LAYERS), len(POSITIONS))
            for i, layer in enumerate(LAYERS):
                for j, pos in enumerate(p % tokens.shape[1] for p in POSITIONS):
                    lg = model.run_with_hooks(corrupted, return_type="logits", fwd_hooks=[
                        (utils.get_act_name(kind, layer), lambda act, hook, pos=pos: patch_position(act, hook, pos))])
                    grid[i, j] = normalized(lg)
            out[f"patch_{kind}"] = _floats(grid)

        def patch_head(act, hook, head, axis):  # a head's slice (axis 2: [b, p, h, d]; axis 1: [b, h, q, k])
            act = act.clone()
            index = (slice(None),) * axis + (slice(head, head + 1),)
            act[index] = cache[hook.name][index].clone()
            return act

        for kind, heads, axis in (("z", model.cfg.n_heads, 2), ("v", model.cfg.n_key_value_heads, 2),
                                  ("attn", model.cfg.n_heads, 1)):
            grid = torch.zeros(len(LAYERS), heads)
            for i, layer in enumerate(LAYERS):
                for head in range(heads):
                    lg = model.run_with_hooks(corrupted, return_type="logits", fwd_hooks=[
                        (utils.get_act_name(kind, layer, "attn"),
                         lambda act, hook, head=head, axis=axis: patch_head(act, hook, head, axis))])
                    grid[i, head] = normalized(lg)
            out[f"patch_head_{kind}"] = _floats(grid)

        # previous-token, duplicate-token and induction scores: three hooks on one names_filter, with the loss
        half = 30
        repeated = repeated_random_tokens(2, half, seed=1)
        scores = {k: torch.zeros(model.cfg.n_layers, model.cfg.n_heads) for k in ("prev", "dup", "ind")}

        def scorer(key, offset):
            def hook(pattern, hook):
                scores[key][hook.layer()] = pattern.diagonal(offset=offset, dim1=-1, dim2=-2).mean((0, -1)).cpu()
            return hook

        pattern_filter = lambda name: name.endswith("hook_pattern")  # noqa: E731 (the notebooks' own form)
        loss = model.run_with_hooks(repeated, return_type="loss", fwd_hooks=[
            (pattern_filter, scorer("prev", 1)), (pattern_filter, scorer("dup", half)),
            (pattern_filter, scorer("ind", half - 1))])
        out["induction_loss"] = float(loss)
        for key, value in scores.items():
            out[f"{key}_scores"] = _floats(value)
            out[f"{key}_corner"] = _floats(utils.get_corner(value))

        # ablate the top head's output at the last position with an added hook, then cache the ablated run
        top_head = int(per_head.flatten().argmax())
        layer, head = divmod(top_head, model.cfg.n_heads)

        def ablate(z, hook):
            z = z.clone()
            z[:, -1, head, :] = 0
            return z

        model.add_hook(utils.get_act_name("z", layer, "attn"), ablate)
        ablated_logits, ablated_cache = model.run_with_cache(tokens)
        model.reset_hooks()
        out["ablated_logit_diff"] = float(logit_diffs(ablated_logits))
        ablated_heads, _ = ablated_cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
        out["ablated_per_head"] = _floats(stack_to_logit_diff(ablated_heads, ablated_cache))
        out["ln_scale_ratio"] = float((cache["ln_final.hook_scale"][:, -1] /
                                       ablated_cache["ln_final.hook_scale"][:, -1]).mean())
    model.set_use_attn_result(False)
    return out


def split_inputs(model, utils) -> dict:
    """TransformerLens's per-head attention inputs (set_use_split_qkv_input): the cached copies' names, shapes and
    values, and writes to one head's copy (in place, not returned) that change only that head's projection."""
    out: dict = {}
    model.set_use_split_qkv_input(True)
    with torch.no_grad():
        tokens = model.to_tokens(IOI_CLEAN)
        mary, john = model.to_single_token(" Mary"), model.to_single_token(" John")
        logits, cache = model.run_with_cache(tokens)
        out["names"] = [k for k in cache.keys() if k.startswith("blocks.2.") and k.endswith("_input")]
        out["shapes"] = [list(cache[k].shape) for k in out["names"]]
        resid = cache["resid_pre", 2]
        out["copies_of_resid_pre"] = [bool(torch.equal(cache[k], resid[:, :, None].expand_as(cache[k])))
                                      for k in out["names"]]
        out["logit_diff"] = float(logits[0, -1, mary] - logits[0, -1, john])
        direction = model.W_E[mary]  # the token's embedding: the same on both (TransformerLens folds gains into W_U)

        def zero_query_head(x, hook):  # head 4's queries read a zero input: its q is 0, its pattern uniform
            x[:, :, 4] = 0

        def push_key_head(x, hook):  # key head 1 reads the " Mary" embedding added at every position
            x[:, :, 1] += 3 * direction

        def swap_value_heads(x, hook):  # value head 2 reads value head 0's copy, reversed in position
            x[:, :, 2] = x[:, :, 0].flip(1)

        hooks = [(utils.get_act_name("q_input", 2), zero_query_head), (utils.get_act_name("k_input", 5), push_key_head),
                 (utils.get_act_name("v_input", 7), swap_value_heads)]
        for name, fn in hooks:
            edited = model.run_with_hooks(tokens, fwd_hooks=[(name, fn)])
            out[f"edited_{name}"] = float(edited[0, -1, mary] - edited[0, -1, john])
        seen = {}
        model.run_with_hooks(tokens, return_type=None, fwd_hooks=[
            hooks[0], ("blocks.2.attn.hook_q", lambda q, hook: seen.setdefault("q", q.clone())),
            ("blocks.2.attn.hook_pattern", lambda p, hook: seen.setdefault("p", p.clone()))])
        out["zeroed_q_head"] = float(seen["q"][:, :, 4].abs().max())
        out["other_q_heads"] = float(seen["q"][:, :, :4].abs().max())
        t = tokens.shape[1]
        uniform = 1 / torch.arange(1, t + 1, dtype=seen["p"].dtype)
        out["uniform_pattern_error"] = float((seen["p"][0, 4].sum(-1) - 1).abs().max() +
                                             (seen["p"][0, 4].max(-1).values - uniform).abs().max())
        out["loss"] = float(model.run_with_hooks(tokens, return_type="loss", fwd_hooks=hooks))
    model.set_use_split_qkv_input(False)
    return out


def weights_demo(model, FactoredMatrix) -> dict:
    """The Main Demo's FactoredMatrix section and weight-based idioms on the model's own (unprocessed) weights:
    a toy FactoredMatrix against its formed product; model.OV and model.QK (shapes, norms, singular values, the
    eigenvalue copying score of every head); the full OV circuit W_E @ OV @ W_U of one head on a token sample (its
    top-1 copying accuracy); `model.blocks[l]`'s weights (GQA's unrepeated _W_K against the repeated W_K) and a
    hook added through `model.blocks[l].attn.hook_pattern.add_hook`; per-head outputs from hook_z and
    blocks[l].attn.W_O. `FactoredMatrix` is the library's class (TransformerLens's or poslens's)."""
    out: dict = {}
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        A, B, C = (torch.randn(*s, generator=g) for s in ((5, 2), (2, 5), (5, 300)))
        AB, factor = A @ B, FactoredMatrix(A, B)
        out["toy_norms"] = [float(AB.norm()), float(factor.norm())]
        out["toy_dims"] = [factor.rdim, factor.ldim, factor.mdim]
        out["toy_eigenvalue_moduli"] = sorted(float(v) for v in factor.eigenvalues.abs())
        out["toy_eigenvalue_sum"] = [float(factor.eigenvalues.sum().real), float(factor.eigenvalues.sum().imag)]
        out["toy_singular_values"] = _floats(factor.S)
        U, S, V = factor.svd()
        out["toy_svd_error"] = float((U @ torch.diag(S) @ V.T - AB).abs().max())
        ABC = factor @ C
        out["toy_abc"] = [list(ABC.shape), float(ABC.norm()), float((AB @ C).norm()), ABC.rdim, ABC.ldim, ABC.mdim]
        out["toy_unfactored_close"] = bool(torch.isclose(factor.AB, AB).all())
        out["toy_transpose_index"] = _floats(factor.T[1:3, 2].AB)

        ov, qk = model.OV, model.QK
        out["ov_shape"], out["ov_mdim"], out["qk_shape"] = list(ov.shape), ov.mdim, list(qk.shape)
        eig = ov.eigenvalues
        out["ov_eigenvalues_shape"], out["ov_eigenvalues_complex"] = list(eig.shape), bool(eig.is_complex())
        out["ov_copying_score"] = _floats(eig.sum(-1).real / eig.abs().sum(-1))
        qk_eig = qk.eigenvalues
        out["qk_copying_score"] = _floats(qk_eig.sum(-1).real / qk_eig.abs().sum(-1))
        out["ov_norms"], out["qk_norms"] = _floats(ov.norm()), _floats(qk.norm())
        out["ov_singular_values"] = _floats(ov[LAYERS[-1], 0].S)
        out["qk_singular_values"] = _floats(qk[LAYERS[0], 1].S)
        out["ov_last_head_eigenvalue_moduli"] = sorted(float(v) for v in ov[-1, -1].eigenvalues.abs())

        layer, head = divmod(int(eig.sum(-1).real.div(eig.abs().sum(-1)).flatten().argmax()), model.cfg.n_heads)
        out["top_copying_head"] = [layer, head]  # the head whose OV circuit copies most: its full circuit
        full = model.embed.W_E @ ov[layer, head] @ model.unembed.W_U
        out["full_ov"] = [list(full.shape), full.mdim]
        sample = torch.randperm(model.cfg.d_vocab, generator=g)[:200]
        block = full[sample, sample].AB  # [200, 200]: row i is what token sample[i] writes to each sampled logit
        out["full_ov_top1"] = float((block.argmax(-1) == torch.arange(200)).float().mean())
        out["full_ov_diagonal"] = _floats(block.diagonal()[:20])

        blk = model.blocks[layer]
        out["block_shapes"] = {name: list(getattr(blk.attn, name).shape) for name in
                               ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "_W_K", "_W_V")}
        out["block_shapes"].update({f"mlp.{n}": list(getattr(blk.mlp, n).shape) for n in ("W_in", "W_gate", "W_out")})
        out["block_shapes"]["ln1.w"] = list(blk.ln1.w.shape)
        repeat = model.cfg.n_heads // model.cfg.n_key_value_heads
        out["gqa_repeat"] = [bool(torch.equal(blk.attn.W_K[h], blk.attn._W_K[h // repeat]))
                             for h in range(model.cfg.n_heads)]
        out["block_equals_stack"] = [bool(torch.equal(blk.attn.W_V, model.W_V[layer])),
                                     bool(torch.equal(blk.mlp.W_out, model.W_out[layer]))]
        out["block_weight_norms"] = [float(t.norm()) for t in (blk.attn.W_Q, blk.attn._W_V, blk.attn.W_O,
                                                                blk.mlp.W_in, blk.mlp.W_gate, blk.ln1.w, blk.ln2.w)]

        tokens = model.to_tokens(IOI_CLEAN)
        row_mass = {}

        def read_pattern(pattern, hook):
            row_mass[hook.name] = _floats(pattern[0, :, -1, :3].sum(-1))  # each head's attention to the first tokens

        model.blocks[0].attn.hook_pattern.add_hook(read_pattern)
        model.blocks[layer].attn.hook_pattern.add_hook(read_pattern)
        model(tokens)
        model.reset_hooks()
        out["pattern_mass_via_blocks"] = row_mass
        _, cache = model.run_with_cache(tokens)
        z = cache["z", layer][0, -1]  # [n_heads, d_head]
        per_head = torch.einsum("hd,hdm->hm", z, blk.attn.W_O)  # each head's output at the last position
        out["head_output_norms"] = _floats(per_head.norm(dim=-1))
        out["head_outputs_sum_to_attn_out"] = float(
            (per_head.sum(0) + blk.attn.b_O - cache["attn_out", layer][0, -1]).abs().max())
    return out
