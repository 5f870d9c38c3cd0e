"""Speculative decoding: DDTree / DFlash-chain draft trees (tree.py), the accept walk (accept.py), the settings and
the round shape (config.py), the one generation loop (decode.py) over host-driven rounds (host_rounds.py) and
device-resident rounds (device_rounds.py, device_round.py, graph.py), budget auto (budget.py)."""
