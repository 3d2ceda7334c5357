"""What a guest of another account sends its host, and what a host may ask the guest's broker: parsed defensively."""

from __future__ import annotations

import json

from deeppool.coordinator.guest import Request
from deeppool.multiplex.cpu import _last_line
from deeppool.multiplex.metrics import RankBackground


def test_a_guests_statistics_keep_only_well_formed_numbers() -> None:
    line = (b'{"steps": 1e400, "samples": 16, "busy_s": "lots", "tokens": true, "start_step": -3, '
            b'"losses": [0.5, NaN, "x", 0.25], "spans": [[1, 2], [1, "a"], [3], [4, 5, 6]], '
            b'"window_busy_ms": [2.0, Infinity, 3.0, -1], "error": ["not", "a", "string"]}\n')
    parsed = RankBackground.parse(1, 42, _last_line(b"ready\n" + line), 0, closed_ms=[10.0, 11.0, 12.0, 13.0])
    assert (parsed.steps, parsed.samples, parsed.busy_s, parsed.tokens, parsed.start_step) == (0, 16, 0.0, 0, 0)
    assert parsed.losses == (0.5, 0.25) and parsed.spans == ((1.0, 2.0),) and parsed.error is None
    assert parsed.windows == ((10.0, 2.0), (11.0, 0.0), (12.0, 3.0), (13.0, 0.0))  # each still beside its window
    nothing = RankBackground.parse(1, 42, _last_line(b'{"steps": 3'), -9)  # cut short: as if nothing was sent
    assert nothing.steps == 0 and nothing.error == "killed by SIGKILL (out of memory?)"
    odd = RankBackground.parse(1, 42, json.loads('[1, 2]'), -200)
    assert odd.error == "exited with code -200"


def test_a_host_may_ask_only_for_a_measurement_or_a_ranks_process() -> None:
    assert Request.parse(b'{"op": "child", "rank": 3, "model": "/etc/shadow"}') == Request(op="child", rank=3)
    assert Request.parse(b'{"op": "measure"}') == Request(op="measure")
    for refused in (b'{"op": "child", "rank": true}', b'{"op": "child", "rank": -1}', b'{"op": "child", "rank": 5000}',
                    b'{"op": "shell", "argv": ["sh"]}', b"[[[[", b'"child"', b""):
        assert Request.parse(refused) is None, refused
