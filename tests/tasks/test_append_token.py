"""append_token: the decode step's bookkeeping task against its reference."""

import pytest
import torch

from mk.tasks import default_device
from mk.tasks.append_token import append_token, append_token_ref


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_append_token_matches_reference(dtype):
    dev = default_device()
    batch, max_seq = 4, 9
    tokens = torch.randint(0, 1000, (batch, max_seq), dtype=dtype, device=dev)
    pos = torch.tensor([0, 3, max_seq - 2, max_seq - 1], dtype=dtype, device=dev)  # the last: no room
    next_ids = torch.randint(0, 1000, (batch,), dtype=dtype, device=dev)
    t_ref, p_ref = tokens.clone(), pos.clone()
    append_token_ref(next_ids, p_ref, t_ref)
    append_token(next_ids, pos, tokens)
    assert torch.equal(tokens, t_ref) and torch.equal(pos, p_ref)
    assert pos.tolist() == [1, 4, max_seq - 1, max_seq - 1]
    assert tokens[1, 4] == next_ids[1] and tokens[2, max_seq - 1] == next_ids[2]


def test_append_token_refuses_bad_shapes():
    dev = default_device()
    with pytest.raises(ValueError, match="pos"):
        append_token(torch.zeros(2, dtype=torch.int32, device=dev), torch.zeros(3, dtype=torch.int32, device=dev),
                     torch.zeros(2, 5, dtype=torch.int32, device=dev))
    with pytest.raises(TypeError, match="tokens"):
        append_token(torch.zeros(2, dtype=torch.int32, device=dev), torch.zeros(2, dtype=torch.int32, device=dev),
                     torch.zeros(2, 5, device=dev))
