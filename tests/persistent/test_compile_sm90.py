"""The megakernel's generated code compiles for Hopper (sm_90) on this CPU machine.

The interpreter never compiles: inline PTX, layouts and type rules are only checked by a
real compile. Triton can compile for a GPU target without a GPU, so this test catches
what would otherwise show up only on the device.
"""

import pytest

from tests.persistent._helpers import can_compile_for_cuda, compile_script_ok


@pytest.mark.compile_script("_compile_sm90.py")
@pytest.mark.skipif(not can_compile_for_cuda(), reason="Triton's NVIDIA backend is not installed")
def test_megakernel_compiles_for_sm90(request, tmp_path):
    compile_script_ok(request, tmp_path)
