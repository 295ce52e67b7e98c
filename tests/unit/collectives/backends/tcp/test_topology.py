"""`Topology`: which ranks of a tcp group share a host, from the identities they publish (the
collectives that run on it, with ranks as threads, are in tests/multiproc/test_tcp_two_level.py)."""

from shoal.collectives.backends.tcp import topology as topo


def test_topology_groups_ranks_by_identity_in_rank_order():
    t = topo.from_identities(["b", "a", "b", "", "a", None])
    assert t.hosts == ((0, 2), (1, 4), (3,), (5,))
    assert t.host_of(4) == 1 and t.local_ranks(4) == (1, 4) and t.local_index(4) == 1
    assert t.leader(2) == 0
    assert t.spans_hosts and t.hierarchical and not t.uniform
    assert t.leaders_per_host == 1  # the smallest host has one rank
    assert t.describe() == "0,2 | 1,4 | 3 | 5"


def test_topology_of_equal_hosts_and_leader_limits():
    t = topo.from_identities(["x", "x", "x", "y", "y", "y"])
    assert t.uniform and t.leaders_per_host == 3 and t.every_rank_leads
    assert t.cross_ranks(0) == (0, 3) and t.cross_ranks(2) == (2, 5)
    limited = topo.from_identities(["x", "x", "x", "y", "y", "y"], max_leaders=2)
    assert limited.leaders_per_host == 2 and not limited.every_rank_leads
    assert not topo.from_identities(["x", "x"]).hierarchical  # one host
    assert not topo.from_identities(["x", "y", "z"]).hierarchical  # one rank per host
