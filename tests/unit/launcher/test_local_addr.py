"""shoal run's --local-addr: where the other nodes reach this one."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("flag", ["--local-addr", "--local_addr"])
def test_shoal_run_refuses_a_local_addr_that_is_not_this_hosts(flag, capsys):
    from shoal.launcher.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
              "127.0.0.1:2379", flag, "192.0.2.77", "--auth-token-file", __file__, __file__])
    assert exit_info.value.code == 2
    assert ("argument --local-addr/--local_addr: '192.0.2.77' is not an address of this host"
            in capsys.readouterr().err)
