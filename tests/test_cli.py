from mk.__main__ import main


def test_demo_command_runs_every_op_against_its_reference(capsys):
    assert main(["demo", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "all ops match their references" in out
    for op in ("rmsnorm", "linear", "decode_attention", "prefill_attention", "sample"):
        assert op in out
