"""Teams of tasks that finish one another's work: the last member to arrive does it.

Decode attention's KV splits wait for no one: each stores its partial, then counts itself,
and the one that completes the count merges the group. No member waits for another, so a
team may run in any order, or all on one program. The count costs every member a round
trip to L2 (the branch needs the atomic's value): split-K linears summed the same way
measured 2-3% slower than reduce tasks.
"""

import triton.language as tl

from ._device import jit


@jit
def last_to_arrive(counter_ptr, members):
    """Count this program in the int32 at ``counter_ptr`` (0 before the team's first member)
    and return whether it is the team's last of ``members``; the last sets the count back to
    0 for the next use.

    Call it after the member's stores: the barrier puts every thread's stores before the
    release, and the last member's acquire then sees every member's. The last reads the
    others' data past L1 (``.cg``): its SM's L1 may hold the same addresses from an earlier
    use."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == members - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last
