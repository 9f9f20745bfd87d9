"""Which scheduler process of a multi-GPU engine serves the control endpoint: one per
data-parallel rank (the first TP/PP rank of it), never two on one socket — the second would
find it live and refuse to start, taking the engine down."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from backend.sglang_ext.plugin import control_socket_of_rank, in_dp_controller, scheduler_ranks

SOCKET = "/tmp/tandem-engine-30000.sock"


def run_scheduler_process(  # SGLang's name: the plugin reads its frame's arguments
    server_args: Any, tp_rank: int, pp_rank: int, dp_rank: int | None
) -> tuple[int, int, int | None, int]:
    return scheduler_ranks()


def test_one_engine_serves_its_socket() -> None:
    assert scheduler_ranks() == (0, 0, None, 1)  # not inside SGLang's scheduler process
    assert control_socket_of_rank(SOCKET, 0, 0, None, 1) == SOCKET
    assert control_socket_of_rank(None, 0, 0, None, 1) is None


def test_tensor_parallel_ranks_share_one_endpoint() -> None:
    args = SimpleNamespace(tp_size=4, dp_size=1, enable_dp_attention=False)
    served = []
    for tp_rank in range(4):
        ranks = run_scheduler_process(args, tp_rank=tp_rank, pp_rank=0, dp_rank=None)
        assert ranks == (tp_rank, 0, None, 4)
        served.append(control_socket_of_rank(SOCKET, *ranks))
    assert served == [SOCKET, None, None, None]


def test_each_data_parallel_rank_serves_its_own_socket() -> None:
    args = SimpleNamespace(tp_size=2, dp_size=2, enable_dp_attention=False)
    served = {
        (dp, tp): control_socket_of_rank(
            SOCKET, *run_scheduler_process(args, tp_rank=tp, pp_rank=0, dp_rank=dp)
        )
        for dp in (0, 1)
        for tp in (0, 1)
    }
    assert served == {(0, 0): SOCKET, (0, 1): None, (1, 0): f"{SOCKET}.dp1", (1, 1): None}
    # DP attention: the TP ranks span the DP ranks (4 TP ranks, 2 per DP rank)
    attention = SimpleNamespace(tp_size=4, dp_size=2, enable_dp_attention=True)
    sockets = [
        control_socket_of_rank(
            SOCKET, *run_scheduler_process(attention, tp_rank=tp, pp_rank=0, dp_rank=None)
        )
        for tp in range(4)
    ]
    assert sockets == [SOCKET, None, f"{SOCKET}.dp1", None]
    assert control_socket_of_rank(SOCKET, 0, 1, None, 1) is None  # a later pipeline stage


def run_data_parallel_controller_process() -> bool:  # SGLang's name for the DP controller
    return in_dp_controller()


def test_the_dp_controller_is_told_apart_from_the_schedulers() -> None:
    """SGLang's DP controller loads the plugins and has the scheduler module imported (it starts
    the ranks), but schedules nothing: the plugin registers nothing there, else its driver took
    the control socket DP rank 0 must serve and rank 0 refused to start (seen with
    ``--dp-size 2`` on CPU)."""
    assert run_data_parallel_controller_process()
    assert not in_dp_controller()  # a scheduler process, or any other
