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


MODEL_FORM_PREFIXES = ("zoo:", "init:", "hf:", "gguf:", "unilm:", "fetch:", "folder")


@pytest.mark.parametrize("command", ["info", "profile", "quantize", "eval", "export", "act-scales"])
def test_help_names_every_model_form(capsys, command):
    """Every command that takes a model names every form load_model reads, so a newcomer with a Hugging
    Face folder or a GGUF file learns the prefix from --help."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for form in MODEL_FORM_PREFIXES:
        assert form in text, (command, form)


def test_eval_help_lists_every_task_and_key(capsys):
    from diffquant.eval.tasks import TASK_PARAMS

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for task, params in TASK_PARAMS.items():
        assert f"{task} (" in text
        for key in params:
            assert key in text, (task, key)


def test_version(capsys):
    from diffquant import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"diffquant {__version__}"


def test_info_on_a_hugging_face_folder_says_to_add_hf(tmp_path, capsys):
    assert main(["export", "zoo:baseline", "--to", "hf", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"load it as hf:{tmp_path / 'hf'}" in err
    assert main(["info", f"hf:{tmp_path / 'hf'}"]) == 0


def test_eval_warns_past_the_trained_context(tmp_path, capsys):
    """One warning line on stderr when a text task's window exceeds the model card's training context."""
    args = ["eval", "zoo:baseline", "--task", "bpb:data=stdlib:validation,tokens=1024,seq_len=512"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "diffquant: warning: seq_len 512 exceeds the context this model was trained at (256" in err


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
