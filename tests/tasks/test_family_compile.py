"""The family options (sliding window, q/k norm, bias) compile for Hopper (sm_90) on this CPU
machine: the interpreter runs them, only a real compile checks their types and layouts."""

import pytest

from tests.persistent._helpers import can_compile_for_cuda, compile_script_ok


@pytest.mark.compile_script("../tasks/_compile_sm90_family.py")
@pytest.mark.skipif(not can_compile_for_cuda(), reason="Triton's NVIDIA backend is not installed")
def test_family_options_compile_for_sm90(request, tmp_path):
    compile_script_ok(request, tmp_path)
