"""Clock offsets from store round trips: three ranks as threads over a real TCPStore."""

from __future__ import annotations

import threading

from shoal.collectives.store.tcp import TCPStore
from shoal.launcher.trace_clock import estimate


def test_offsets_on_one_host_are_zero_within_the_stated_error():
    results: dict[int, dict] = {}
    errors: list[BaseException] = []
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=10) as master:

        def rank(r: int) -> None:
            try:
                with TCPStore("127.0.0.1", master.port, timeout=10) as client:
                    results[r] = estimate(client, r, 3, "clk/test", rounds=5, timeout=10)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert results[0] == {"offset_us": 0.0, "error_us": 0.0, "reference_rank": 0,
                          "method": "reference"}
    for r in (1, 2):
        est = results[r]
        assert est["error_us"] > 0
        # one machine, one clock: the true offset is 0, inside the estimate's error bound
        assert abs(est["offset_us"]) <= est["error_us"] + 1.0, est
