"""The CLI as a user meets it when something is wrong: every user error, interrupt or
environment problem is one line on stderr and an exit code (README: exit codes), reported
before any work; no traceback."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mk.__main__ import EXIT_INTERRUPTED, main
from mk.generate import DEFAULT_CONFIG
from mk.models import Llama

ROOT = Path(__file__).resolve().parents[1]


def _one_error_line(capsys, *fragments) -> str:
    err = capsys.readouterr().err
    assert err.startswith("mk: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for f in fragments:
        assert f in err, err
    return err


def test_ctrl_c_ends_with_one_line_and_exit_code_130(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MK_CACHE_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "mk", "generate", "--max-new-tokens", "50"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()   # "mk: building the default model ...": it is at work
        assert first.startswith("mk: "), first
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED == 130
    assert "Traceback" not in err and err.rstrip().endswith("mk: interrupted"), err


def test_an_interrupt_anywhere_in_a_command_is_exit_code_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr("mk.generate.run_generate", interrupted)
    assert main(["generate"]) == 130
    assert capsys.readouterr().err == "\nmk: interrupted\n"


def test_a_bug_is_one_line_unless_mk_debug_asks_for_the_traceback(monkeypatch, capsys):
    def broken(args):
        raise KeyError("oops")

    monkeypatch.setattr("mk.__main__.run_plan", broken)
    assert main(["plan", "--model", "llama-3-8b", "--device", "h200"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mk: internal error: KeyError: 'oops' (set MK_DEBUG=1") and err.count("\n") == 1, err
    monkeypatch.setenv("MK_DEBUG", "1")
    with pytest.raises(KeyError):
        main(["plan", "--model", "llama-3-8b", "--device", "h200"])


def test_version_and_help_say_what_mk_is_and_runs(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"mk {__import__('mk').__version__}"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Llama, Mistral, Qwen2, Qwen3" in text and "a Llama through" not in text
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    from mk.planner.device import PRESETS

    assert f"a device preset ({', '.join(sorted(PRESETS))};" in text   # the names its error lists
    assert main(["plan", "--model", "llama-3-8b", "--device", "h1000"]) == 1
    _one_error_line(capsys, f"known: {', '.join(sorted(PRESETS))}")


@pytest.mark.parametrize("env,message", [
    ({"WORLD_SIZE": "2"}, "generate over 2 ranks (WORLD_SIZE=2) runs one process per CUDA GPU, and this machine "
                          "has none"),
    ({"WORLD_SIZE": "abc"}, "environment variable WORLD_SIZE must be an integer (torchrun sets it), got 'abc'"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "environment variable RANK must be in [0, WORLD_SIZE=2), got 2"),
    ({"WORLD_SIZE": "0"}, "environment variable WORLD_SIZE must be >= 1, got 0"),
])
def test_torchrun_environments_that_cannot_run_are_refused_before_any_work(monkeypatch, capsys, no_model, env,
                                                                          message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # as on a machine without a GPU
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["generate", "--model", "some/folder"]) == 1
    _one_error_line(capsys, message)


def test_plan_fits_its_default_length_to_a_short_model_and_names_the_device_first(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**DEFAULT_CONFIG, "model_type": "llama",
                                                      "max_position_embeddings": 200}))
    assert main(["plan", "--model", str(tmp_path), "--device", "h200", "--json"]) == 0
    assert '"kv_len": 200' in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["plan", "--model", str(tmp_path), "--kv-len", "5000"]) == 1
    _one_error_line(capsys, "name a device with --device")


def test_demo_refuses_a_bad_seed_before_running_an_op(capsys):
    assert main(["demo", "--seed", "-1"]) == 1
    assert capsys.readouterr().out == ""
    assert main(["demo", "--seed", str(2**64)]) == 1
    _one_error_line(capsys, "--seed: seed must be in [0, 2**63)")


def test_one_new_token_shows_no_rate(capsys):
    """The prefill chooses the first token; with nothing decoded there is nothing to rate."""
    assert main(["generate", "--max-new-tokens", "1", "--check-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert "no decode step ran, so there is no rate to show" in out and "tokens/s" not in out


def test_a_reference_without_finite_logits_is_never_a_match(monkeypatch, capsys):
    def no_logits(model, prompts, n):
        raise FloatingPointError("the reference's logits for new token 0 hold NaN or Inf")

    monkeypatch.setattr("mk.generate.greedy_generate", no_logits)
    assert main(["generate", "--max-new-tokens", "2"]) == 1
    out = capsys.readouterr().out
    assert "check: failed: the reference's logits for new token 0 hold NaN or Inf" in out and "match" not in out


def test_warnings_are_one_line_each(tmp_path, capsys, no_model):
    (tmp_path / "config.json").write_text(json.dumps(DEFAULT_CONFIG))   # no model_type: read as a Llama, said
    assert main(["generate", "--model", str(tmp_path)]) == 1            # (and no weights: the error)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("mk: warning: ") and "names no model_type or architectures: read as a Llama" in err[0]
    assert err[1].startswith("mk: error: no weights in") and len(err) == 2, err


class _ClosedPipe:
    """A stdout whose reader is gone: every write raises BrokenPipeError, as a closed pipe does."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_stdout_ends_quietly(monkeypatch, capsys):
    def prints(args):
        print("the first tokens", flush=True)
        return 0

    monkeypatch.setattr("mk.generate.run_generate", prints)
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    assert main(["generate"]) == 0
    assert capsys.readouterr().err == ""


def test_a_closed_pipe_ends_the_process_quietly_with_exit_code_0(tmp_path):
    """``mk ... | head -c 10``: no ``mk: error: [Errno 32] Broken pipe``, nothing at exit either."""
    script = ("import sys, mk.__main__ as m\n"
              "def run(args):\n"
              "    for i in range(100000):\n"
              "        print(f'token {i} ' * 10)\n"
              "    return 0\n"
              "m._run = run\n"
              "sys.exit(m.main(['demo']))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MK_CACHE_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and head == b"token 0 to" and err == "", err


@pytest.mark.parametrize("value, traceback", [("1", True), ("true", True), ("YES", True), ("0", False),
                                              ("no", False), ("false", False), ("", False)])
def test_mk_debug_asks_for_tracebacks_only_with_1_true_or_yes(monkeypatch, capsys, value, traceback):
    def broken(args):
        raise KeyError("oops")

    monkeypatch.setattr("mk.__main__.run_plan", broken)
    monkeypatch.setenv("MK_DEBUG", value)
    if traceback:
        with pytest.raises(KeyError):
            main(["plan", "--model", "llama-3-8b", "--device", "h200"])
    else:
        assert main(["plan", "--model", "llama-3-8b", "--device", "h200"]) == 1
        assert capsys.readouterr().err.startswith("mk: internal error: KeyError: 'oops'")


def test_a_config_naming_no_family_is_warned_about_once_per_generate(tmp_path, monkeypatch, capsys):
    from mk.models import LlamaConfig, random_weights, save_weights

    config = LlamaConfig(**DEFAULT_CONFIG)
    save_weights(random_weights(config, seed=0), config, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(DEFAULT_CONFIG))   # no model_type: read as a Llama, said

    def loaded(*args, **kwargs):
        raise ValueError("stop here")

    monkeypatch.setattr(Llama, "from_pretrained", loaded)   # (AutoModel reads config.json again first)
    assert main(["generate", "--model", str(tmp_path), "--ids", "1,2"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if "names no model_type" in line] == [err[0]] and err[-1] == "mk: error: stop here"
