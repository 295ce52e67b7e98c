"""The tcp backend: a mesh of authenticated sockets (TCP between hosts, Unix sockets and shared
memory within one), with the collective algorithms on top."""
