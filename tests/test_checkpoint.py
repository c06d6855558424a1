"""Native checkpoints: bit-identical round trip, and one clear line for each kind of broken checkpoint."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file, save_file

from diffquant.cli import main
from diffquant.io import load_model, save_checkpoint


def test_save_load_is_bit_identical(tmp_path, any_kind):
    model = tiny_model(any_kind, seed=3)
    ids = torch.randint(0, 61, (2, 13))
    save_checkpoint(model, tmp_path / "ckpt")
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.config == model.config
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_tied_round_trip(tmp_path):
    model = tiny_model("diff_v1", tie_embeddings=True)
    save_checkpoint(model, tmp_path / "ckpt")
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.lm_head.weight is loaded.embed.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_load_in_bf16(tmp_path):
    save_checkpoint(tiny_model("diff_v2"), tmp_path / "ckpt")
    model = load_model(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model(torch.randint(0, 61, (1, 5))).dtype == torch.bfloat16


def test_save_refuses_to_overwrite(tmp_path):
    save_checkpoint(tiny_model("baseline"), tmp_path / "ckpt")
    assert main(["init", str(tmp_path / "ckpt")]) == 2
    assert main(["init", "--force", "--kind", "diff_v1", str(tmp_path / "ckpt")]) == 0
    assert load_model(tmp_path / "ckpt").config.attention == "diff_v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left behind


def _good(tmp_path, kind="baseline"):
    path = tmp_path / "ckpt"
    save_checkpoint(tiny_model(kind), path)
    return path


def _edit_weights(path, edit):
    state = load_file(str(path / "model.safetensors"))
    edit(state)
    save_file(state, str(path / "model.safetensors"))


def _truncate(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _garbage(path):
    (path / "model.safetensors").write_bytes(b"\x07" * 100)


def _unknown_kind(path):
    meta = json.loads((path / "config.json").read_text())
    meta["config"]["attention"] = "diff_v9"
    (path / "config.json").write_text(json.dumps(meta))


def _wrong_shape(state):
    state["layers.0.attn.q_proj.weight"] = torch.zeros(3, 32)


BROKEN = {
    "missing folder": (lambda p: p.rename(p.with_name("gone")), "checkpoint folder not found"),
    "missing config": (lambda p: (p / "config.json").unlink(), "missing config.json"),
    "missing weights": (lambda p: (p / "model.safetensors").unlink(), "missing model.safetensors"),
    "truncated": (_truncate, "model.safetensors: not a readable safetensors file"),
    "corrupt": (_garbage, "model.safetensors: not a readable safetensors file"),
    "unknown kind": (
        _unknown_kind,
        "field 'attention' = 'diff_v9', expected one of baseline, diff_v1, diff_v2",
    ),
    "bad json": (lambda p: (p / "config.json").write_text("{oops"), "config.json: not valid JSON"),
    "missing tensor": (
        lambda p: _edit_weights(p, lambda s: s.pop("layers.1.mlp.up.weight")),
        "missing tensors layers.1.mlp.up.weight",
    ),
    "unexpected tensor": (
        lambda p: _edit_weights(p, lambda s: s.__setitem__("layers.9.extra", torch.zeros(2))),
        "unexpected tensors layers.9.extra",
    ),
    "wrong shape": (
        lambda p: _edit_weights(p, _wrong_shape),
        "layers.0.attn.q_proj.weight has shape [3, 32], expected [32, 32]",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_checkpoint_gives_one_line_and_exit_2(tmp_path, capsys, case):
    path = _good(tmp_path)
    breaker, message = BROKEN[case]
    breaker(path)
    assert main(["info", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith("diffquant info: error: ")


def test_console_script_exit_code_and_no_traceback(tmp_path):
    path = _good(tmp_path)
    _truncate(path)
    proc = subprocess.run(
        [sys.executable, "-m", "diffquant.cli", "info", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
