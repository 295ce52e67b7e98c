"""Key-value stores: the TCP store (client, server, wire, state), file, hash and prefix stores.

The public names are re-exported by `shoal.collectives`.
"""
