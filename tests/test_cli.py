"""The CLI as a user meets it: help, init, info (table and JSON)."""

import json
import subprocess
import sys

import pytest

from diffquant.cli import main
from diffquant.io import load_model


def test_help_lists_commands():
    proc = subprocess.run([sys.executable, "-m", "diffquant.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "info" in proc.stdout and "init" in proc.stdout


@pytest.mark.parametrize("kind", ["baseline", "diff_v1", "diff_v2"])
def test_init_then_info(tmp_path, capsys, kind):
    out = tmp_path / kind
    assert main(["init", "--kind", kind, "--preset", "tiny", "--seed", "1", str(out)]) == 0
    model = load_model(out)
    assert model.config.attention == kind
    capsys.readouterr()
    assert main(["info", "--json", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"] == model.config.to_dict()
    assert info["parameters"]["total"] == sum(p.numel() for p in model.parameters())
    assert info["sites"]["total"] == len(model.sites())
    assert info["sites"]["logits"] == (1 if kind == "baseline" else 2) * model.config.n_layers
    assert main(["info", str(out)]) == 0
    table = capsys.readouterr().out
    assert f"attention    {kind}" in table and f"{info['parameters']['total']:,}" in table


def test_init_is_seeded(tmp_path):
    main(["init", "--kind", "diff_v2", "--seed", "5", str(tmp_path / "a")])
    main(["init", "--kind", "diff_v2", "--seed", "5", str(tmp_path / "b")])
    a, b = load_model(tmp_path / "a"), load_model(tmp_path / "b")
    assert all((pa == pb).all() for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


def test_missing_hf_folder_is_refused_clearly(capsys):
    assert main(["info", "hf:/some/folder"]) == 2
    err = capsys.readouterr().err
    assert "/some/folder" in err and err.count("\n") == 1


def test_bad_choice_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["init", "--kind", "diff_v3", "x"])
    assert exc.value.code == 2
