import dataclasses
import math

import pytest

from diffquant import DiffquantError
from diffquant.models import PRESETS, DecoderLM, ModelConfig, matched_configs


def test_json_round_trip():
    cfg = ModelConfig(
        attention="diff_v1", d_model=48, n_heads=2, n_kv_heads=1, head_dim=12, v1_lambda_init=0.5
    )
    assert ModelConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("attention", "diff_v3", "one of baseline, diff_v1, diff_v2"),
        ("n_heads", 0, "an integer >= 1"),
        ("head_dim", 7, "even"),
        ("n_kv_heads", 3, "a divisor of n_heads=4"),
        ("norm_eps", -1.0, "(0, 1)"),
        ("v1_lambda_init", 1.5, "[0, 1)"),
    ],
)
def test_bad_value_names_field_and_range(field, value, expected):
    with pytest.raises(DiffquantError) as err:
        ModelConfig(**{field: value})
    message = str(err.value)
    assert f"'{field}'" in message and expected in message and "\n" not in message


def test_unknown_key_is_named():
    with pytest.raises(DiffquantError, match="unknown key.*n_head\\b.*allowed keys"):
        ModelConfig.from_dict({"n_head": 4})


def test_lambda_init_schedule_matches_published_values():
    cfg = ModelConfig(attention="diff_v1")
    assert [round(cfg.lambda_init(d), 4) for d in range(3)] == [0.2, 0.3555, 0.4707]
    assert cfg.lambda_init(100) == pytest.approx(0.8)
    assert dataclasses.replace(cfg, v1_lambda_init=0.5).lambda_init(3) == 0.5


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("affine", [True, False])
def test_matched_parameter_counts(preset, affine):
    trio = matched_configs(PRESETS[preset])
    trio["diff_v1"] = dataclasses.replace(trio["diff_v1"], v1_norm_affine=affine)
    counts = {k: DecoderLM(c).num_parameters() for k, c in trio.items()}
    base = trio["baseline"]
    d, layers = base.head_dim, base.n_layers
    # V1: the projections keep the baseline's shapes; per layer 4d lambda + 2d norm weight (when affine).
    assert counts["diff_v1"] - counts["baseline"] == layers * (4 * d + (2 * d if affine else 0))
    assert abs(counts["diff_v2"] - counts["baseline"]) / counts["baseline"] < 0.01
    # Independent count of the baseline from its shapes.
    e, h, hkv, f, v = base.d_model, base.n_heads, base.n_kv_heads, base.ffn_dim, base.vocab_size
    per_layer = e * h * d * 2 + 2 * e * hkv * d + 3 * e * f + 2 * e
    assert counts["baseline"] == 2 * v * e + e + layers * per_layer


def test_matched_shapes():
    trio = matched_configs(PRESETS["small"])
    v1, v2 = trio["diff_v1"], trio["diff_v2"]
    assert (v1.n_heads, v1.n_kv_heads, v1.value_dim, v1.n_q_heads) == (4, 2, 64, 8)
    assert (v2.n_heads, v2.n_kv_heads, v2.value_dim, v2.n_q_heads) == (8, 4, 32, 16)
    assert v2.ffn_dim < trio["baseline"].ffn_dim


def test_odd_heads_cannot_derive_v1():
    with pytest.raises(DiffquantError, match="must be even"):
        matched_configs(ModelConfig(n_heads=3, n_kv_heads=1, head_dim=16, d_model=48))


def test_rope_theta_must_be_finite():
    with pytest.raises(DiffquantError, match="rope_theta"):
        ModelConfig(rope_theta=math.inf)
