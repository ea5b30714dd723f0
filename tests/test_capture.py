"""capture / hook_points on unmodified Equinox models (issue 38)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eqxctx
from capture_models import GPT, gpt_reference, mlp_reference, rms
from eqxctx import Tap, capture, hook_points
from helpers import optimized_hlo


KEY = jax.random.key(0)


def close(a: object, b: object, rtol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-5)


def _forward(m: object, x: jax.Array) -> jax.Array:
    return m(x)  # pyright: ignore[reportCallIssue]


def _vmapped(m: object, x: jax.Array) -> jax.Array:
    return jax.vmap(m)(x)  # pyright: ignore[reportArgumentType]


def _gpt() -> GPT:
    return GPT(11, 8, 2, 3, key=KEY)


TOKENS = jnp.arange(5) % 11


# --- hook points and selections ---------------------------------------------------


def test_hook_points_name_and_path_every_module() -> None:
    points = hook_points(_gpt())
    assert list(points)[:4] == ["embed", "blocks", "blocks.norm1", "blocks.attn"]
    assert points["blocks.attn.query_proj"].path == "blocks/attn/query_proj"
    assert points["blocks.mlp.layers[1]"].path == "blocks/mlp/layers_1"
    assert points["blocks.attn"].module_type is eqx.nn.MultiheadAttention
    assert "" not in points  # the model itself is not a point


def test_selection_matching_nothing_lists_the_points() -> None:
    mlp = eqx.nn.MLP(2, 1, 4, 1, key=KEY)
    with pytest.raises(
        ValueError, match=r"'layer\[0\]' matches no hook point.*layers\[0\] \(Linear\)"
    ):
        capture(_forward, mlp, jnp.ones(2), taps=Tap("layer[0]", output=True))


@pytest.mark.parametrize(
    ("selection", "expected"),
    [
        ("blocks.attn", ["blocks.attn"]),
        (
            "blocks.*_proj",
            [f"blocks.attn.{n}_proj" for n in ("query", "key", "value", "output")],
        ),
        (eqx.nn.LayerNorm, ["blocks.norm1", "blocks.norm2"]),
        (lambda m: (m.head, m.blocks.mlp), ["blocks.mlp", "head"]),
        (["head", eqx.nn.Embedding], ["embed", "head"]),
        ("blocks.mlp.layers[1]", ["blocks.mlp.layers[1]"]),
    ],
)
def test_selections(selection: object, expected: list[str]) -> None:
    from eqxctx._capture._points import select

    assert [p.name for p in select(_gpt(), selection)] == expected  # pyright: ignore[reportArgumentType]


# --- forward capture vs hand-unrolled references -----------------------------------


@pytest.mark.parametrize("scan", [False, True])
def test_mlp_outputs_and_summaries_equal_unrolled(scan: bool) -> None:
    mlp = eqx.nn.MLP(3, 2, 8, 4, key=KEY, scan=scan)
    x = jnp.arange(3.0)
    tap = Tap(eqx.nn.Linear, output=True, summaries={"rms": rms})
    y, coll = capture(_forward, mlp, x, taps=tap)
    ref = mlp_reference(mlp, x)
    close(y, mlp(x))
    outs = coll.flatten("module_outputs")
    sums = coll.flatten("summaries")
    if scan:  # layers[1] is the stacked hidden stack, one entry per layer
        assert set(outs) == {
            "layers_0/output",
            "layers_1/layer/output",
            "layers_2/output",
        }
        hidden = outs["layers_1/layer/output"]
        assert hidden.shape == (3, 8)
        got = [outs["layers_0/output"], *hidden, outs["layers_2/output"]]
        got_rms = [
            sums["layers_0/rms"],
            *(sums[f"layers_1/layer{i}/rms"] for i in range(3)),
            sums["layers_2/rms"],
        ]
    else:
        got = [outs[f"layers_{i}/output"] for i in range(5)]
        got_rms = [sums[f"layers_{i}/rms"] for i in range(5)]
    for g, r, s in zip(got, ref, got_rms, strict=True):
        close(g, r)
        close(s, rms(r))


def test_multihead_attention_output_equals_reference() -> None:
    attn = eqx.nn.MultiheadAttention(2, 8, key=KEY)
    x = jax.random.normal(KEY, (5, 8))
    tap = Tap(["query_proj", "output_proj"], output=True)
    y, coll = capture(lambda m, x: m(x, x, x), attn, x, taps=tap)
    outs = coll.flatten("module_outputs")
    close(y, attn(x, x, x))
    # query_proj is called by MultiheadAttention under jax.vmap over the 5 positions.
    close(outs["query_proj/output"], jax.vmap(attn.query_proj)(x))
    close(outs["output_proj/output"], y)


def _check_gpt(out: jax.Array, coll: eqxctx.OutputCollection, model: GPT) -> None:
    ref, per_layer = gpt_reference(model, TOKENS)
    close(out, ref)
    outs = coll.flatten("module_outputs")
    sums = coll.flatten("summaries")
    paths = {"attn": "blocks/attn/", "mlp": "blocks/mlp/", "block": "blocks/"}
    for name, path in paths.items():
        stacked = outs[path + "layer/output"]
        assert stacked.shape == (3, 5, 8)
        for i, layer in enumerate(per_layer):
            close(stacked[i], layer[name])
    for i, layer in enumerate(per_layer):
        close(sums[f"blocks/layer{i}/rms"], rms(layer["block"]))
        close(sums[f"blocks/attn/layer{i}/rms"], rms(layer["attn"]))
        # blocks.mlp runs under the block's own jax.vmap over positions: its raw-array
        # summaries merge over the positions by `+` (as vmap_in_context's do).
        per_pos = jax.vmap(rms)(layer["mlp"])
        close(sums[f"blocks/mlp/layer{i}/rms"], jnp.sum(per_pos))


GPT_TAP = Tap(
    ["blocks", "blocks.attn", "blocks.mlp"], output=True, summaries={"rms": rms}
)


def test_gpt_scanned_stack_equals_python_loop() -> None:
    model = _gpt()
    out, coll = capture(_forward, model, TOKENS, taps=GPT_TAP)
    _check_gpt(out, coll, model)


def test_gpt_under_filter_jit() -> None:
    model = _gpt()

    @eqx.filter_jit
    def run(m: GPT, t: jax.Array) -> tuple[jax.Array, eqxctx.OutputCollection]:
        return capture(_forward, m, t, taps=GPT_TAP)

    out, coll = run(model, TOKENS)
    _check_gpt(out, coll, model)


def test_capture_inside_a_differentiated_loss() -> None:
    model = _gpt()

    def loss(m: GPT) -> tuple[jax.Array, eqxctx.OutputCollection]:
        out, coll = capture(_forward, m, TOKENS, taps=GPT_TAP)
        return jnp.mean(out**2), coll

    (value, coll), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
    ref_value, ref_grads = eqx.filter_value_and_grad(
        lambda m: jnp.mean(m(TOKENS) ** 2)
    )(model)
    close(value, ref_value)
    assert eqx.tree_equal(grads, ref_grads, rtol=1e-5, atol=1e-6)
    _check_gpt(model(TOKENS), coll, model)


def test_vmap_over_capture_stacks_per_example() -> None:
    model = _gpt()
    tokens = jnp.stack([TOKENS, (TOKENS + 3) % 11])
    tap = Tap("blocks.attn", output=True, summaries={"rms": rms})
    _out, coll = jax.vmap(lambda t: capture(_forward, model, t, taps=tap))(tokens)
    for b in range(2):
        _, per_layer = gpt_reference(model, tokens[b])
        outs = coll.flatten("module_outputs")["blocks/attn/layer/output"]
        assert outs.shape == (2, 3, 5, 8)
        for i, layer in enumerate(per_layer):
            close(outs[b, i], layer["attn"])
            close(
                coll.flatten("summaries")[f"blocks/attn/layer{i}/rms"][b],
                rms(layer["attn"]),
            )


def test_vmap_inside_fn_keeps_examples_apart() -> None:
    model = _gpt()
    tokens = jnp.stack([TOKENS, (TOKENS + 3) % 11, (TOKENS + 5) % 11])
    tap = Tap("blocks.attn", output=True, summaries={"moments": eqxctx.MomentsSummary})
    _out, coll = eqx.filter_jit(capture)(_vmapped, model, tokens, taps=tap)
    outs = coll.flatten("module_outputs")["blocks/attn/layer/output"]
    assert outs.shape == (3, 3, 5, 8)  # [layer, example, seq, dim]
    refs = [gpt_reference(model, t)[1] for t in tokens]
    for i in range(3):
        for b in range(3):
            close(outs[i, b], refs[b][i]["attn"])
        moments = coll.flatten("summaries")[f"blocks/attn/layer{i}/moments"]
        values = np.stack([refs[b][i]["attn"] for b in range(3)])
        assert int(moments.count) == values.size
        close(moments.mean, values.mean())
        close(moments.m2 / moments.count, values.var(), rtol=1e-4)


def test_checkpointed_stack() -> None:
    model = _gpt()

    def forward(m: GPT, tokens: jax.Array) -> jax.Array:
        x = jax.vmap(m.embed)(tokens)
        dynamic, static = eqx.partition(m.blocks, eqx.is_array)

        @eqx.filter_checkpoint
        def body(x: jax.Array, layer: object) -> tuple[jax.Array, None]:
            return eqx.combine(layer, static)(x), None  # pyright: ignore[reportCallIssue]

        x, _ = jax.lax.scan(body, x, dynamic)
        return jax.vmap(m.head)(x)

    out, coll = capture(forward, model, TOKENS, taps=GPT_TAP)
    _check_gpt(out, coll, model)


# --- zero cost ---------------------------------------------------------------------


def test_nothing_selected_compiles_to_the_bare_model() -> None:
    model = _gpt()
    params, static = eqx.partition(model, eqx.is_array)

    def bare(p: GPT, t: jax.Array) -> jax.Array:
        return eqx.combine(p, static)(t)

    def tapped(p: GPT, t: jax.Array) -> jax.Array:
        return capture(_forward, eqx.combine(p, static), t, taps=())[0]

    assert optimized_hlo(tapped, params, TOKENS) == optimized_hlo(bare, params, TOKENS)


# --- errors ------------------------------------------------------------------------


def test_point_called_twice_raises() -> None:
    lin = eqx.nn.Linear(3, 3, key=KEY)
    model = [lin]
    with pytest.raises(ValueError, match=r"'\[0\]' is called 2 times"):
        capture(
            lambda m, x: m[0](m[0](x)), model, jnp.ones(3), taps=Tap("[0]", output=True)
        )


def test_point_never_called_raises() -> None:
    mlp = eqx.nn.MLP(2, 1, 4, 1, key=KEY)
    with pytest.raises(
        ValueError, match=r"'layers\[1\]' was selected but fn never called it"
    ):
        capture(
            lambda m, x: m.layers[0](x),
            mlp,
            jnp.ones(2),
            taps=Tap("layers[1]", output=True),
        )


def test_point_whose_output_is_unused_raises_at_run_time() -> None:
    mlp = eqx.nn.MLP(2, 1, 4, 1, key=KEY)

    def fn(m: eqx.nn.MLP, x: jax.Array) -> jax.Array:
        m.layers[1](x[:4] if False else jnp.ones(4))  # computed, then dropped
        return m.layers[0](x)

    with pytest.raises(eqx.EquinoxRuntimeError, match="did not run exactly once"):
        capture(fn, mlp, jnp.ones(2), taps=Tap("layers[1]", output=True))


def test_selected_by_two_taps_raises() -> None:
    mlp = eqx.nn.MLP(2, 1, 4, 1, key=KEY)
    with pytest.raises(ValueError, match="selected by two taps"):
        capture(
            _forward,
            mlp,
            jnp.ones(2),
            taps=[Tap("layers[0]", output=True), Tap(eqx.nn.Linear, output=True)],
        )


# --- properties --------------------------------------------------------------------


@settings(max_examples=6)
@given(
    depth=st.integers(1, 4),
    chosen=st.sets(
        st.sampled_from(
            ["blocks", "blocks.attn", "blocks.mlp", "blocks.norm2", "head"]
        ),
        min_size=1,
    ),
)
def test_random_depths_and_selections_equal_the_loop(
    depth: int, chosen: set[str]
) -> None:
    model = GPT(11, 8, 2, depth, key=KEY)
    tap = Tap(sorted(chosen), output=True)
    out, coll = eqx.filter_jit(capture)(_forward, model, TOKENS, taps=tap)
    ref, per_layer = eqx.filter_jit(gpt_reference)(model, TOKENS)
    close(out, ref)
    outs = coll.flatten("module_outputs")
    assert len(outs) == len(chosen)
    names = {
        "blocks": ("blocks/layer/output", "block"),
        "blocks.attn": ("blocks/attn/layer/output", "attn"),
        "blocks.mlp": ("blocks/mlp/layer/output", "mlp"),
    }
    for point in chosen & set(names):
        path, key = names[point]
        assert outs[path].shape[0] == depth
        for i in range(depth):
            close(outs[path][i], per_layer[i][key])
    if "head" in chosen:
        close(outs["head/output"], ref)


# --- interventions -----------------------------------------------------------------


def test_zero_ablate_one_layer_of_a_scanned_stack_equals_hand_edited_model() -> None:
    model = _gpt()
    tap = Tap("blocks.attn", intervene=eqxctx.zero_ablate(), layers=[1])
    out, coll = eqx.filter_jit(capture)(_forward, model, TOKENS, taps=tap)
    assert coll.is_empty()
    # Reference: layer 1's attention output projection (no bias) zeroed by hand.
    proj = model.blocks.attn.output_proj
    assert proj.bias is None
    edited = eqx.tree_at(
        lambda m: m.blocks.attn.output_proj.weight, model, proj.weight.at[1].set(0.0)
    )
    close(out, edited(TOKENS))


def test_add_vector_at_one_point_equals_hand_edited_model() -> None:
    mlp = eqx.nn.MLP(3, 2, 8, 2, key=KEY)
    v = jnp.arange(8.0) / 10
    x = jnp.arange(3.0)
    tap = Tap("layers[1]", intervene=eqxctx.add_vector(v))
    y, _ = capture(_forward, mlp, x, taps=tap)
    bias = mlp.layers[1].bias
    assert bias is not None
    edited = eqx.tree_at(lambda m: m.layers[1].bias, mlp, bias + v)
    close(y, edited(x))


def test_cache_then_patch_back_is_bit_identical() -> None:
    model = _gpt()
    run = eqx.filter_jit(capture)
    out, coll = run(_forward, model, TOKENS, taps=Tap("blocks.mlp", output=True))
    cached = coll.flatten("module_outputs")["blocks/mlp/layer/output"]
    patch = eqxctx.replace_with(cached, per_layer=True)
    patched, _ = run(_forward, model, TOKENS, taps=Tap("blocks.mlp", intervene=patch))
    np.testing.assert_array_equal(np.asarray(patched), np.asarray(out))


def test_patch_from_another_input_changes_only_downstream() -> None:
    model = _gpt()
    other = (TOKENS + 4) % 11
    run = eqx.filter_jit(capture)
    _, coll = run(_forward, model, other, taps=Tap("blocks", output=True))
    cached = coll.flatten("module_outputs")["blocks/layer/output"]
    # Patching the last block's output with the other input's gives its logits.
    tap = Tap(
        "blocks", intervene=eqxctx.replace_with(cached, per_layer=True), layers=[2]
    )
    patched, _ = run(_forward, model, TOKENS, taps=tap)
    close(patched, model(other))


def test_apply_function_sees_the_layer_index() -> None:
    model = _gpt()
    tap = Tap(
        "blocks.attn",
        intervene=lambda y, layer: y * (layer + 1).astype(y.dtype),
        output=True,
    )
    _, coll = capture(_forward, model, TOKENS, taps=tap)
    ref_coll = capture(_forward, model, TOKENS, taps=Tap("blocks.attn", output=True))[1]
    got = coll.flatten("module_outputs")["blocks/attn/layer/output"]
    first = ref_coll.flatten("module_outputs")["blocks/attn/layer/output"]
    close(got[0], first[0])  # layer 0 is scaled by 1; later layers see changed inputs
    assert not np.allclose(np.asarray(got[1]), np.asarray(first[1]))


def test_per_layer_value_without_the_stack_axis_raises() -> None:
    model = _gpt()
    tap = Tap(
        "blocks.attn", intervene=eqxctx.replace_with(jnp.zeros((5, 8)), per_layer=True)
    )
    with pytest.raises(ValueError, match="stacked with leading axes \\(3,\\)"):
        capture(_forward, model, TOKENS, taps=tap)
