from mk.__main__ import main


def test_demo_command_runs_every_op_against_its_reference(capsys):
    assert main(["demo", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "all ops match their references" in out
    for op in ("rmsnorm", "linear", "decode_attention", "prefill_attention", "sample"):
        assert op in out


def test_plan_command_prints_an_explained_plan(capsys, tmp_path):
    assert main(["plan", "--model", "llama-3.2-1b", "--batch", "8", "--device", "L40S", "--smem-budget", "64KiB"]) == 0
    out = capsys.readouterr().out
    assert "plan for llama-3.2-1b, batch 8" in out and "l15.down" in out and "ms predicted" in out
    # A checkpoint folder's config.json works too; bad input is one clear line and exit 1.
    (tmp_path / "config.json").write_text('{"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, '
                                          '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}')
    assert main(["plan", "--model", str(tmp_path), "--device", "h200", "--json"]) == 0
    assert '"model": "' in capsys.readouterr().out
    assert main(["plan", "--model", "gpt-9", "--device", "h200"]) == 1
    assert "unknown model shape 'gpt-9'" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert main(["plan", "--model", str(tmp_path), "--device", "h200"]) == 1
    assert "invalid JSON" in capsys.readouterr().err


def test_generate_command_runs_the_default_model_and_checks_it(capsys):
    assert main(["generate", "--max-new-tokens", "3", "--batch", "2", "--prefill-precision", "exact"]) == 0
    out, err = capsys.readouterr()
    assert "model mk-default-llama" in out and "exact prefill" in out and "plan:" in out and "tokens/s" in out
    assert "; weights float32 " in out and ", KV cache float32 " in out   # no format: the weights' dtype
    # Row 0's ids line is streamed, row 1's printed at the end: the same greedy tokens.
    row0 = out.split("[0] [1, 17, 42, 311, 7, 99] -> ")[1].split("\n")[0]
    assert len(row0.split(",")) == 3 and f"[1] [1, 17, 42, 311, 7, 99] -> {row0}\n" in out
    assert "check: first 3 greedy tokens match the float32 torch reference (3/3)" in out
    # Captured streams are no terminal: status as plain lines, no carriage returns or bars.
    assert err.splitlines() == ["mk: building the default model (random weights) ...",
                                "mk: planning + compiling the decode step (batch 2, length 9) ...",
                                "mk: prefill (2 x 6 tokens), then decoding ...",
                                "mk: checking the greedy tokens against the float32 torch reference ..."]
    assert not [c for c in ("\r", "\033", "%|", "\u2588") if c in out + err]


def test_generate_command_errors_are_one_line(capsys, tmp_path):
    assert main(["generate", "--ids", "1,x"]) == 1
    assert capsys.readouterr().err.strip() == "mk: error: --ids must be comma-separated integers, got '1,x'"
    assert main(["generate", "--model", str(tmp_path / "nope")]) == 1
    assert "nope" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hello"]) == 1
    assert "no tokenizer.json" in capsys.readouterr().err
    assert main(["generate", "--ids", "1,99999"]) == 1
    assert "[0, 512)" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--ids", "1"]) == 1
    assert "give --prompt or --ids, not both" in capsys.readouterr().err


def test_generate_and_plan_take_a_checkpoint_of_another_family(capsys, tmp_path):
    from mk.models import Qwen3Config, random_weights, save_weights

    config = Qwen3Config.tiny(vocab_size=300, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=32, num_hidden_layers=1)
    save_weights(random_weights(config, seed=3), config, tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--ids", "5,9,11", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "(qwen3)" in out and "match the float32 torch reference (3/3)" in out
    assert main(["plan", "--model", str(tmp_path), "--device", "h100", "--kv-len", "256"]) == 0
    assert "l0.qkv" in capsys.readouterr().out
